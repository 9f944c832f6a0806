"""Following overlap schedules on a pipeline rank.

:class:`OverlapDriver` plans each forward/backward pair with the overlap scheduler
(``bagualu2.plan.overlap``: the schedule model, the DP and :class:`PairProblem`) and makes the
activation runtime issue reloads and early recomputes where the schedule says.
``enable_bagualu2(pipe, overlap=True)`` installs it as a ``PipelinePhaseTracker`` subscriber
(:meth:`OverlapDriver.on_event`); a pair can also be driven by hand. It sits with the pipeline
integration, not with the planners, because the pairs it schedules exist only on a pipeline
rank and it follows the tracker's actions; it reaches the runtime only through the runtime's
events and overlap methods (docs/CONTRACTS.md), so this module imports neither the runtime nor
the provisioner.

For a forward ``F`` that runs right before the backward ``B`` of an earlier micro-batch, the
op sequence is ``F``'s operators (the keys ``B``'s forward saved, in forward order, grouped
into at most ``segments`` contiguous ops, with the cost model's times), the measured idle gap
between them (the bubble: the rank waits for ``B``'s gradient), then the same ops in reverse
for ``B``. The tasks are ``B``'s host copies (RELOAD, one per backward op that consumes them), ``B``'s
recomputed storages (RECOMPUTE, likewise grouped) and the offloads ``F`` is expected to make
(OFFLOAD, memory only). Issue points map to runtime events:

==================  ==========================================================================
after forward op i  ``F`` has saved as many operator keys as ops 0..i hold (``Frame.on_saved``):
                    due reloads are issued
after the last      ``F``'s end (the tracker's ``action_end``): due reloads are issued and the
forward op          early recomputes start on a worker thread, which runs while the rank waits
                    for ``B``'s gradient
after the bubble    ``B``'s start (``action_begin``): the worker is joined, due reloads issued
before backward     ``B`` unpacks a key of op c (``ActivationRuntime.on_released_unpack``): reloads
op c                due before c are issued
==================  ==========================================================================

``B``'s frame is marked ``scheduled``: its backward issues no reloads beyond the schedule's
(a reload the schedule did not issue in time is made synchronously, never lost). Prefetched
buffers and early-recomputed storages are charged to the runtime's ledger from issue until
use (early ones until ``B`` ends). The schedule's memory model is an estimate, the budget is
not: a reload that would take the ledger over the runtime's budget when it is due waits for
the next point (``reloads_deferred``), and an early recompute that would is left to
backward. Without a runtime budget the schedule is held to the peak lazy issue would reach.
The worker runs only between ``F``'s end and ``B``'s start, when this rank's schedule is only
communicating: it is joined before any autograd work.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from bagualu2.plan.overlap import (OverlapOp, OverlapScheduler, OverlapTask, PairProblem, Schedule, TaskKind,
                                   simulate)
from bagualu2.plan.planner import Choice

__all__ = ["OverlapDriver"]


def _bucket(x: float, per_doubling: int = 8) -> int:
    """Logarithmic bucket of a non-negative size or time."""
    return 0 if x < 1 else 1 + int(math.log2(x) * per_doubling)


@dataclass
class _Pair:
    problem: PairProblem
    schedule: Schedule
    backward: Any  # the Frame whose backward comes next
    backward_tag: Any
    reloads: List[int]  # RELOAD task indices in issue order
    early: List[int]  # early RECOMPUTE task indices in consumer order
    next_reload: int = 0
    forward_ops: int = 0  # operator keys the paired forward has saved so far
    forward: Any = None
    saves_heard: Any = None  # the subscription to the forward's first saves (Frame.on_saved)
    unpacks_heard: Any = None  # ... to the backward's released unpacks
    worker: Optional[threading.Thread] = None
    pins: List[Any] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


class OverlapDriver:
    """Plans each forward/backward pair with :class:`OverlapScheduler` and makes the
    activation runtime issue reloads and early recomputes where the schedule says.

    Args:
        runtime: the ``ActivationRuntime`` to drive (``Provisioner.runtime``).
        cost: the provisioner's ``CostModel`` (op times, copy bandwidths); without profiled
            times every op counts as equally long.
        budget_bytes: activation budget the schedules must hold (None: no limit), or where to
            read it: a callable asked as each pair is planned (a provisioner's budget, which
            ``Provisioner.budget`` may change between pairs: ``pipeline.enable_bagualu2`` passes
            it so; a number taken here would go stale).
        scheduler: an ``OverlapScheduler`` (its cache is shared by every pair).
        min_bubble_s: idle gaps shorter than this are not offered to early recomputes.
        counts: callable returning MoE layer -> tokens per expert to price ops with.
        segments: forward ops the DP sees at most (contiguous operator keys are grouped).

    Use :meth:`on_event` as a ``PipelinePhaseTracker`` subscriber, or drive a pair by hand
    with :meth:`pair`, :meth:`forward_end`, :meth:`backward_begin`, :meth:`backward_end`.
    """

    def __init__(self, runtime: Any, cost: Any = None,
                 budget_bytes: Union[int, None, Callable[[], Optional[int]]] = None,
                 scheduler: Optional[OverlapScheduler] = None, min_bubble_s: float = 1e-3,
                 counts: Any = None, segments: int = 16) -> None:
        if budget_bytes is not None and not callable(budget_bytes) and budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be >= 0 or None")
        if segments < 1:
            raise ValueError(f"segments={segments} must be >= 1")
        self.segments = segments
        if min_bubble_s < 0:
            raise ValueError(f"min_bubble_s={min_bubble_s} must be >= 0")
        self.runtime = runtime
        self.cost = cost
        self._budget = budget_bytes
        self.scheduler = scheduler or OverlapScheduler()
        self.min_bubble_s = min_bubble_s
        self._counts = counts or (lambda: {})
        self._pair: Optional[_Pair] = None
        self._frames: Dict[Any, Any] = {}  # tag -> the Frame that ran its forward (this step)
        self._running: Any = None  # tag of the forward now running
        self._bubble_s: Dict[Any, float] = {}  # stage -> smoothed idle gap before a backward
        self._forward_end_at: Optional[float] = None
        self.stats: Dict[str, float] = {
            "pairs": 0, "cache_hits": 0, "decision_s": 0.0, "reloads_forward": 0,
            "reloads_bubble": 0, "reloads_backward": 0, "reloads_deferred": 0, "early_recomputes": 0,
            "worker_errors": 0, "predicted_exposed_s": 0.0, "predicted_lazy_exposed_s": 0.0,
            "infeasible": 0,
        }
        self._frames_heard = runtime.on_frame_start.subscribe(self._on_frame)

    @property
    def budget_bytes(self) -> Optional[int]:
        """The budget the next pair's schedule will hold, read now from where it lives."""
        return self._budget() if callable(self._budget) else self._budget

    def close(self) -> None:
        """Finish any pair in progress and detach from the runtime (its other subscribers stay)."""
        self._finish()
        self._frames_heard.unsubscribe()

    def report(self) -> Dict[str, float]:
        """Counters: pairs scheduled, reloads issued per kind of point, early recomputes,
        predicted exposed time with the schedules and with lazy issue, decision time."""
        out = dict(self.stats)
        out["mean_decision_ms"] = 1e3 * self.stats["decision_s"] / max(1, self.stats["pairs"])
        return out

    # -- planning --------------------------------------------------------------------------
    def problem(self, backward: Any, bubble_s: float = 0.0) -> PairProblem:
        """The DP's input for the next forward followed by ``backward``'s backward.

        The forward's operator keys (those ``backward``'s forward saved, in forward order) are
        grouped into at most ``segments`` contiguous ops; the backward has the same ops in
        reverse. Tasks with the same op are merged (one reload per backward op, one recompute
        group per backward op), so the DP stays small whatever the model's size.

        Args:
            backward: the ``Frame`` whose backward runs after the next forward.
            bubble_s: expected idle time between that forward's end and the backward.
        """
        keys = list(backward.keys_seen)
        n = len(keys)
        g = min(n, self.segments)
        segment_of = [i * g // n for i in range(n)]
        segment_end = [0] * g
        for i, seg in enumerate(segment_of):
            segment_end[seg] = i
        seconds = self._op_seconds(keys, self._counts() or {})
        fwd = [0.0] * g
        kept = [0] * g
        offloaded = [0] * g
        for i, k in enumerate(keys):
            fwd[segment_of[i]] += seconds[i]
            choice = backward.choice(k)
            if choice == Choice.KEEP:
                kept[segment_of[i]] += backward.keys_seen[k]
            elif choice == Choice.OFFLOAD:
                offloaded[segment_of[i]] += backward.keys_seen[k]
        base0 = int(self.runtime.ledger.resident)
        ops: List[OverlapOp] = []
        grown = 0
        for seg in range(g):
            grown += kept[seg]
            ops.append(OverlapOp(fwd[seg], base0 + grown))
        bubble = None
        if bubble_s >= self.min_bubble_s:
            bubble = len(ops)
            ops.append(OverlapOp(bubble_s, base0 + grown, bubble=True))
        start_b = len(ops)
        freed = 0
        for seg in reversed(range(g)):
            ops.append(OverlapOp(2.0 * fwd[seg], base0 + grown - freed))
            freed += kept[seg]
        backward_op = {k: start_b + (g - 1 - segment_of[i]) for i, k in enumerate(keys)}
        d2h = getattr(self.cost, "d2h_bandwidth", 10e9)
        h2d = getattr(self.cost, "h2d_bandwidth", 10e9)
        tasks: List[OverlapTask] = []
        targets: List[Any] = []
        for seg in range(g):  # the forward offloads what the backward frame offloaded
            if offloaded[seg]:
                tasks.append(OverlapTask(TaskKind.OFFLOAD, seg, offloaded[seg] / d2h, offloaded[seg]))
                targets.append(None)
        reloads: Dict[int, List[Any]] = {}
        for store in backward.offload_stores():
            if store.key in backward_op:
                reloads.setdefault(backward_op[store.key], []).append(store)
        for c, stores in sorted(reloads.items()):
            nbytes = sum(st.nbytes for st in stores)
            tasks.append(OverlapTask(TaskKind.RELOAD, c, nbytes / h2d, nbytes))
            targets.append(stores[::-1])  # backward needs the later ones first
        key_seconds = dict(zip(keys, seconds))
        recomputes: Dict[int, List[Tuple[Any, int, float]]] = {}
        for key, node, state in backward.recompute_nodes():
            if key in backward_op:
                recomputes.setdefault(backward_op[key], []).append((node, state, key_seconds.get(key, 0.0)))
        for c, group in sorted(recomputes.items()):
            tasks.append(OverlapTask(TaskKind.RECOMPUTE, c, sum(x[2] for x in group),
                                     sum(x[0].nbytes for x in group)))
            targets.append([(node, state) for node, state, _ in group])
        problem = PairProblem(ops, tasks, bubble, backward_op, targets, 0, segment_of, segment_end)
        budget = self.budget_bytes
        if budget is not None:
            problem.budget_bytes = int(budget)
        else:  # no budget: overlap without raising the peak that lazy issue has
            problem.budget_bytes = simulate(ops, tasks, problem.lazy(), 1 << 62)[2]
        return problem

    def _op_seconds(self, keys: List[str], counts: Dict[int, List[int]]) -> List[float]:
        cost = self.cost
        ops = getattr(cost, "ops", {}) or {}
        raw = [max(0.0, ops[k].seconds(cost.driving_tokens(ops[k], counts))) if k in ops else 0.0 for k in keys]
        total = getattr(cost, "forward_seconds", 0.0) or 0.0
        if sum(raw) > 0 and total > 0:
            return [t * total / sum(raw) for t in raw]
        if total > 0 and keys:
            return [total / len(keys)] * len(keys)
        return [1e-3] * len(keys)

    def pair(self, backward: Any, schedule: Optional[Schedule] = None, *, bubble_s: float = 0.0,
             stage: int = 0, phase: int = 2, tag: Any = None) -> Schedule:
        """Arm the next forward and ``backward``'s backward to follow a schedule.

        Args:
            backward: the ``Frame`` whose backward follows the next forward.
            schedule: a given schedule for ``problem(backward, bubble_s)``; None runs the DP
                (cached by stage, task signature, phase and budget).
            bubble_s, stage, phase: the pair's expected idle gap, stage index and pipeline phase.
            tag: what ``backward_begin`` events will name this backward with (pipeline use).

        Returns:
            The schedule being followed (lazy issue when the DP found none feasible).
        """
        self._finish()
        problem = self.problem(backward, bubble_s)
        if schedule is None:
            schedule = self._solve(problem, stage, phase)
        elif len(schedule.issue_after) != len(problem.tasks):
            raise ValueError(f"the schedule places {len(schedule.issue_after)} tasks, the pair has "
                             f"{len(problem.tasks)}; build it from OverlapDriver.problem()")
        reloads = [j for j in schedule.issue_order(problem.tasks) if problem.tasks[j].kind == TaskKind.RELOAD]
        early = sorted((j for j, t in enumerate(problem.tasks)
                        if t.kind == TaskKind.RECOMPUTE and schedule.early[j]),
                       key=lambda j: (problem.tasks[j].op, j))
        self._pair = _Pair(problem, schedule, backward, tag, reloads, early)
        backward.scheduled = True
        return schedule

    def _solve(self, problem: PairProblem, stage: int, phase: int) -> Schedule:
        # The key holds the pair's structure exactly (which ops have which tasks) and its
        # totals (bytes and time per task kind, resident bytes, bubble) in 41% buckets: loads
        # vary from micro-batch to micro-batch, and a schedule made for the same structure at a
        # similar load is a good one. It is always a valid one (issue points depend only on the
        # structure), and the budget is checked again at every issue.
        totals = [[0, 0.0] for _ in TaskKind]
        for t in problem.tasks:
            totals[int(t.kind)][0] += t.nbytes
            totals[int(t.kind)][1] += t.duration_s
        signature = hash((
            tuple((int(t.kind), t.op, t.earliest) for t in problem.tasks),
            tuple((_bucket(b, 2), _bucket(d * 1e6, 2)) for b, d in totals),
            tuple(o.bubble for o in problem.ops),
            _bucket(sum(o.duration_s for o in problem.ops) * 1e6, 2),
            _bucket(max((o.base_bytes for o in problem.ops), default=0), 2),
        ))
        key = (int(stage), signature & ((1 << 62) - 1), int(phase), _bucket(problem.budget_bytes))
        t0 = time.perf_counter()
        schedule = self.scheduler.schedule(problem.ops, problem.tasks, problem.budget_bytes, cache_key=key)
        self.stats["decision_s"] += time.perf_counter() - t0
        self.stats["pairs"] += 1
        self.stats["cache_hits"] += int(schedule.cache_hit)
        if not schedule.feasible:
            self.stats["infeasible"] += 1
            schedule = problem.lazy()
        self.stats["predicted_exposed_s"] += schedule.exposed_s if schedule.feasible else 0.0
        self.stats["predicted_lazy_exposed_s"] += simulate(problem.ops, problem.tasks, problem.lazy(),
                                                           problem.budget_bytes)[1]
        return schedule

    # -- issue points ----------------------------------------------------------------------
    def _on_frame(self, frame: Any) -> None:
        if self._running is not None:
            self._frames[self._running] = frame  # a Frame holds only weak references to its data
        pair = self._pair
        if pair is not None and pair.forward is None and frame is not pair.backward:
            pair.forward = frame
            pair.saves_heard = frame.on_saved.subscribe(lambda key: self._forward_op_done(pair))
            self._issue_until(-1, "reloads_forward")

    def _forward_op_done(self, pair: _Pair) -> None:
        # Progress is the count of operator keys the forward has saved (first-save order can
        # differ between micro-batches, the count cannot).
        pair.forward_ops += 1
        self._issue_until(pair.problem.completed(pair.forward_ops), "reloads_forward")

    def _issue_until(self, op: int, counter: str) -> None:
        pair = self._pair
        if pair is None:
            return
        while pair.next_reload < len(pair.reloads):
            j = pair.reloads[pair.next_reload]
            if pair.schedule.issue_after[j] > op:
                break
            if self.runtime.residency.would_cross(pair.problem.tasks[j].nbytes):
                self.stats["reloads_deferred"] += 1
                break  # no room now (the plan's estimate was short): retry at the next point
            pair.next_reload += 1
            for store in pair.problem.targets[j]:
                if not store.handle.released and self.runtime.residency.prefetch(store):
                    self.stats[counter] += 1

    def forward_end(self) -> None:
        """The paired forward ended: issue the reloads due by now and start early recomputes."""
        pair = self._pair
        if pair is None:
            return
        self._unsubscribe(pair)
        self._issue_until(len(pair.problem.segment_end) - 1, "reloads_forward")
        if pair.early:
            pair.worker = threading.Thread(target=self._run_early, args=(pair, torch.get_num_threads()),
                                           daemon=True, name="bagualu2-early-recompute")
            pair.worker.start()

    def _run_early(self, pair: _Pair, threads: int) -> None:
        # OpenMP's thread count is per thread: a new thread starts from the process default,
        # not from torch.set_num_threads(), until ATen initializes it, and a kernel split over
        # another number of threads may round differently (a pipeline rank running with one
        # thread saw its rebuilt activations differ in the last bits). Use the caller's count.
        torch.set_num_threads(threads)
        for j in pair.early:
            for node, state in pair.problem.targets[j]:
                if self.runtime.residency.would_cross(node.nbytes):
                    return  # this and the later ones are recomputed by backward when needed
                try:
                    pair.pins.append(self.runtime.residency.recompute_ahead(node, state))
                except Exception as e:  # backward will recompute it late; nothing is lost
                    pair.errors.append(f"{node.key}: {e}")
                    return

    def backward_begin(self) -> None:
        """The paired backward starts: join the early recomputes, issue the reloads due after
        the bubble, and follow the schedule through the backward's unpacks."""
        pair = self._pair
        if pair is None:
            return
        self._join(pair)
        if pair.problem.bubble is not None:
            self._issue_until(pair.problem.bubble, "reloads_bubble")
        backward_op = pair.problem.backward_op
        if pair.unpacks_heard is not None:  # begun again: one subscription per pair
            pair.unpacks_heard.unsubscribe()
        pair.unpacks_heard = self.runtime.residency.on_released_unpack.subscribe(
            lambda key: self._issue_until(backward_op[key] - 1, "reloads_backward") if key in backward_op else None)

    def _join(self, pair: _Pair) -> None:
        if pair.worker is not None:
            pair.worker.join()
            pair.worker = None
            self.stats["early_recomputes"] += len(pair.pins)
            if pair.errors:
                self.stats["worker_errors"] += len(pair.errors)

    def backward_end(self) -> None:
        """The paired backward ended: release what the pair held."""
        self._finish()

    def _finish(self) -> None:
        pair, self._pair = self._pair, None
        if pair is None:
            return
        self._join(pair)
        self._unsubscribe(pair, unpacks=True)
        pair.backward.scheduled = False
        for pin in pair.pins:
            pin.drop()

    @staticmethod
    def _unsubscribe(pair: _Pair, unpacks: bool = False) -> None:
        """End the pair's subscription to its forward's first saves (and with ``unpacks``, to
        the backward's unpacks), and drop it: the first one's function refers to the pair."""
        for name in ("saves_heard", "unpacks_heard") if unpacks else ("saves_heard",):
            heard = getattr(pair, name)
            if heard is not None:
                heard.unsubscribe()
                setattr(pair, name, None)

    # -- pipeline tracker adapter ----------------------------------------------------------
    def on_event(self, event: str, state: Any) -> None:
        """``PipelinePhaseTracker`` subscriber: pairs each forward with the backward that
        directly follows it on this rank, and maps the schedule's points to the actions."""
        now = time.perf_counter()
        if event == "action_begin":
            tag = (state.stage_index, state.microbatch)
            if state.action == "F":
                self._running = tag
                nxt = state.upcoming[0] if state.upcoming else None
                if nxt is not None and nxt[0] in ("B", "I"):
                    backward = self._frames.get((nxt[1], nxt[2]))
                    if backward is not None and (backward.offload_stores() or backward.recompute_nodes()):
                        # The measured gap, rounded down to a power of two: conservative, and
                        # stable from step to step, so pairs find their schedule in the cache.
                        gap = self._bubble_s.get(nxt[1], 0.0)
                        bubble = 2.0 ** math.floor(math.log2(gap)) if gap > 0 else 0.0
                        self.pair(backward, bubble_s=bubble, stage=nxt[1],
                                  phase=int(state.phase), tag=(nxt[1], nxt[2]))
            elif state.action in ("B", "I"):
                if self._forward_end_at is not None:
                    gap = now - self._forward_end_at
                    old = self._bubble_s.get(state.stage_index)
                    self._bubble_s[state.stage_index] = gap if old is None else 0.5 * (old + gap)
                self._forward_end_at = None
                if self._pair is not None and self._pair.backward_tag == tag:
                    self.backward_begin()
        elif event == "action_end":
            if state.action == "F":
                self._running = None
                self._forward_end_at = now
                if self._pair is not None and self._pair.forward is not None:
                    self.forward_end()
            elif state.action in ("B", "I"):
                self._forward_end_at = None
                if self._pair is not None and self._pair.backward_tag == (state.stage_index, state.microbatch):
                    self.backward_end()
        elif event == "step_end":
            self._finish()
            self._frames.clear()
