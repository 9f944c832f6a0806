"""Reference MoE transformer for tests, demos and benchmarks (plain PyTorch).

```python
cfg = MoEConfig.small()
model = MoETransformer(cfg)
loss = model(tokens)                       # int64 [batch, seq] -> LM loss + aux loss
with model.routing_spike(imbalance=2.6):   # most loaded expert gets ~2.6x the mean load
    loss = model(tokens)
model = MoETransformer(cfg, ep_group=group)   # expert parallelism over a process group
```
"""
from bagualu2.models.config import MoEConfig
from bagualu2.models.data import synthetic_batches
from bagualu2.models.moe_layer import (ExpertDispatcher, MoELayer, RouterOutput, RoutingSpike,
                                       SwiGLUExpert, TopKRouter, load_imbalance)
from bagualu2.models.transformer import (CausalSelfAttention, MoEBlock, MoETransformer,
                                         RMSNorm)
from bagualu2.models import gates  # registers the reference model's gates with discovery

__all__ = [
    "CausalSelfAttention",
    "ExpertDispatcher",
    "MoEBlock",
    "MoEConfig",
    "MoELayer",
    "MoETransformer",
    "RMSNorm",
    "RouterOutput",
    "RoutingSpike",
    "SwiGLUExpert",
    "TopKRouter",
    "load_imbalance",
    "synthetic_batches",
]
