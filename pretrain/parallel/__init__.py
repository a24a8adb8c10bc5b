"""The parallel wing: how ranks work together. The `Dist` layout and its process groups and every
collective (`distributed`), DeepSpeed's config, engine, AutoTP, hpZ and compile (`parallelize`),
Ulysses sequence parallelism (`ulysses`), and the counter of the bytes collectives move (`traffic`)."""
