"""The checkpoint's one error type, raised on every rank together."""
from __future__ import annotations

from .. import runtime


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


_MAX_LISTED = 8


def raise_agreed(comm, errors, context: str) -> None:
    """runtime.raise_agreed with checkpoint problems raised as CheckpointError."""
    runtime.raise_agreed(comm, errors, context, exc_type=CheckpointError, limit=_MAX_LISTED)
