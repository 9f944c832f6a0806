"""``Limits``: what a micro-batch's activations are held to, and what its saves are planned to.

The budget is the user's (``Provisioner.budget``); with an allocator view it is on the whole
memory the view counts, and the activations get what the predicted excess leaves
(``provision/excess.py``). Everything that turns the budget into a number a forward, a gate or
backward is held to lives here, so the provisioner only says when. This is the budget's one
home: ``Provisioner.budget`` reads and sets it here, a pipeline's overlap driver reads it here
as it plans each pair, and the runtime's two numbers (below), which its save hooks read on
every save, are written from here alone.

Invariants:

* ``limit = max(0, budget - excess)``, the excess being the allocator view's prediction for this
  micro-batch (0 without a view); ``target = limit * (1 - margin) - reserve``, the reserve being
  what the micro-batches stacking behind this one hold that no plan releases.
* Each time the budget or the excess is set, backward (the runtime's ``budget_bytes``) and the
  running frame's ``Budget`` follow it at once; without a budget the excess is never set.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from bagualu2.provision.excess import AllocatorView
from bagualu2.provision.footprint import Footprint
from bagualu2.provision.stacking import Stacking
from bagualu2.runtime import Budget

__all__ = ["Limits"]


class Limits:
    """The budget (``budget``, None: none) and what it leaves each micro-batch's activations."""

    def __init__(self, budget: Optional[int], margin: float, runtime: Any, footprint: Footprint,
                 stacking: Stacking, memory: Optional[AllocatorView]) -> None:
        self.margin = margin
        self.runtime = runtime
        self.footprint = footprint
        self.stacking = stacking
        self.memory = memory  # the allocator view, or None
        self.budget: Optional[int] = None
        self.set_budget(budget)

    def set_budget(self, budget: Optional[int]) -> None:
        """A new budget for the micro-batches to come, and for backward and the forward running
        (if any) from now on."""
        self.budget = budget
        self._follow()

    def limit(self, excess: Optional[int] = None) -> int:
        """What this micro-batch's activations are held to: the budget less the excess the
        allocator view predicts (``excess``, else this micro-batch's; none without a view)."""
        if excess is None:
            excess = self.memory.now if self.memory is not None else 0
        return max(0, self.budget - excess)

    def target(self, excess: Optional[int] = None) -> int:
        """What this micro-batch's saves are planned to: its limit less the margin and the
        reserve for the micro-batches stacking on it."""
        return int(self.limit(excess) * (1.0 - self.margin)) - self.reserve()

    def reserve(self) -> int:
        """Room for the micro-batches that will stack on this one before its backward
        (``Stacking.behind``): what each of them holds that no plan releases."""
        return self.footprint.reserve(self.stacking.behind())

    def calm(self, copies: bool) -> bool:
        """Whether this micro-batch is not expected to need a release (``Footprint.calm``): its
        worst routing fits beside the excess that routing would bring, or, with a copy engine
        (``copies``), the last routing fits beside the excess now."""
        if self.budget is None:
            return True
        resident = self.runtime.ledger.resident
        worst = self.memory.worst() if self.memory is not None else 0
        if self.footprint.calm(self.target(worst) - resident, False):
            return True
        return copies and self.footprint.calm(self.target() - resident, True)

    # -- the allocator view's excess -------------------------------------------------------
    def begin(self, first: bool, counts: Mapping[int, Sequence[int]]) -> Optional[int]:
        """As a forward begins: learn from the window that ends (``AllocatorView.begin``) and
        hold this micro-batch to the excess at the last routing until its gates say more.
        Returns the peak of the window that ended when it crossed the budget, else None."""
        if self.memory is None or self.budget is None:
            return None
        crossed = self.memory.begin(first, counts, self.runtime.ledger, self.budget)
        self.set_excess(self.memory.now)
        return crossed

    def framed(self, traced: bool) -> None:
        """This micro-batch's frame is chosen: a traced one is held to what traced forwards
        showed beyond the ledger at the last routing."""
        if self.memory is None or self.budget is None:
            return
        self.memory.window_traced = traced
        if traced:
            self.set_excess(self.memory.at(self.memory.last_load, True))

    def routed(self, load: Any, traced: bool) -> None:
        """A gate routed: the excess this routing brings (a spike's temporaries), known before
        the experts run."""
        if self.memory is not None and self.budget is not None:
            self.set_excess(self.memory.at_routing(load, traced))

    def set_excess(self, excess: int) -> None:
        """Hold this micro-batch's activations to the budget less ``excess``: its frame (once it
        has one) and backward (the runtime's ``budget_bytes``)."""
        self.memory.now = excess
        self._follow()

    def _follow(self) -> None:
        """Backward (the runtime's ``budget_bytes``) and the running frame's ``Budget`` (once it
        has one) take the limit now: the numbers the save hooks read, written here alone."""
        limit = None if self.budget is None else self.limit()
        self.runtime.residency.budget_bytes = limit
        frame = self.runtime.active_frame
        if frame is not None and frame.budget is not None:
            frame.budget = None if limit is None else Budget(limit, frame.budget.reserve, frame.budget.pin_headroom)
