"""``Learned``: what a provisioner learns as it runs, the pieces it decides from.

One home for the pieces a checkpoint saves (``provision/state.py``, through ``pieces``): the
cost model, the footprint, the routing record, the stacking, the calibration count, the
unplanned keys and the excess an allocator view taught. Each piece owns its own state; this
only holds them together, so that a provisioner has one thing to save, load and hand on.

Invariants: the attributes are the pieces, by the names a saved state files them under (a
piece added here is one ``state.load`` expects, so ``state.VERSION`` says how an older state
reads without it); pieces keep their identity for the run (a load changes them in place).
"""
from __future__ import annotations

from typing import Any, Dict

from bagualu2.plan.cost_model import CostModel
from bagualu2.provision.calibration import Calibration
from bagualu2.provision.excess import WholeMemory
from bagualu2.provision.footprint import Footprint
from bagualu2.provision.routing import RoutingRecord
from bagualu2.provision.stacking import Stacking
from bagualu2.provision.unplanned import UnplannedKeys

__all__ = ["Learned"]


class Learned:
    """The pieces a provisioner learns (the module note), around its cost model ``cost``."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.footprint = Footprint(cost)  # what one holds that no plan releases, and the room left
        self.routing = RoutingRecord()  # tokens per expert, this micro-batch's and summed
        self.stacking = Stacking()  # the micro-batches in flight on this rank
        self.calibration = Calibration()  # the micro-batches that release all they can
        self.unplanned = UnplannedKeys()  # saved keys no plan can name
        self.excess = WholeMemory()  # what the allocator shows beyond the activations at a peak, by load

    def pieces(self) -> Dict[str, Any]:
        """Name -> piece, as a checkpoint files them (``state.save`` / ``state.load``)."""
        return dict(vars(self))
