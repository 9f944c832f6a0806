"""Engine adapters: one module per training engine.

Each finds its engine's MoE gates and the hooks that report the load each rank will compute,
and refuses engine options that conflict with bagualu2 (the engine's own activation
recompute or offload) with a message naming the option. None of them patches its engine.

- :mod:`bagualu2.integrations.torchtitan`: torchtitan 0.3.0.
"""
