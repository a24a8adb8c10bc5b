"""Errors a user can cause. The CLI prints them as one line each and exits non-zero, no traceback."""

from data_pipeline.errors import DataError


class UserError(Exception):
    """A mistake in the user's input (config, data, checkpoint, run dir); the message says how to
    fix it. `collective`: every rank raised the same error (the CLI prints it on rank 0 only)."""

    exit_code = 2
    collective = False


class ConfigError(UserError):
    """One or more config problems, reported together. Every rank reads the same config, so every
    rank finds the same problems."""

    collective = True

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class NonFiniteStep(UserError):
    """A non-finite loss or gradient norm with train.on_nonfinite=stop, too many dropped steps in a
    row, or spikes past the last rollback; raised on every rank alike, before the update."""

    exit_code = 3
    collective = True


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or does not match the run, or a save that
    failed (a full disk)."""


class RunDirError(UserError):
    """A run dir in use by another process, or holding another run."""


def collective(error: Exception) -> Exception:
    """Mark an error that every rank raised alike: the CLI prints it once, on rank 0."""
    error.collective = True
    return error


# What the CLI reports as one line instead of a traceback.
USER_ERRORS = (UserError, DataError)
