"""What a gating event decides: the rest of the micro-batch's saves, predicted at this layer's
routing, and, when they would not fit, the plan for the operators still to run.

Design note
-----------
The ``Provisioner`` decides *whether* a gate decides (an adaptive policy under a budget, the
cost model profiled, the micro-batch neither calibrating nor untraced); ``GateDecisions``
decides *what*, and owns the ``Planner`` it solves with. At a decision:

1. later layers are assumed to route like this one; earlier layers' routing is as recorded;
2. the saves of the operators not yet seen are predicted with the ``CostModel`` and added to
   what the ledger holds (offload sources whose copies run count as released: they are
   freed as the copies complete);
3. if that exceeds the target (the budget less its margin and the reserve for stacking
   micro-batches), the planner picks KEEP / OFFLOAD / RECOMPUTE for the remaining operators
   so that the excess is freed, and the choices go into the frame.

Invariants: a decision plans only operators the frame has not seen, and first drops what an
earlier gate chose for them (a later gate may relax it); a micro-batch's predicted
high-water mark (``predicted``) is set once, at its first gate, traced or not, and is what
telemetry compares its measured peak with.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from bagualu2.plan.cost_model import CostModel
from bagualu2.plan.planner import Planner
from bagualu2.provision.routing import RoutingRecord
from bagualu2.provision.stacking import Stacking
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.runtime.gates import GateSpec
from bagualu2.shared import SIZE, Choice
from bagualu2.telemetry import Decision

__all__ = ["GateDecisions"]


class GateDecisions:
    """The decisions at a provisioner's gates (see the module note)."""

    def __init__(self, cost: CostModel, runtime: ActivationRuntime, routing: RoutingRecord, stacking: Stacking,
                 gates: Sequence[GateSpec], min_bytes: int) -> None:
        self.cost = cost
        self.runtime = runtime
        self.routing = routing
        self.stacking = stacking
        self.gates = gates  # the provisioner's list: gates registered later are seen
        self.min_bytes = min_bytes
        # A fixed number of byte cells per candidate bounds a decision's time whatever the
        # model (benchmarks/decision_latency.py measures it); sizes are rounded the safe way, so
        # a plan frees what it must, at most a few percent more than an exact one.
        self.planner = Planner(max_cells=2048)
        self.predicted = 0  # this micro-batch's predicted high-water mark; 0 before its first gate

    def begin(self) -> None:
        """A micro-batch's forward begins."""
        self.predicted = 0

    def predict(self, frame: Frame, values: List[int], outside_held: int) -> None:
        """At the first gate of an untraced micro-batch (it plans nothing: no recipes), predict
        its high-water mark as a traced one's first decision would, from the whole forward."""
        if self.predicted:
            return
        routed = self.routing.counts
        exact = {g.layer: routed.get(g.layer, values) for g in self.gates}
        exact.update({SIZE: routed[SIZE]} if SIZE in routed else {})
        self.predicted = frame.stats.start_resident + outside_held + self.cost.predict_total(self.cost.order, exact)

    def counts_at(self, layer: int, values: List[int]) -> Dict[int, List[int]]:
        """The micro-batch's routing as gate ``layer`` sees it with ``values``: earlier layers as
        recorded, later layers like this one."""
        routed = self.routing.counts
        counts: Dict[int, List[int]] = {g.layer: (routed.get(g.layer) if g.layer < layer else values)
                                        for g in self.gates}
        counts[layer] = values
        counts[SIZE] = routed.get(SIZE) or next(iter(routed.values()), values)
        return counts

    def decide(self, frame: Frame, layer: int, values: List[int], target: int, budget: Optional[int], step: int,
               can_offload: bool) -> Decision:
        """Plan ``frame``'s remaining operators at gate ``layer``'s routing ``values`` so that
        its saves fit ``target``; the record of it, for telemetry (its latency left to the
        caller)."""
        cost = self.cost
        counts = self.counts_at(layer, values)
        running = self.runtime.regions.running()
        remaining = [k for k in cost.order if k not in frame.keys_seen and (running is None or k != running[0])]
        predicted = cost.predict_total(remaining, counts)
        if running is not None:
            # The region this gate runs in chose at its first save: it is planned no more, what
            # it saved is resident already, and what it will still save is kept where it keeps.
            key, choice, saved = running
            if choice == Choice.KEEP:
                predicted += max(0, cost.predict_total([key], counts) - saved)
        # What this gate plans afresh: the operators still to run, and the running region, whose
        # choice the next micro-batch (which starts from this plan) makes anew.
        replanned = remaining + [running[0]] if running is not None else remaining
        resident = self.runtime.ledger.resident - self.runtime.residency.inflight_bytes
        must_free = resident + predicted - target
        if not self.predicted:
            self.predicted = resident + predicted
        imbalance = max(values) * len(values) / max(1, sum(values))
        record = Decision(step, frame.index, layer, imbalance, resident, resident + predicted,
                          resident + predicted, budget, {"keep": len(remaining)}, 0.0)
        if must_free <= 0:
            frame.replan({}, replanned)
            return record
        # A micro-batch's first offload costs more than its own copy (copy_frame_s).
        setup = 0.0 if frame.stats.offloaded_storages else cost.copy_frame_s
        anchors = [n.key for n in frame.anchors]
        candidates, _ = cost.candidates(remaining, counts, self.min_bytes, can_offload, anchors)
        offload_window, reload_window = cost.windows(len(remaining) / max(1, len(cost.order)), self.stacking.declared)
        plan = self.planner.solve(candidates, must_free, offload_window, reload_window, setup)
        frame.replan(plan.choices, replanned)
        record.feasible = plan.feasible
        record.planned_bytes = resident + predicted - plan.freed_bytes
        record.mix = {c.name.lower(): n for c, n in plan.mix().items()}
        record.mix["keep"] += len(remaining) - len(plan.choices)
        return record
