"""Cluster-scale simulator of activation policies (``bagualu2 simulate``).

```python
from bagualu2.sim import Layout, Simulator, generate_trace, get_cluster, get_model

model, cluster = get_model("deepseek-v3-671b"), get_cluster("dcu-64g")
layout = Layout(tp=2, pp=16, vpp=2, ep=64, dp=6, seq=2496)
sim = Simulator(model, cluster, layout)
result = sim.run(generate_trace(1000, layout.m, len(sim.moe_units), ep=layout.ep, seed=0))
print(result.table())
```

The simulator calls the runtime's ``bagualu2.Planner``; see
``docs/simulator.md`` for the model, the calibration and the predicted-vs-published ablation.
"""
from bagualu2.sim.clusters import CLUSTER_PRESETS, ClusterSpec, get_cluster
from bagualu2.sim.engine import POLICIES, PolicyResult, SimResult, Simulator
from bagualu2.sim.layout import Layout
from bagualu2.sim.models import MODEL_PRESETS, OP_TABLE, ModelSpec, get_model
from bagualu2.sim.sizing import fit_seq_for_keep_all
from bagualu2.sim.traces import LoadTrace, generate_trace, read_telemetry

__all__ = [
    "CLUSTER_PRESETS",
    "ClusterSpec",
    "Layout",
    "LoadTrace",
    "MODEL_PRESETS",
    "ModelSpec",
    "OP_TABLE",
    "POLICIES",
    "PolicyResult",
    "SimResult",
    "Simulator",
    "fit_seq_for_keep_all",
    "generate_trace",
    "get_cluster",
    "get_model",
    "read_telemetry",
]
