"""bagualu2: runtime-adaptive activation provisioning for Mixture-of-Experts training.

```python
import bagualu2

prov = bagualu2.enable(model, budget="auto")   # or int bytes, or a float fraction
loss = model(batch); loss.backward()           # training loop unchanged
prov.report()
prov.disable()
```
"""

from bagualu2 import _C
from bagualu2.activations import is_recomputing
from bagualu2.cost_model import CostModel
from bagualu2.errors import BudgetExceededError, InfeasibleBudgetError
from bagualu2.offload import CopyEngine, HostArena
from bagualu2.planner import Candidate, Choice, Plan, PlanCache, Planner
from bagualu2.provisioner import POLICIES, Provisioner, enable, on_gating

__version__ = "0.1.0"

__all__ = [
    "BudgetExceededError",
    "Candidate",
    "Choice",
    "CopyEngine",
    "CostModel",
    "HostArena",
    "InfeasibleBudgetError",
    "POLICIES",
    "Plan",
    "PlanCache",
    "Planner",
    "Provisioner",
    "backends",
    "enable",
    "is_recomputing",
    "on_gating",
]


def backends() -> list:
    """Names of the backends compiled into this build ('cpu' always first)."""
    return list(_C.backends())
