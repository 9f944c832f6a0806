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
from bagualu2.runtime import is_recomputing
from bagualu2.plan.cost_model import CostModel
from bagualu2.errors import BudgetExceededError, ExactnessError, InfeasibleBudgetError
from bagualu2.offload import CopyEngine, HostArena
from bagualu2.plan.planner import Candidate, Choice, Plan, Planner
from bagualu2.api import enable, on_gating
from bagualu2.provisioner import POLICIES, Provisioner

# The reference model and the engine integrations register their gate finders on import: the
# runtime's discovery finds their gates and imports neither.
from bagualu2 import integrations, models

__version__ = "0.1.0"

__all__ = [
    "BudgetExceededError",
    "Candidate",
    "Choice",
    "CopyEngine",
    "CostModel",
    "ExactnessError",
    "HostArena",
    "InfeasibleBudgetError",
    "POLICIES",
    "Plan",
    "Planner",
    "Provisioner",
    "backend_status",
    "backends",
    "enable",
    "is_recomputing",
    "on_gating",
]


def backends() -> list:
    """Names of the backends compiled into this build ('cpu' always first); compiled is not
    usable: see :func:`backend_status`."""
    return list(_C.backends())


def backend_status() -> dict:
    """``{name: {"compiled": bool, "usable": bool, "reason": str, "library": str}}`` for cpu,
    cuda and hip: whether each is compiled in, whether it can run in this process (its runtime
    library loads and sees a device, and it matches torch's build), why not, and what was
    loaded. GPU libraries are loaded at first use (docs/backends.md)."""
    from bagualu2.offload import backend_status as _status

    return _status()
