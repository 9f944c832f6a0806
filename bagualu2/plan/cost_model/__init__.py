"""Cost model: what a micro-batch's plan costs in bytes and in step time, learned at run time.

The model is learned from the micro-batches themselves, without the user describing the model.
One piece a prediction, each with its own note on what it predicts, from which measurements,
and which benchmark measures its error:

* ``memory``: each operator key's saved bytes against routed tokens (``MemoryModel``);
* ``rebuild``: what recomputing keys costs in backward (``RebuildModel``);
* ``copies``: what offloading costs the training thread, and the windows that hide copies
  (``CopyModel``);
* ``fit``: the fits they learn with (``LineFit``, ``CostFit``);
* ``model``: ``CostModel``, the facade callers price with: the planner's candidates and a
  whole plan's price.

The model does not price its own learning (the provisioner's refits as each backward ends,
work the step pays for). A fit of that cost against what was learned was part of every plan's
price until no test of plans, decisions or budgets (tests/test_provisioner.py, test_sim.py,
test_overlap_*.py) got worse without it: a part that models the model's own bookkeeping stays
only where a test shows the plans need it. What learning takes per step is shown, unpriced,
by ``benchmarks/cost_model_accuracy.py`` and ``benchmarks/offload_cost_structure.py``.
"""

from bagualu2.plan.cost_model.memory import GROUPED, SIZE, OpCost
from bagualu2.plan.cost_model.model import CostModel

__all__ = ["CostModel", "GROUPED", "OpCost", "SIZE"]
