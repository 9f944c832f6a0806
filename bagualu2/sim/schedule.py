"""1F1B and interleaved-1F1B pipeline schedules as event-driven per-stage timelines.

A schedule is, per physical stage, the ordered list of actions ``(is_forward, microbatch,
chunk)``. Memory follows from the order alone (a forward adds the micro-batch's kept bytes, its
backward frees them), so the warm-up stacking of micro-batches is explicit: in 1F1B stage ``s``
of ``pp`` holds at most ``pp - s`` micro-batches. Times follow from an event-driven evaluation:
an action starts when its stage is free and its input has arrived (forward: the previous
virtual stage's forward plus a pipeline send; backward: the next virtual stage's backward plus a
send). The dependency graph is the same for every step, so :class:`Timeline` finds one
topological order once and then evaluates finish times for many steps at once (numpy vectors
over the step axis).

Interleaved order follows Megatron-LM's ``forward_backward_pipelining_with_interleaving``:
stage ``s`` runs ``(pp - s - 1) * 2 + (vpp - 1) * pp`` warm-up forwards, then one-forward-
one-backward, then the cool-down backwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["Action", "Timeline", "inflight_depth", "schedule", "slots_until_backward"]

Action = Tuple[bool, int, int]  # (is_forward, microbatch, chunk)


def _virtual(k: int, pp: int, vpp: int, forward: bool) -> Tuple[int, int]:
    """(microbatch, chunk) of the k-th forward/backward virtual micro-batch on a stage."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return group * pp + within % pp, chunk


def schedule(pp: int, vpp: int, microbatches: int, stage: int) -> List[Action]:
    """Ordered actions of ``stage`` under 1F1B (``vpp == 1``) or interleaved 1F1B.

    Args:
        pp: pipeline stages; vpp: chunks per stage; microbatches: micro-batches per step.
        stage: physical stage index in ``[0, pp)``.
    """
    assert 0 <= stage < pp, f"{stage=}, {pp=}"
    assert vpp == 1 or microbatches % pp == 0, f"{microbatches=} must be a multiple of {pp=}"
    total = microbatches * vpp
    if vpp == 1:
        warmup = min(pp - stage - 1, microbatches)
    else:
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    order: List[Action] = []
    # 1. warm-up: forwards only, micro-batches stack up
    for k in range(warmup):
        order.append((True, *_virtual(k, pp, vpp, True)))
    # 2. steady state: one forward, one backward
    for i in range(total - warmup):
        order.append((True, *_virtual(warmup + i, pp, vpp, True)))
        order.append((False, *_virtual(i, pp, vpp, False)))
    # 3. cool-down: the remaining backwards
    for i in range(total - warmup, total):
        order.append((False, *_virtual(i, pp, vpp, False)))
    return order


def inflight_depth(order: Sequence[Action]) -> int:
    """Most (micro-batch, chunk) activations resident at once on a stage following ``order``."""
    depth = peak = 0
    for fwd, _, _ in order:
        depth += 1 if fwd else -1
        peak = max(peak, depth)
    return peak


def slots_until_backward(order: Sequence[Action]) -> List[int]:
    """For each action, the forwards from it (inclusive) until the stage's next backward.

    This is what an online provisioner knows from the schedule: how many more micro-batches
    will stack on top of the one being planned before memory is released again.
    """
    out = [0] * len(order)
    run = 0
    for i in range(len(order) - 1, -1, -1):
        run = run + 1 if order[i][0] else 0
        out[i] = run
    return out


@dataclass
class Timeline:
    """Event-driven evaluation of one pipeline schedule, vectorized over steps.

    Args:
        pp, vpp, microbatches: schedule shape.
    """

    pp: int
    vpp: int
    microbatches: int

    def __post_init__(self) -> None:
        self.orders = [schedule(self.pp, self.vpp, self.microbatches, s) for s in range(self.pp)]
        self.topo = self._topological_order()

    def _dep(self, fwd: bool, mb: int, chunk: int, stage: int) -> Tuple[bool, int, int, int] | None:
        v = chunk * self.pp + stage
        last = self.pp * self.vpp - 1
        if fwd:
            if v == 0:
                return None
            pv = v - 1
            return True, mb, pv // self.pp, pv % self.pp
        if v == last:
            return True, mb, chunk, stage  # own forward, same stage (already earlier in order)
        nv = v + 1
        return False, mb, nv // self.pp, nv % self.pp

    def _topological_order(self) -> List[Tuple[int, int]]:
        """(stage, position) pairs in an order where every dependency comes first."""
        done: set = set()
        ptr = [0] * self.pp
        out: List[Tuple[int, int]] = []
        remaining = sum(len(o) for o in self.orders)
        while remaining:
            progress = False
            for s in range(self.pp):
                order = self.orders[s]
                while ptr[s] < len(order):
                    fwd, mb, c = order[ptr[s]]
                    dep = self._dep(fwd, mb, c, s)
                    if dep is not None and dep not in done:
                        break
                    done.add((fwd, mb, c, s))
                    out.append((s, ptr[s]))
                    ptr[s] += 1
                    remaining -= 1
                    progress = True
            if not progress:
                raise RuntimeError(f"pipeline schedule deadlocks: pp={self.pp}, vpp={self.vpp}, "
                                   f"microbatches={self.microbatches}")
        return out

    def run(self, dur: Dict[Tuple[bool, int, int, int], np.ndarray],
            send_s: float) -> Tuple[np.ndarray, np.ndarray]:
        """Finish times of every stage for all steps at once.

        Args:
            dur: ``(is_forward, microbatch, chunk, stage) -> seconds`` (array over steps or
                scalar).
            send_s: one pipeline send between consecutive virtual stages.

        Returns:
            ``(makespan[steps], busy_until[pp, steps])``.
        """
        free: List[np.ndarray | float] = [0.0] * self.pp
        finish: Dict[Tuple[bool, int, int, int], np.ndarray] = {}
        for s, pos in self.topo:
            fwd, mb, c = self.orders[s][pos]
            key = (fwd, mb, c, s)
            dep = self._dep(fwd, mb, c, s)
            start = free[s]
            if dep is not None:
                arrive = finish[dep] if dep[3] == s else finish[dep] + send_s
                start = np.maximum(start, arrive)
            end = start + dur[key]
            finish[key] = end
            free[s] = end
        shape = np.broadcast_shapes(*(np.shape(f) for f in free))
        busy = np.stack([np.broadcast_to(np.asarray(f, dtype=np.float64), shape) for f in free])
        return busy.max(axis=0), busy
