"""Errors a user can cause. The CLI prints them as one line each and exits non-zero, no traceback."""

from data_pipeline.errors import DataError


class UserError(Exception):
    """A mistake in the user's input (config, data, checkpoint); the message says how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """One or more config problems, reported together."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or does not match the run."""


# What the CLI reports as one line instead of a traceback.
USER_ERRORS = (UserError, DataError)
