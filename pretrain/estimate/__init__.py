"""The estimate wing: a model of a run's costs before it is launched (memory, FLOPs, traffic, the
report and the layout table). The runtime may read it (Muon's assignment of matrices to ranks);
it reads nothing of the runtime."""
