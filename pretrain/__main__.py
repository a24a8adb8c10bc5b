import sys

from pretrain.cli import main

sys.exit(main())
