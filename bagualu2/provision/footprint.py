"""A micro-batch's footprint: what one micro-batch holds that no plan releases, what its routing
saves, and the room that leaves under the budget.

Owns ``Footprint``: the floor (anchors and the small and fixed storages no plan releases), the
hard floor (what not even the runtime could release at the last routing), what recipes pin and
inputs saved from outside the forward hold (in all and per byte of the forward's tensor
arguments; and of the pins, those of storages made inside the forward, which only tracing holds),
and the saved bytes of the last and of the worst routing. From them it answers the
provisioner's questions about room: the reserve for the micro-batches stacking on this one
(``reserve``), the headroom a forward keeps for what it will pin (``pin_headroom``), whether a
micro-batch is calm (``calm``: no release expected, or none that an untraced forward's
offloads would not make more cheaply, so its forward need not be traced), and
whether it is feasible at all (``check_feasible``: refused before it allocates anything).

Invariants: the floor, the pins and the outside bytes are the most any micro-batch seen so far
held, never less, so a reserve or a headroom covers every micro-batch like those already run; a
forward's larger tensor arguments scale the headroom up in proportion. The hard floor and the
last routing's bytes are the last micro-batch's: they stand in for the next one's, not yet
routed. The worst routing's bytes are fixed once profiling ends. Every number is a prediction:
the runtime holds the ledger under the budget at every save, so one that is wrong costs time,
never the budget.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

from bagualu2.errors import InfeasibleBudgetError
from bagualu2.plan.cost_model import CostModel

__all__ = ["Footprint"]

# Saved bytes of a routing with no bound (a gate that did not fire while profiling).
_UNBOUNDED = 1 << 62


class Footprint:
    """What a micro-batch holds that no plan releases, learned from those run so far."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.floor = 0  # bytes one micro-batch holds that no plan releases (anchors, small, fixed)
        self.hard_floor = 0  # bytes of the last routing that not even the runtime could release
        self.outside_held = 0  # most bytes from outside the forward a micro-batch held (inputs)
        # Most bytes a traced forward held that no plan releases (recipe pins, saved inputs from
        # outside), in all and per byte of the forward's tensor arguments.
        self.pinned_bytes: Optional[int] = None
        self.pinned_per_input = 0.0
        self.traced_bytes = 0  # most bytes a traced forward's recipes pinned of storages made in it
        self.worst_bytes: Optional[int] = None  # saved bytes of the worst possible routing
        self.last_bytes: Optional[int] = None  # saved bytes of the last micro-batch's routing

    # -- learning ---------------------------------------------------------------------------
    def observe_held(self, pinned: int, outside: int, inputs: int, traced: int) -> None:
        """A traced forward with ``inputs`` bytes of tensor arguments held ``pinned`` bytes that
        no plan releases, ``outside`` of them from outside the forward, ``traced`` of them made
        inside it and held only because recipes read them (an untraced forward would not)."""
        self.pinned_bytes = max(self.pinned_bytes or 0, pinned)
        self.traced_bytes = max(self.traced_bytes, traced)
        self.pinned_per_input = max(self.pinned_per_input, pinned / max(1, inputs))
        self.outside_held = max(self.outside_held, outside)

    def observe_routed(self, anchored: int, counts: Dict[int, List[int]], min_bytes: int, can_offload: bool) -> None:
        """A forward ended holding ``anchored`` bytes of anchors, having routed ``counts``."""
        cost = self.cost
        kept = 0
        if cost.ready:
            kept, self.hard_floor, total = cost.floors_and_total(cost.order, counts, min_bytes, can_offload)
            if counts:
                self.last_bytes = total
        self.floor = max(self.floor, anchored + kept)

    def observe_worst(self, worst: Optional[Dict[int, List[int]]], counts: Dict[int, List[int]]) -> None:
        """Profiling ended: the experts' saved bytes at the ``worst`` routing (``RoutingRecord.worst``;
        None: no bound), the other operators' at the last micro-batch's ``counts``."""
        cost = self.cost
        if worst is None:
            self.worst_bytes = _UNBOUNDED
            return
        experts = [k for k in cost.order if cost.ops[k].layer is not None]
        others = [k for k in cost.order if cost.ops[k].layer is None]
        self.worst_bytes = cost.predict_total(experts, worst) + cost.predict_total(others, counts)

    # -- room -------------------------------------------------------------------------------
    def reserve(self, behind: int) -> int:
        """Room for ``behind`` micro-batches that stack on this one before its backward
        (``Stacking.behind``): what each of them holds that no plan releases."""
        return behind * (self.floor + (self.pinned_bytes or 0))

    def pin_headroom(self, inputs: int, budget: Optional[int], margin: float) -> int:
        """Bytes the forward will hold that nothing can release (what recipes pin: inputs from
        outside the forward, storages written in place beyond replay; inputs saved as they
        are): as many as traced micro-batches held so far, and more when this forward's tensor
        arguments (``inputs`` bytes) are larger (a longer sequence), in proportion; before any,
        the forward's tensor arguments or the margin, the larger."""
        if self.pinned_bytes is not None:
            return max(self.pinned_bytes, int(math.ceil(self.pinned_per_input * inputs)))
        return max(inputs, int((budget or 0) * margin))

    def calm(self, room: int, can_offload: bool) -> bool:
        """Whether a micro-batch need not be traced, with ``room`` bytes left under the
        budget's target: even the worst routing it could see fits, or, when a copy engine can
        offload what an unexpected spike brings (the runtime does so in untraced forwards), the
        last micro-batch's routing fits, or overflows by no more than tracing would itself pin
        (``traced_bytes``): a traced forward holds those bytes besides, so to release the
        overflow it would release at least twice as much, where the untraced one offloads the
        overflow alone as its last saves cross the budget. The micro-batches after a heavy
        routing are so traced, ready to plan, until one routes within the room again: a run of
        spikes is planned from its second on, and the micro-batch after an isolated one is the
        only calm one traced."""
        room -= self.outside_held  # what the forward saves from outside it (its inputs)
        if self.worst_bytes is not None and self.worst_bytes <= room:
            return True
        return can_offload and self.last_bytes is not None and self.last_bytes <= room + self.traced_bytes

    def check_feasible(self, budget: int, resident: int, movable: Callable[[], int], what: str,
                       outside: int = 0) -> None:
        """Refuse micro-batch ``what`` when no plan can fit it, before it allocates anything.

        Loads of the previous micro-batch stand in for this one's, not yet routed. What no
        release can take back: the storages that can be neither offloaded nor recomputed, and
        what the forward holds from outside it (its inputs, saved or pinned by recipes). What
        earlier micro-batches still keep (``resident``) counts only where nothing can offload it
        (``movable()``, asked only when the micro-batch would not fit otherwise). ``outside``:
        what an allocator view shows allocated beyond the activations, beside which they must fit."""
        floor = self.hard_floor + self.outside_held
        if resident + floor + outside > budget:
            resident -= movable()
        if resident + floor + outside > budget:
            raise InfeasibleBudgetError(budget, resident + floor, what, outside)
