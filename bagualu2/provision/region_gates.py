"""Gates inside compiled regions: one shared hook that reports through ``regions.report_gate``.

Owns ``RegionGates``. Every gate inside a compiled region gets the same hook object and the
same report slot, so Dynamo, which traces the hook into the region's graph, sees no difference
between one block's gate and another's (identical blocks keep sharing their graphs). Traced,
the hook only calls the report op with the gate's own first parameter, which tells the gate
apart at run time; the op's body then runs the gate's eager hook (``hook_for(spec)``) with the
real tensors. Run eagerly (a region called outside Dynamo), the hook runs it directly.

Invariant: only gates with a parameter of their own are served here (the caller hooks the
others one by one); ``close`` frees the slot. Dynamo does not guard on module hooks: a region
compiled before ``enable`` runs its old code, without the report, for as long as that code is
cached. So the first provisioned forward checks that every served gate reported, and warns
once, naming those that did not. The op takes plain tensors only: a DTensor
parameter (EP-sharded experts) is passed as its local shard.
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
        self.slot = register_gate_report(self._report)
        self.hook = AttachedHook(self._traced)
        self._heard: Optional[Set[int]] = set()  # gates that reported, until the first check

    def add(self, spec: GateSpec) -> bool:
        """Serve ``spec`` (True), or not: it has no parameter of its own to tell it apart."""
        if next(spec.module.parameters(recurse=False), None) is None:
            return False
        self._specs[id(spec.module)] = spec
        return True

    def close(self) -> None:
        unregister_gate_report(self.slot)

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
            report_gate(self.slot, _local(next(module.parameters(recurse=False))), args, output)
            return
        spec = self._specs.get(id(module))
        if spec is not None:
            if self._heard is not None:
                self._heard.add(id(module))
            self._hook_for(spec)(module, args, output)

    def _report(self, tensors: List[torch.Tensor], args_count: int, output_kind: int) -> None:
        """``report_gate``'s body: find the gate by its parameter, run its hook."""
        anchor, args, output = rebuilt_call(tensors, args_count, output_kind)
        ptr = anchor.data_ptr()
        for spec in self._specs.values():
            first = next(spec.module.parameters(recurse=False), None)
            if first is not None and _local(first).data_ptr() == ptr:
                if self._heard is not None:
                    self._heard.add(id(spec.module))
                self._hook_for(spec)(spec.module, args, output)
                return


def _local(param: torch.Tensor) -> torch.Tensor:
    """A gate's parameter as the report op can take it: a DTensor's local shard (torchtitan's
    EP experts), whose storage tells the gate apart as the parameter's own would."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):
            return param.to_local()
    return param
