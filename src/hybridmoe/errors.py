"""User-facing errors: each carries a one-line message that says what to do.

The CLI prints these as one line (no traceback); library users catch them as ValueError.
"""


class HybridMoEError(ValueError):
    """A mistake in what the user asked for or gave us (a path, a file, a parameter)."""


class CheckpointError(HybridMoEError):
    """A model directory or weight file that cannot be used as it is."""
