"""Compiled regions: the ``torch.compile``d modules of a provisioned model, each one unit of the plan.

Owns what tells a compiled region (``compiled_regions``), its plan key (``region_key``), the
compile options that stay refused (``check_compile_options``), the call wrapper that runs
bagualu2's region hooks outside the compiled code of a ``module.compile()``d module
(``RegionCall``), and the operator through which a gate inside a compiled region reports its
routing at run time (``report_gate``).

Design note
-----------
Inside a compiled region there are no aten ops to trace: Dynamo turns the region's forward
into graphs, and a dispatch mode active around it would be traced into (guards on its Python
state, recompiles, inexact results). What does reach Python is the region's saved tensors:
saved-tensor hooks active around a call of it receive them, the same count and shapes as in
eager, when its forward returns. So a region is planned as one unit with the key
``"<module path>:compiled"``: all its saves kept, offloaded, or recomputed by rerunning the
region whole in backward (as ``torch.utils.checkpoint`` around a compiled block does).

A region is one of:

* an ``OptimizedModule`` (``torch.compile(module)``): its own hooks run outside Dynamo, the
  wrapped module's are traced;
* a module whose ``module.compile()`` set ``_compiled_call_impl``: its hooks are traced too, so
  the runtime replaces ``_compiled_call_impl`` with a ``RegionCall`` while its hooks are on;
* the provisioned model itself when ``enable`` is given a compiled model (key ``":compiled"``).

Invariants:

* bagualu2 puts no hook of its own on a module inside a region, except gate hooks, which inside
  compiled code only call ``report_gate`` (nothing else that Dynamo would guard on), so a
  ``fullgraph=True`` region traces as it does without bagualu2 and nothing recompiles.
* ``report_gate`` is a ``torch.library.custom_op`` that declares a write to its ``sink``
  argument: the compilers keep it in the graph and run its Python body on every call, with the
  real tensors, after the router ran and before the region's saved tensors are packed.
* Options whose compiled code keeps its own copies of activations (CUDA graphs:
  ``mode="reduce-overhead"`` or ``"max-autotune"``, ``options={"triton.cudagraphs": True}``,
  ``backend="cudagraphs"``) are refused at ``enable``, naming the option.
"""

from __future__ import annotations

import itertools
import sys
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from bagualu2.shared import region_key

__all__ = ["RegionCall", "check_compile_config", "check_compile_options", "compiled_regions", "hide_from_dynamo", "is_compiled", "region_key",
           "report_gate",
           "register_gate_report", "unregister_gate_report"]

