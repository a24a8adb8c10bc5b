"""Errors from bad data input (missing source, unreadable tokenizer, mismatched resume state)."""


class DataError(Exception):
    """A user-fixable data problem; the message is one line that names the bad value and the fix."""

    exit_code = 2
