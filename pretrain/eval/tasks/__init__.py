"""Downstream tasks (multiple choice, schema, cloze), scored by log-likelihood as
lm-evaluation-harness scores them: `pretrain eval MODEL --tasks ...` and the in-loop task eval call
the same `TaskSuite`. The model and the trainer know nothing of tasks: they hand over a function from
tokens to logits (docs/evaluation.md)."""

from pretrain.eval.tasks.formats import FORMATS, Instance, metrics
from pretrain.eval.tasks.loaders import TASKS, load, task_name
from pretrain.eval.tasks.scoring import TaskSuite, loglikelihoods

__all__ = ["FORMATS", "Instance", "TASKS", "TaskSuite", "load", "loglikelihoods", "metrics", "task_name"]
