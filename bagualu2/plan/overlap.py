"""Overlap scheduler ("dual-batch fusion"): when to issue offloads, reload prefetches and early
recomputes on a pipeline stage's upcoming op sequence.

In steady state a stage runs the forward of one micro-batch interleaved with the backward of
another. Copies and recompute cost nothing when they run while the device is busy with other
work or idle in a pipeline bubble. :class:`OverlapScheduler` (C++ DP, csrc/sched/
overlap_scheduler.h) picks, for every task, the op index after which the runtime issues it, so
that the predicted exposed time is minimal under the memory budget.

This module holds the schedule model only: its inputs (:class:`OverlapOp`,
:class:`OverlapTask`, :class:`PairProblem`), its output (:class:`Schedule`), the DP's facade
and :func:`simulate`. It knows nothing of the activation runtime or of pipelines; the driver
that makes the runtime follow schedules on a pipeline rank is
``bagualu2.integrations.pipeline.overlap_driver``.

The model (shared by the DP and by :func:`simulate`, the pure-Python reference):

- Ops run back to back on a fixed timeline; ``bubble`` ops are idle compute.
- OFFLOAD: issued right after its producer op on the one D2H channel (FIFO, producer order);
  its bytes stay resident until the copy completes.
- RELOAD: issued after an op in ``[earliest, consumer - 1]`` on the one H2D channel (FIFO in
  issue order, which follows consumer order); resident from issue until its consumer ends; a
  consumer whose reload is late stalls for the difference.
- RECOMPUTE: late (right before its consumer, fully exposed) or early, at the start of a bubble
  before its consumer (resident from then on; a bubble's overflow is exposed). Early
  recomputes form a prefix in consumer order.
- Memory during every op: ``base_bytes`` + resident task bytes ``<= budget_bytes``.
- ``exposed_s`` = stalls + late recompute time + bubble overflow, on the fixed timeline (an
  upper bound of the real makespan increase: a stall only gives later copies more time).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bagualu2._C import OverlapScheduler as NativeOverlapScheduler

__all__ = ["TaskKind", "OverlapOp", "OverlapTask", "Schedule", "OverlapScheduler", "simulate",
           "PairProblem"]


class TaskKind(enum.IntEnum):
    OFFLOAD = 0  #: D2H copy after its producer op
    RELOAD = 1  #: H2D prefetch before its consumer op
    RECOMPUTE = 2  #: recomputation before its consumer op (early: in a bubble)


@dataclass(frozen=True)
class OverlapOp:
    """One (possibly merged) op of the stage's upcoming sequence.

    Attributes:
        duration_s: compute time from the cost model (idle time for a bubble).
        base_bytes: device bytes in use during the op, task tensors excluded.
        bubble: idle compute (waiting on a pipeline neighbour); early recomputes may fill it.
    """

    duration_s: float
    base_bytes: int = 0
    bubble: bool = False


@dataclass(frozen=True)
class OverlapTask:
    """A copy or recomputation to place.

    Attributes:
        kind: OFFLOAD, RELOAD or RECOMPUTE.
        op: producer op index (OFFLOAD) or consumer op index (RELOAD, RECOMPUTE).
        duration_s: copy time (from the copy bandwidth) or recompute time.
        nbytes: device bytes the task's tensor occupies while resident.
        earliest: RELOAD/RECOMPUTE only: first op index it may be issued after (-1: start).
    """

    kind: TaskKind
    op: int
    duration_s: float
    nbytes: int = 0
    earliest: int = -1


@dataclass(frozen=True)
class Schedule:
    """Where each task is issued.

    Attributes:
        issue_after: per task, the op index after which the runtime issues it (-1: before op 0).
        early: per task, True for a recompute run early in a bubble.
        feasible: False when even the lazy schedule exceeds the budget (then it is returned).
        exposed_s: predicted exposed time (module docstring).
        peak_bytes: predicted peak device bytes.
        merged_ops: number of ops the DP ran on after merging.
        cache_hit: whether this came from the scheduler's cache.
    """

    issue_after: Tuple[int, ...]
    early: Tuple[bool, ...]
    feasible: bool
    exposed_s: float
    peak_bytes: int
    merged_ops: int = 0
    cache_hit: bool = False

    def issue_order(self, tasks: Sequence[OverlapTask]) -> List[int]:
        """Task indices in the order the runtime issues them: by issue point; at one point
        offloads, then reloads, then recomputes, each in op order."""
        return sorted(range(len(tasks)),
                      key=lambda j: (self.issue_after[j], int(tasks[j].kind), tasks[j].op, j))

    def at(self, op_index: int, tasks: Sequence[OverlapTask]) -> List[int]:
        """Task indices to issue right after op ``op_index`` (-1: before the first op)."""
        return [j for j in self.issue_order(tasks) if self.issue_after[j] == op_index]


class OverlapScheduler:
    """Exact DP for the model in the module docstring, with a schedule cache.

    Args:
        cache_capacity: schedules kept (LRU) by ``cache_key``.
        merge: fuse runs of compute ops with no task boundary before the DP (fewer states;
            memory of a run is its maximum, so the result stays valid).
    """

    def __init__(self, cache_capacity: int = 256, merge: bool = True) -> None:
        self._impl = NativeOverlapScheduler(int(cache_capacity), bool(merge))

    def schedule(
        self,
        ops: Sequence[OverlapOp],
        tasks: Sequence[OverlapTask],
        budget_bytes: int,
        cache_key: Optional[Tuple[int, int, int, int]] = None,
    ) -> Schedule:
        """Place every task.

        Args:
            ops: the stage's upcoming op sequence.
            tasks: offloads, reloads and recomputes on it.
            budget_bytes: device memory budget.
            cache_key: optional (stage, load bucket, phase, budget bucket); the same key
                returns the stored schedule without running the DP, so the caller must key
                everything the schedule depends on.

        Raises:
            ValueError: negative or non-finite durations or bytes, task op out of range,
                ``earliest`` not before the consumer.
        """
        if cache_key is not None:  # hit: no column conversion at all
            stored = self._impl.cached(*(int(k) for k in cache_key))
            if stored is not None:
                issue, early, feasible, exposed, peak, merged, hit = stored
                return Schedule(tuple(issue), tuple(early), feasible, exposed, peak, merged, hit)
        issue, early, feasible, exposed, peak, merged, hit = self._impl.schedule_columns(
            [o.duration_s for o in ops], [o.base_bytes for o in ops], [o.bubble for o in ops],
            [int(t.kind) for t in tasks], [t.op for t in tasks], [t.earliest for t in tasks],
            [t.duration_s for t in tasks], [t.nbytes for t in tasks], int(budget_bytes),
            None if cache_key is None else [int(k) for k in cache_key])
        return Schedule(tuple(issue), tuple(early), feasible, exposed, peak, merged, hit)

    def cache_stats(self) -> Dict[str, float]:
        """``{"hits", "misses", "hit_rate", "mean_lookup_us", "evictions", "size", "capacity"}``
        of the schedule cache (csrc/sched/lru_cache.h)."""
        return self._impl.cache_stats()

    def clear_cache(self) -> None:
        self._impl.clear_cache()


def simulate(
    ops: Sequence[OverlapOp], tasks: Sequence[OverlapTask], schedule: Schedule, budget_bytes: int
) -> Tuple[bool, float, int]:
    """Reference evaluation of any schedule under the model: ``(fits_budget, exposed_s,
    peak_bytes)``. Pure Python and independent of the DP; raises ValueError when the schedule
    breaks a dependency (issue before producer/earliest, after consumer, reloads out of
    consumer order, early recompute not at a bubble)."""
    n = len(ops)
    start = [0.0] * (n + 1)
    for i, o in enumerate(ops):
        start[i + 1] = start[i] + o.duration_s

    def end(s: int) -> float:
        return 0.0 if s < 0 else start[s + 1]

    resident = [o.base_bytes for o in ops]
    exposed = 0.0
    # offloads: after their producer, FIFO in producer order
    free = 0.0
    for j in sorted((j for j, t in enumerate(tasks) if t.kind == TaskKind.OFFLOAD),
                    key=lambda j: (tasks[j].op, j)):
        t = tasks[j]
        if schedule.issue_after[j] != t.op:
            raise ValueError(f"offload {j} issued after op {schedule.issue_after[j]}, not after "
                             f"its producer {t.op}")
        free = max(free, end(t.op)) + t.duration_s
        for i in range(t.op + 1, n):
            if free > start[i]:
                resident[i] += t.nbytes
    # reloads: FIFO in issue order, which must follow consumer order
    rel = sorted((j for j, t in enumerate(tasks) if t.kind == TaskKind.RELOAD),
                 key=lambda j: (tasks[j].op, j))
    issue = [schedule.issue_after[j] for j in rel]
    if issue != sorted(issue):
        raise ValueError(f"reloads not issued in consumer order: {issue}")
    free = 0.0
    ready: Dict[int, float] = {}
    for j in rel:
        t, s = tasks[j], schedule.issue_after[j]
        if not t.earliest <= s < t.op:
            raise ValueError(f"reload {j} issued after op {s}, outside [{t.earliest}, {t.op - 1}]")
        free = max(free, end(s)) + t.duration_s
        ready[t.op] = max(ready.get(t.op, 0.0), free)
        for i in range(s + 1, t.op + 1):
            resident[i] += t.nbytes
    exposed += sum(max(0.0, c - start[q]) for q, c in ready.items())
    # recomputes: early ones fill the bubble they start, late ones are exposed
    rec = sorted((j for j, t in enumerate(tasks) if t.kind == TaskKind.RECOMPUTE),
                 key=lambda j: (tasks[j].op, j))
    flags = [bool(schedule.early[j]) for j in rec]
    if flags != sorted(flags, reverse=True):
        raise ValueError(f"early recomputes are not a prefix in consumer order: {flags}")
    bubble_work: Dict[int, float] = {}
    for j in rec:
        t, s = tasks[j], schedule.issue_after[j]
        if schedule.early[j]:
            b = s + 1
            if not (t.earliest <= s and b < t.op and ops[b].bubble):
                raise ValueError(f"early recompute {j} after op {s}: needs a bubble before "
                                 f"consumer {t.op} and earliest {t.earliest} <= {s}")
            bubble_work[b] = bubble_work.get(b, 0.0) + t.duration_s
            for i in range(b, t.op + 1):
                resident[i] += t.nbytes
        else:
            if s != t.op - 1:
                raise ValueError(f"late recompute {j} must be issued after op {t.op - 1}, got {s}")
            exposed += t.duration_s
            resident[t.op] += t.nbytes
    exposed += sum(max(0.0, w - ops[b].duration_s) for b, w in bubble_work.items())
    peak = max(resident, default=0)
    return peak <= budget_bytes, exposed, peak


@dataclass
class PairProblem:
    """The scheduler's input for one forward/backward pair, and what each task stands for.

    Attributes:
        ops, tasks: the DP's input (module docstring).
        bubble: index of the bubble op, or None when the measured gap was too short.
        backward_op: operator key -> index of the backward op that consumes it.
        targets: per task, what it acts on: the stores to reload (RELOAD, in backward order),
            the ``(node, state)`` to rebuild (RECOMPUTE, in forward order), None for the
            forward's OFFLOAD tasks.
        budget_bytes: the budget the schedule was made for (without a runtime budget: the
            peak lazy issue would reach, so overlapping never raises it).
        segment_of: forward key index -> forward op (segment) index.
        segment_end: forward op -> index of its last key.
    """

    ops: List[OverlapOp]
    tasks: List[OverlapTask]
    bubble: Optional[int]
    backward_op: Dict[str, int]
    targets: List[Any]
    budget_bytes: int
    segment_of: List[int]
    segment_end: List[int]

    def completed(self, saved: int) -> int:
        """The last forward op finished once the forward has saved ``saved`` keys (-1: none)."""
        if saved <= 0:
            return -1
        if saved >= len(self.segment_of):
            return len(self.segment_end) - 1
        seg = self.segment_of[saved - 1]
        return seg if self.segment_end[seg] == saved - 1 else seg - 1

    def lazy(self) -> Schedule:
        """What happens without a scheduler: every reload issued right before its consumer,
        every recompute late."""
        issue = tuple(t.op if t.kind == TaskKind.OFFLOAD else t.op - 1 for t in self.tasks)
        return Schedule(issue, tuple(False for _ in self.tasks), True, 0.0, 0)
