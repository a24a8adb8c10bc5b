"""The evaluation wing: `pretrain eval` on any checkpoint or export (`evaluate`), downstream tasks
scored as lm-evaluation-harness scores them (`tasks`), and `pretrain generate` (`generate`)."""
