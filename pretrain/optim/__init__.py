"""The optimizer wing: parameter roles and groups with their learning-rate and decay rules, AdamW
and Muon (`optimizer`), Muon's step on ZeRO-3 partitions (`muon`), and the learning-rate schedules,
WSD-S branches included (`schedule`)."""
