"""``GateHooks``: how a provisioner hears its MoE gates.

Owns the hook put on each gate (``GateHook``): while a provisioned forward runs, outside any
recompute, it reads the gate's tokens per expert (its ``counts_fn``, and ``size_fn`` if any),
untraced and without grad, checks them, and hands them to the provisioner's ``on_gate``. A gate
inside a compiled region shares the one region hook (``RegionGates``); any other gets its own.

Invariant: a gate hook does nothing outside a provisioned forward or during a recompute (a
checkpoint or rebuild reruns the router: its loads were counted once already).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from bagualu2.inputs import checked_counts, token_slots
from bagualu2.provision.region_gates import RegionGates
from bagualu2.runtime import ActivationRuntime, is_recomputing
from bagualu2.runtime.activations import AttachedHook
from bagualu2.runtime.gates import GateSpec

__all__ = ["GateHook", "GateHooks"]


class GateHook:
    """One gate's eager hook, ``(module, args, output=None) -> None`` (see the module note)."""

    __slots__ = ("hooks", "spec")

    def __init__(self, hooks: "GateHooks", spec: GateSpec) -> None:
        self.hooks = hooks
        self.spec = spec

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any = None) -> None:
        runtime, spec = self.hooks.runtime, self.spec
        if runtime.active_frame is None or is_recomputing():
            return
        with runtime.residency.untraced(), torch.no_grad():
            counts = spec.counts_fn(module, args, output)
            size = spec.size_fn(module, args, output) if spec.size_fn is not None else None
        what = f"counts_fn of gate {spec.name!r} (layer {spec.layer})"
        self.hooks.on_gate(spec.layer, checked_counts(counts, what, spec.num_experts, token_slots(spec, args)), size)


class GateHooks:
    """Puts the hooks on a provisioner's gates.

    Args:
        runtime: the provisioner's ``ActivationRuntime`` (whose frame a gate decides for).
        on_gate: ``(layer, tokens per expert, micro-batch size or None) -> None``.
    """

    def __init__(self, runtime: ActivationRuntime,
                 on_gate: Callable[[int, Sequence[int], Optional[int]], None]) -> None:
        self.runtime = runtime
        self.on_gate = on_gate
        self.regions = RegionGates(self.hook_for)  # the gates inside compiled regions

    def hook_for(self, spec: GateSpec) -> GateHook:
        """The eager hook of ``spec``'s gate."""
        return GateHook(self, spec)

    def install(self, spec: GateSpec, regions: Sequence[str] = ()) -> Any:
        """Put ``spec``'s hook on its gate: the shared region hook inside one of the compiled
        ``regions`` (module paths, "" the whole model); returns the removable handle."""
        register = spec.module.register_forward_pre_hook if spec.pre_hook else spec.module.register_forward_hook
        if any(not r or spec.name.startswith(r + ".") for r in regions):
            self.regions.add(spec)
            return register(self.regions.hook)
        return register(AttachedHook(self.hook_for(spec)))
