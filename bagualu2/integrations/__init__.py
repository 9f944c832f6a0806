"""Engine adapters: one module per training engine.

Each finds its engine's MoE gates and the hooks that report the load each rank will compute,
and refuses engine options that conflict with bagualu2 (the engine's own activation
recompute or offload) with a message naming the option. None of them patches its engine.

- :mod:`bagualu2.integrations.torchtitan`: torchtitan 0.3.0.
- :mod:`bagualu2.integrations.megatron`: Megatron-Core 0.16.1.
- :mod:`bagualu2.integrations.pipeline`: ``torch.distributed.pipelining`` schedules.

Importing this package registers the engines' gate finders with the runtime's discovery
(``bagualu2.runtime.gates.register_gate_finder``); ``import bagualu2`` does.
"""
from bagualu2.integrations import torchtitan, megatron  # noqa: I001 (the order find_gates asks them in)

__all__ = ["megatron", "torchtitan"]
