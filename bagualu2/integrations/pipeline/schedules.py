"""The ``torch.distributed.pipelining`` schedules supported here, and where their stages live.

``SCHEDULES`` names each schedule (``gpipe``, ``1f1b``, ``interleaved1f1b``, ``zbv``,
``dualpipev``) with how many stages each rank holds and how stages are placed (``loop``: rank
r holds r, r+W, ...; ``v``: rank r holds r and 2W-1-r). ``schedule_spec`` resolves a name
(case, dashes, a ``Schedule`` prefix and a few aliases are forgiven) and refuses unknown ones
with the list of known names. ``stage_layout`` is the placement every rank computes on its
own, so all ranks agree on it without communicating.
"""
from __future__ import annotations

import dataclasses

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

__all__ = ["SCHEDULES", "ScheduleSpec", "schedule_spec", "stage_layout"]


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One torch schedule: its class, stages per rank and stage placement style."""

    name: str
    cls: type
    stages_per_rank: int
    style: str  # "loop" or "v"
    splits_backward: bool  # runs backward-input and backward-weight as separate actions

    def num_stages(self, world_size: int) -> int:
        return self.stages_per_rank * world_size

    def min_microbatches(self, world_size: int) -> int:
        """Fewest micro-batches torch accepts (or schedules correctly) for this world size."""
        if self.name == "gpipe":
            return 1
        if self.name == "zbv":
            return 2 * world_size - 1  # the ZBV action list assumes at least this many
        return self.num_stages(world_size) if self.name in ("1f1b", "dualpipev") else world_size


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("gpipe", ScheduleGPipe, 1, "loop", False),
        ScheduleSpec("1f1b", Schedule1F1B, 1, "loop", False),
        ScheduleSpec("interleaved1f1b", ScheduleInterleaved1F1B, 2, "loop", False),
        ScheduleSpec("zbv", ScheduleZBVZeroBubble, 2, "v", True),
        ScheduleSpec("dualpipev", ScheduleDualPipeV, 2, "v", True),
    )
}
_ALIASES = {"zbvzerobubble": "zbv", "interleaved": "interleaved1f1b", "dualpipe_v": "dualpipev"}


def schedule_spec(schedule: str) -> ScheduleSpec:
    key = schedule.lower().replace("-", "").replace("schedule", "")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[key]


def stage_layout(schedule: str, world_size: int) -> tuple[int, dict[int, list[int]]]:
    """(number of stages, rank -> sorted global stage indices) for ``schedule`` on ``world_size`` ranks."""
    spec = schedule_spec(schedule)
    n = spec.num_stages(world_size)
    rank_to_stages: dict[int, list[int]] = {r: [] for r in range(world_size)}
    for s in range(n):
        if spec.style == "loop":
            rank = s % world_size
        else:  # V: down the ranks on the first half, back up on the second
            rank = s if s < world_size else 2 * world_size - 1 - s
        rank_to_stages[rank].append(s)
    return n, rank_to_stages
