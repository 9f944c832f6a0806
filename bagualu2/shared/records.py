"""Frozen records of what one layer measured and another learns from.

Each is a ``NamedTuple``: immutable, with named fields, and read the same way as a tuple of the
same fields in the same order (what the cost model's ``observe`` methods were first given)."""
from __future__ import annotations

from typing import Mapping, NamedTuple, Tuple

__all__ = ["CopyTimes", "Measurements", "OpReplayTimes", "ReplayTimes", "SavedOp"]


class SavedOp(NamedTuple):
    """What a profiled forward measured of one saved operator key (the runtime's
    ``profile_saves``), for the cost model's ``observe``."""

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


class CopyTimes(NamedTuple):
    """What offloads and reloads cost the runtime's thread (``take_copy_times``), for the cost
    model's ``observe_copies``."""

    seconds: float
    """Seconds spent offloading (submitting, waiting for room), reloading (submitting, waiting,
    prefetching; a rebuild's offloaded inputs too) and releasing host copies."""
    offloads: int
    """Offloads started."""
    nbytes: int
    """Their bytes."""


class ReplayTimes(NamedTuple):
    """What backward's rebuilds of one operator key cost (``take_replay_times``), for the cost
    model's ``observe_replays``."""

    seconds: float
    """Seconds its unpacks spent rebuilding (reloads of offloaded inputs excluded)."""
    micro_batches: int
    """Micro-batches that rebuilt it."""


class OpReplayTimes(NamedTuple):
    """What backward's replays of one operator key's op call cost (``take_op_replay_times``),
    for the cost model's ``observe_op_replays``."""

    seconds: float
    """Seconds of the ``timed`` replays made inside a chain, inputs at hand."""
    timed: int
    """Replays timed inside a chain."""
    replays: int
    """Replays made in all."""
    lead_seconds: float
    """Seconds of the replays made as a rebuild's first call (timed apart)."""
    leads: int
    """Those replays."""


class Measurements(NamedTuple):
    """Everything the runtime measured since it was last asked (``take_measurements``; the
    provisioner asks as each backward pass ends: one micro-batch's), by operator key where it
    is per key."""

    op_replays: Mapping[str, OpReplayTimes]
    replays: Mapping[str, ReplayTimes]
    copies: CopyTimes
