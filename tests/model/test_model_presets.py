"""Every named preset is a valid shape whose size matches its name (with a 32k vocabulary)."""

import pytest

from pretrain.model.args import PRESETS, ModelArgs
from pretrain.model.model import num_params


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_valid_and_sized(name):
    args = ModelArgs(**PRESETS[name], vocab_size=32000)
    assert args.problems() == []
    if name == "tiny":
        return
    target = float(name[:-1]) * {"m": 1e6, "b": 1e9}[name[-1]]
    assert abs(num_params(args) / target - 1) <= 0.15, (name, num_params(args))
