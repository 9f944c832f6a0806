"""Calibration: the adaptive micro-batches that release all they can, so that their backward
passes measure what releases cost before any plan relies on it.

Owns ``Calibration``: which micro-batches calibrate (it marks their frames ``calibrating``), how
many have, and how many that may have to release ran since the last. The first ``calibrate_frames`` after profiling,
where a plan may have to release, recompute all they can: their backward passes measure what
replaying each op costs (``CostModel.observe_op_replays``) and what rebuilds cost, before any
plan relies on them (a profiled forward's op times stand for a replay's only in part:
``CostModel``'s note). The first replays run cold; the next replace them, and plans refine both
as they rebuild. Recalibrations (one every ``recalibrate_every``) then go round a cycle:

- with a copy engine, every other one offloads everything: the copies' cost
  (``CostModel.observe_copies``) is then learned from many offloads of every size, beside the
  plans' few, and priced right for plans that offload more than those did (what a copy costs
  apart from its bytes, and per byte, is otherwise one factor);
- every other one that recomputes keeps half of the keys (every other key in save order, the
  two halves in turn): rebuilds are then measured at two sizes of plan, which tells the part
  that grows with a plan from the part that does not (one size alone cannot separate them).

What the runtime measured reaches the cost model through ``learn``, as each backward pass ends
and as each forward begins, calibrating or not: plans' own releases refine what calibration
measured.

Invariants: only a micro-batch that may have to release is asked (``Provisioner._calibrates``),
so calibration never slows a run whose worst routing fits; a calibrating micro-batch decides
nothing at its gates and does not become the last plan; the count since the last calibration
grows only with micro-batches that may have to release.
"""

from __future__ import annotations

from typing import Dict, List

from bagualu2.plan.cost_model import CostModel
from bagualu2.plan.planner import Choice
from bagualu2.runtime import ActivationRuntime, Frame

__all__ = ["Calibration", "learn"]

_RECALIBRATIONS = ("recompute all", "recompute half 0", "recompute all", "recompute half 1")
_RECALIBRATIONS_WITH_COPIES = tuple(k for kind in _RECALIBRATIONS for k in ("offload", kind))


def _calibration(recalibration: int, can_offload: bool) -> str:
    """What calibrating micro-batch ``recalibration`` releases (negative: one of the first
    ``calibrate_frames``): ``"recompute all"``, ``"recompute half 0"``/``"recompute half 1"``
    (the keys at even/odd places in save order are kept) or ``"offload"``."""
    if recalibration < 0:
        return "recompute all"
    cycle = _RECALIBRATIONS_WITH_COPIES if can_offload else _RECALIBRATIONS
    return cycle[recalibration % len(cycle)]


class Calibration:
    """Which micro-batches release all they can, to measure what releases cost."""

    def __init__(self) -> None:
        self._done = 0  # micro-batches that did so
        self._since = 0  # micro-batches that may have to release since the last one

    def begin(self, frame: Frame, cost: CostModel, can_offload: bool, first: int, every: int) -> bool:
        """Whether ``frame``, a micro-batch that may have to release, calibrates: one of the
        ``first`` after profiling, or one after ``every`` (0: never) such micro-batches since the
        last. If so it is marked ``calibrating`` and its plan set to release all it can, as the
        cycle says: a key no plan may recompute (``cost.ops``) is offloaded instead, or kept."""
        if not (self._done < first or 0 < every <= self._since):
            self._since += 1
            return False
        kind = _calibration(self._done - first, can_offload)
        frame.default = Choice.OFFLOAD if kind == "offload" else Choice.RECOMPUTE
        order = cost.order
        if kind != "offload":
            # Measuring a rebuild no plan will use costs a backward pass and may cross the budget
            # (the whole compiled model's rerun brings back every save at once).
            instead = Choice.OFFLOAD if can_offload else Choice.KEEP
            frame.replan({k: instead for k, op in cost.ops.items() if not op.recomputable})
        if kind.startswith("recompute half"):
            half = int(kind[-1])
            frame.replan({k: Choice.KEEP for i, k in enumerate(order) if i % 2 == half})
        frame.calibrating = True
        self._done += 1
        self._since = 0
        return True


def learn(cost: CostModel, runtime: ActivationRuntime, routed: Dict[int, List[int]]) -> None:
    """Hand what ``runtime`` measured since the last call to ``cost``: what replayed ops,
    rebuilds and copies cost, each at ``routed``, the loads of the forward whose backward ran
    (the last one outside a pipeline; rounded means would move a size-driven op's token count
    and bend its time's fit)."""
    measured = runtime.residency.take_measurements()
    if measured.op_replays:
        cost.observe_op_replays(measured.op_replays, routed)
    if measured.replays:
        cost.observe_replays(measured.replays, routed)
    if measured.copies.offloads:
        cost.observe_copies(*measured.copies)