def _optimized_module() -> type:
    from torch._dynamo.eval_frame import OptimizedModule
    return OptimizedModule


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs compiled code: a ``torch.compile(module)`` wrapper or a
    module whose ``module.compile()`` was called."""
    # Without torch._dynamo imported nothing was compiled (and importing it costs about 1 s).
    return (getattr(module, "_compiled_call_impl", None) is not None
            or ("torch._dynamo" in sys.modules and isinstance(module, _optimized_module())))


def compiled_regions(root: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """The outermost compiled regions under ``root`` (``root`` itself excluded), by module path."""
    found: Dict[str, torch.nn.Module] = {}
    for name, module in root.named_modules():
        if module is root or any(name.startswith(p + ".") for p in found):
            continue
        if is_compiled(module):
            found[name] = module
    return found


def holds_collectives(module: torch.nn.Module) -> bool:
    """Whether a region may issue collectives: a module in it is sharded by FSDP2, has a
    DTensor parameter or buffer, or holds a process group or a device mesh, directly or in an
    object it holds (torchtitan's EP token dispatcher is such an object, not a module). A rerun
    in backward would issue them again on this rank alone, so such a region is never
    recomputed (offloaded instead)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    kinds = (dist.ProcessGroup, DeviceMesh)
    for m in module.modules():
        if callable(getattr(m, "_get_fsdp_state", None)) and m._get_fsdp_state() is not None:
            return True
        if any(isinstance(t, DTensor) for t in (*m._parameters.values(), *m._buffers.values())):
            return True
        if any(_holds(v, kinds, depth=2) for v in vars(m).values()):
            return True
    return False


def _holds(value: Any, kinds: Tuple[type, ...], depth: int) -> bool:
    """Whether ``value`` is one of ``kinds`` or holds one within ``depth`` levels of attributes
    and containers (modules and tensors are not entered: ``holds_collectives`` walks modules)."""
    if isinstance(value, kinds):
        return True
    if depth == 0 or isinstance(value, (torch.nn.Module, Tensor, type, types.ModuleType, str, bytes)):
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        inner: Any = value
    elif isinstance(value, dict):
        inner = value.values()
    else:
        inner = getattr(value, "__dict__", {}).values()
    return any(_holds(v, kinds, depth - 1) for v in inner)


def _compiled_fn(module: Any) -> Any:
    if isinstance(module, torch.nn.Module) and getattr(module, "_compiled_call_impl", None) is not None:
        return module._compiled_call_impl
    return module


def _backend_name(compiled: Any) -> Optional[str]:
    """The name of the backend compiled code was given (walks Dynamo's wrappers of it)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    holders = [ctx] if ctx is not None else [c.cell_contents for c in (getattr(compiled, "__closure__", None) or ())
                                              if hasattr(c.cell_contents, "callback")]
    for holder in holders:
        backend, seen = getattr(holder, "callback", None), 0
        while backend is not None and seen < 8:
            name = getattr(backend, "compiler_name", None)
            if isinstance(name, str):
                return name
            backend, seen = getattr(backend, "_torchdynamo_orig_backend", None), seen + 1
    return None


def check_compile_options(module: Any, where: str) -> None:
    """ValueError when compiled code ``module`` (at ``where``) captures CUDA graphs, naming the
    option: a CUDA graph replays into its own static buffers, so its saved activations are
    neither released nor counted by saved-tensor hooks."""
    compiled = _compiled_fn(module)
    getter = getattr(compiled, "get_compiler_config", None)
    config = getter() if callable(getter) else None
    option = None
    if _backend_name(compiled) == "cudagraphs":
        option = "backend='cudagraphs'"
    elif isinstance(config, dict) and config.get("triton.cudagraphs"):
        option = "mode='reduce-overhead' (or 'max-autotune', or options={'triton.cudagraphs': True})"
    if option is not None:
        raise ValueError(
            f"bagualu2: {where} is compiled with {option}, which captures CUDA graphs: their static buffers "
            f"hold the saved activations where saved-tensor hooks cannot release them; compile it with "
            f"mode=None or mode='max-autotune-no-cudagraphs' to provision it")


def hide_from_dynamo(*fns: Callable[..., Any]) -> None:
    """Let Dynamo skip the frames of ``fns`` and of all they call, at no cost per call (no
    wrapper): saved-tensor hooks and report bodies that run between the graphs of a region
    with graph breaks would otherwise be traced, recompiling as their Python state changes.
    Compiled code they call (a region rerun in backward) sets Dynamo's callback itself."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    for fn in fns:
        code = getattr(fn, "__code__", None) or fn.__func__.__code__  # type: ignore[attr-defined]
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def check_compile_config() -> None:
    """ValueError when the compiler's partitioner is told to recompute inside compiled regions
    (``torch._functorch.config.activation_memory_budget`` below 1): it would decide what a
    region saves, beside and against bagualu2's plan."""
    budget = getattr(torch._functorch.config, "activation_memory_budget", 1.0)
    if budget < 1.0:
        raise ValueError(
            f"bagualu2: torch._functorch.config.activation_memory_budget={budget} makes the compiler decide "
            f"what compiled regions recompute; bagualu2 plans each region itself: reset it to 1.0")


class RegionCall:
    """Stands in for a ``module.compile()``d module's ``_compiled_call_impl`` while bagualu2's
    hooks are on: runs ``enter`` and ``leave`` around the compiled call, outside Dynamo."""

    __slots__ = ("compiled", "enter", "leave", "module")

    def __init__(self, module: torch.nn.Module, compiled: Callable[..., Any],
                 enter: Callable[..., Any], leave: Callable[..., Any]) -> None:
        self.module = module
        self.compiled = compiled
        self.enter = enter
        self.leave = leave

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.enter(self.module, args, kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except BaseException:
            self.leave(self.module, args, None, failed=True)
            raise
        self.leave(self.module, args, out)
        return out


# -- gates inside compiled regions ---------------------------------------------------------------
_REPORTS: Dict[int, "weakref.WeakMethod[Callable[[List[Tensor], int, int], None]]"] = {}
_SINK = torch.zeros(1)  # what report_gate declares it writes: the compilers keep the call


def register_gate_report(fn: Callable[[List[Tensor], int, int], None]) -> int:
    """A slot for ``report_gate``: its body calls ``fn(tensors, args_count, output_kind)``.

    ``fn`` is a bound method, held weakly: its owner (a provisioner's ``RegionGates``) dropped
    without ``disable()`` is still freed, and with it its host arena. The slot is the lowest
    one no live owner holds: the slot is a constant of the compiled graphs, so a provisioner
    enabled after another was disabled (or dropped) takes its slot and runs the same graphs,
    with no recompile; its ``fn`` finds its gates by their parameters, never another model's."""
    for dead in [s for s, ref in _REPORTS.items() if ref() is None]:
        del _REPORTS[dead]
    slot = next(s for s in itertools.count() if s not in _REPORTS)
    _REPORTS[slot] = weakref.WeakMethod(fn)  # type: ignore[arg-type]
    return slot


def unregister_gate_report(slot: int) -> None:
    _REPORTS.pop(slot, None)


@torch.library.custom_op("bagualu2::report_gate", mutates_args=("sink",))
def _report_gate_op(sink: Tensor, tensors: List[Tensor], slot: int, args_count: int, output_kind: int) -> None:
    ref = _REPORTS.get(slot)
    fn = ref() if ref is not None else None
    if fn is None:
        _REPORTS.pop(slot, None)
        return
    fn(tensors, args_count, output_kind)


@_report_gate_op.register_fake
def _(sink: Tensor, tensors: List[Tensor], slot: int, args_count: int, output_kind: int) -> None:
    return None


OUTPUT_TENSOR, OUTPUT_TUPLE, OUTPUT_NONE = 0, 1, 2


def report_gate(slot: int, anchor: Tensor, args: tuple, output: Any) -> None:
    """Inside compiled code: hand a gate's tensor arguments and outputs to slot ``slot``'s
    function, at run time, after ``anchor`` (a tensor that tells the gate: one hook and one
    slot serve every gate, so no gate's code differs from another's and nothing recompiles per
    gate). A tuple output (a named tuple too) reaches it as a plain tuple of its tensors."""
    arg_tensors = [anchor] + [a for a in args if isinstance(a, Tensor)]
    if isinstance(output, Tensor):
        outs, kind = [output], OUTPUT_TENSOR
    elif isinstance(output, (tuple, list)):
        outs, kind = [o for o in output if isinstance(o, Tensor)], OUTPUT_TUPLE
    else:
        outs, kind = [], OUTPUT_NONE
    torch.ops.bagualu2.report_gate(_SINK, arg_tensors + outs, slot, len(arg_tensors), kind)


def rebuilt_call(tensors: List[Tensor], args_count: int, output_kind: int) -> Tuple[Tensor, tuple, Any]:
    """The anchor, and the (args, output) a gate hook sees, from what ``report_gate`` passed."""
    args, outs = tuple(tensors[1:args_count]), tensors[args_count:]
    if output_kind == OUTPUT_TENSOR:
        return tensors[0], args, outs[0]
    return tensors[0], args, (tuple(outs) if output_kind == OUTPUT_TUPLE else None)
