"""Frozen records of what one layer measured and another learns from."""
from __future__ import annotations

from typing import NamedTuple, Tuple

__all__ = ["SavedOp"]


class SavedOp(NamedTuple):
    """What a profiled forward measured of one saved operator key (the runtime's
    ``profile_saves``), for the cost model's ``observe``. A tuple of the same fields in the same
    order is read the same way."""

    nbytes: int
    """Device bytes of the storage it saved."""
    seconds: float
    """Measured seconds of its own ops."""
    recomputable: bool
    """Whether the runtime can rebuild it in backward."""
    unsaved_inputs: Tuple[str, ...] = ()
    """Keys of the storages nothing saved that rebuilding it rebuilds first."""
    saved_inputs: Tuple[str, ...] = ()
    """Saved keys its rebuild reads."""
