"""``Choice``: what happens to one saved activation (a plan's entries; the runtime applies them)."""
from __future__ import annotations

import enum

__all__ = ["Choice"]


class Choice(enum.IntEnum):
    """What happens to one saved activation."""

    KEEP = 0  #: stays on the device
    OFFLOAD = 1  #: copied to pinned host memory in forward, reloaded before backward
    RECOMPUTE = 2  #: dropped in forward, recomputed in backward
