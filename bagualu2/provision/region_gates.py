"""Gates inside compiled regions: one shared hook that reports through ``regions.report_gate``.

Owns ``RegionGates``. Every gate inside a compiled region gets the same hook object and the
same report slot, so Dynamo, which traces the hook into the region's graph, sees no difference
between one block's gate and another's (identical blocks keep sharing their graphs). Traced,
the hook only calls the report op with the gate's own first parameter, which tells the gate
apart at run time; the op's body then runs the gate's eager hook (``hook_for(spec)``) with the
real tensors. Run eagerly (a region called outside Dynamo), the hook runs it directly.

A gate is told apart by its first parameter of its own; a gate with none (a module that only
counts what the router chose) gets a one-element buffer, ``ANCHOR``, while the provisioner is on
(``add``; not persistent: no state dict sees it; ``close`` removes it): hooked alone, its eager
hook would break the region's graph at the gate, an error under ``fullgraph=True``.

Dynamo does not guard on module hooks: a region compiled before ``enable`` runs its old code,
without the report, for as long as that code is cached. So the first provisioned forward checks
that every served gate reported, and warns once, naming those that did not. The op takes plain
tensors only: a DTensor parameter (EP-sharded experts) is passed as its local shard.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Set

import torch

from bagualu2.runtime.activations import AttachedHook
from bagualu2.runtime.gates import GateSpec
from bagualu2.runtime.regions import rebuilt_call, register_gate_report, report_gate, unregister_gate_report

__all__ = ["RegionGates"]


class RegionGates:
    """The shared hook of the gates inside compiled regions (see the module note).

    Args:
        hook_for: the eager hook of a gate, ``(module, args, output) -> None``.
    """

    def __init__(self, hook_for: Callable[[GateSpec], Callable[..., None]]) -> None:
        self._hook_for = hook_for
        self._specs: Dict[int, GateSpec] = {}
        self._by_anchor: Dict[int, GateSpec] = {}  # anchor address -> gate, rebuilt on a miss
        self._anchored: List[torch.nn.Module] = []  # the gates given an ANCHOR buffer
        self.slot = register_gate_report(self._report)
        self.hook = AttachedHook(self._traced)
        self._heard: Optional[Set[int]] = set()  # gates that reported, until the first check

    def add(self, spec: GateSpec) -> None:
        """Serve ``spec``; a gate without a parameter of its own gets an ``ANCHOR`` buffer."""
        module = spec.module
        if next(module.parameters(recurse=False), None) is None and ANCHOR not in module._buffers:
            module.register_buffer(ANCHOR, torch.zeros(1), persistent=False)
            self._anchored.append(module)
        self._specs[id(module)] = spec
        self._by_anchor.clear()

    def close(self) -> None:
        """Free the report slot, and take back the ``ANCHOR`` buffers ``add`` gave."""
        unregister_gate_report(self.slot)
        for module in self._anchored:
            module._buffers.pop(ANCHOR, None)
        self._anchored.clear()

    def check_heard(self) -> None:
        """After the first provisioned forward: warn (once) when a served gate did not report,
        which means its region runs code compiled before ``enable``. Later calls cost nothing."""
        heard, self._heard = self._heard, None
        if heard is None:
            return
        silent = [spec.name for key, spec in self._specs.items() if key not in heard]
        if silent:
            shown = ", ".join(repr(name) for name in silent[:3])
            if len(silent) > 3:
                shown += f" and {len(silent) - 3} more"
            warnings.warn(
                f"bagualu2: the gate(s) {shown} inside compiled code did not report during the first forward: "
                f"that code was compiled before bagualu2.enable, and Dynamo does not recompile for the hooks "
                f"enable adds, so these gates decide nothing. Call bagualu2.enable before the model's first "
                f"compiled forward (or torch._dynamo.reset() before enable)", UserWarning, stacklevel=4)

    def _traced(self, module: torch.nn.Module, args: tuple, output: Any = None) -> None:
        if torch.compiler.is_compiling():
            report_gate(self.slot, _anchor(module), args, output)
            return
        spec = self._specs.get(id(module))
        if spec is not None:
            if self._heard is not None:
                self._heard.add(id(module))
            self._hook_for(spec)(module, args, output)

    def _report(self, tensors: List[torch.Tensor], args_count: int, output_kind: int) -> None:
        """``report_gate``'s body: find the gate by its anchor's address, run its hook. The
        addresses are mapped once and again only when the map misses or is stale: a parameter
        moved, or was resharded and its address reused by another gate's (FSDP2 frees and
        gathers them around each forward). A step reports every gate: a scan per report would
        grow with the square of the layers."""
        anchor, args, output = rebuilt_call(tensors, args_count, output_kind)
        ptr = anchor.data_ptr()
        spec = self._by_anchor.get(ptr)
        if spec is None or _anchor(spec.module).data_ptr() != ptr:
            self._by_anchor = {_anchor(s.module).data_ptr(): s for s in self._specs.values()}
            spec = self._by_anchor.get(ptr)
            if spec is None:
                return
        if self._heard is not None:
            self._heard.add(id(spec.module))
        self._hook_for(spec)(spec.module, args, output)


ANCHOR = "_bagualu2_gate_anchor"


def _anchor(module: torch.nn.Module) -> torch.Tensor:
    """What tells ``module``'s gate apart in the report: its first parameter of its own, else its
    ``ANCHOR`` buffer (``RegionGates.add``)."""
    param = next(module.parameters(recurse=False), None)
    return _local(param) if param is not None else module._buffers[ANCHOR]


def _local(param: torch.Tensor) -> torch.Tensor:
    """A gate's parameter as the report op can take it: a DTensor's local shard (torchtitan's
    EP experts), whose storage tells the gate apart as the parameter's own would."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):
            return param.to_local()
    return param
