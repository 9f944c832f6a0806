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
* A region call is rerun whole in backward only if what its compiled code reads is known and
  is the call's arguments or parameters and buffers of the region's own modules
  (``CompiledReads``): the tensors Dynamo's guards check (every tensor a compiled graph takes
  as an input has a ``TENSOR_MATCH`` guard naming its source, ``L['x']``,
  ``L['self']._modules['mlp']._parameters['w']``; ``report_gate``'s sink, which nothing reads, is
  the one other tensor allowed), of every cache entry of the region's
  ``forward`` whose guards pass for the call as it begins (or, where none does, of those the
  call compiles). Guards are checked as the call begins, not at its saves: inside the compiled
  autograd function grad mode is off, which a guard checks. A tensor read from anywhere else (a module
  attribute an earlier block stashed, a container, a global, a closure) may be written or
  rebound before backward, which a rerun would read as it finds it: such a call is not rerun
  (offloaded, counted as a fallback naming the source). So is a region with a graph break
  (eager Python runs between its graphs and may read anything), one whose code could not be
  inspected (no cache entry that may run it, a torch without these internals), and
  one compiled with a ``guard_filter_fn`` (it may drop the guards that name the reads).
* Options whose compiled code keeps its own copies of activations (CUDA graphs:
  ``mode="reduce-overhead"`` or ``"max-autotune"``, ``options={"triton.cudagraphs": True}``,
  ``backend="cudagraphs"``) are refused at ``enable``, naming the option.
"""

from __future__ import annotations

import inspect
import itertools
import re
import sys
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from bagualu2.shared import region_key

__all__ = ["CompiledReads", "RegionCall", "check_compile_config", "check_compile_options", "compiled_regions", "hide_from_dynamo", "is_compiled", "region_key",
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


# -- what a region's compiled code reads -----------------------------------------------------------
# Each verdict is memoized per transformed code object of a cache entry (the entry holds it):
# (that code, None or why it is not rerun, the parameter and buffer sources it reads).
_ENTRY_READS: Dict[int, Tuple[Any, Optional[str], Tuple[Tuple[Tuple[str, ...], str, str], ...]]] = {}
_OWN_STATE = re.compile(r"^((?:(?:\._modules|\.__dict__\['_modules'\])\['[^']*'\])*)"
                        r"(?:\.|\.__dict__\[')(_parameters|_buffers)'?\]?\['([^']*)'\]$")
_SUBSCRIPTS = re.compile(r"^(?:\[(?:'[^']*'|-?\d+)\])*$")
_LOCAL = re.compile(r"^L\['([^']*)'\](.*)$")
# What ``report_gate`` declares it writes (and nothing reads): the one tensor of bagualu2's own a region reads.
_OUR_SINK = "G['__import_bagualu2_dot_runtime_dot_regions']._SINK"


def _tensor_sources(manager: Any, out: List[str]) -> List[str]:
    """The sources of the tensors a guard tree checks with ``TENSOR_MATCH``."""
    if any(type(g).__name__ == "TENSOR_MATCH" for g in manager.get_leaf_guards()):
        out.append(manager.get_source())
    for child in manager.get_child_managers():
        _tensor_sources(child, out)
    return out


def _entry_reads(entry: Any, self_name: str, arg_names: Tuple[str, ...]
                 ) -> Tuple[Optional[str], Tuple[Tuple[Tuple[str, ...], str, str], ...]]:
    """What one cache entry's compiled code reads: (why a call of it may not be rerun, or None;
    the parameters and buffers of the region it reads, as (submodule names, "_parameters" or
    "_buffers", name))."""
    memo = _ENTRY_READS.get(id(entry.code))
    if memo is not None and memo[0] is entry.code:
        return memo[1], memo[2]
    names = entry.code.co_names
    graphs = [n for n in names if n.startswith("__compiled_fn")]
    why: Optional[str] = None
    state: List[Tuple[Tuple[str, ...], str, str]] = []
    if any(n.startswith("__resume_at") for n in names) or len(graphs) != 1:
        why = "it has a graph break: eager code between its graphs may read any state"
    else:
        for source in _tensor_sources(entry.guard_manager.root, []):
            if source == _OUR_SINK:
                continue
            local = _LOCAL.match(source)
            if local is not None and local.group(1) in arg_names and _SUBSCRIPTS.match(local.group(2)):
                continue  # a tensor among the call's arguments: held and version-checked
            own = _OWN_STATE.match(local.group(2)) if local is not None and local.group(1) == self_name else None
            if own is not None:
                path = tuple(p for p in re.findall(r"\['([^']*)'\]", own.group(1)) if p != "_modules")
                state.append((path, own.group(2), own.group(3)))
                continue
            why = (f"it reads {source}, neither an argument nor a parameter or buffer of the region: "
                   f"a rerun in backward would read it as it is then")
            break
    _ENTRY_READS[id(entry.code)] = (entry.code, why, tuple(state))
    return why, tuple(state)


_FILTERS: Dict[int, Tuple[Any, Optional[str]]] = {}  # id(compiled code) -> (it, why it is not inspected)


def _find_hooks(obj: Any, depth: int, seen: set) -> Any:
    """Dynamo's ``Hooks`` of compiled code ``obj`` (in its wrappers' closures and attributes)."""
    from torch._dynamo.hooks import Hooks

    if depth < 0 or id(obj) in seen or isinstance(obj, (torch.nn.Module, Tensor, type, types.ModuleType)):
        return None
    seen.add(id(obj))
    if isinstance(obj, Hooks):
        return obj
    inner = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ())]
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        inner.extend(attrs.values())
    for value in inner:
        found = _find_hooks(value, depth - 1, seen)
        if found is not None:
            return found
    return None


def _filters_guards(module: torch.nn.Module) -> Optional[str]:
    """Why a region's guards may not name all it reads (a ``guard_filter_fn`` drops guards, or
    its compile options could not be found), or None."""
    compiled = _compiled_fn(module)
    if isinstance(compiled, RegionCall):
        compiled = compiled.compiled
    if isinstance(compiled, _optimized_module()):
        compiled = compiled.dynamo_ctx
    memo = _FILTERS.get(id(compiled))
    if memo is None or memo[0] is not compiled:
        hooks = _find_hooks(compiled, 6, set())
        why = ("its compile options could not be found" if hooks is None else
               "it is compiled with a guard_filter_fn, which may drop the guards that name its reads"
               if hooks.guard_filter_fn is not None else None)
        memo = _FILTERS[id(compiled)] = (compiled, why)
    return memo[1]


Reads = Tuple[Optional[str], List[Tuple[str, Dict[str, Tensor], str]]]


class CompiledReads:
    """What the compiled code of one region call reads (see the module note): taken as the call
    begins (``begin``), from the cache entries of the region's ``forward`` whose guards pass
    for it, or, where none passes (the call compiles its code), from the entries it compiled,
    once it has (``result``, at its first save)."""

    __slots__ = ("module", "_fn", "_names", "_pending", "_result")

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
        self.module: Optional[torch.nn.Module] = None  # the module whose forward it runs
        self._pending: Optional[set] = None
        self._result: Optional[Reads] = None
        try:
            self.module = _region_module(module)
            filtered = _filters_guards(module)
            if filtered is not None:
                self._result = (filtered, [])
                return
            forward = self.module.forward
            self._fn = getattr(forward, "__func__", forward)
            signature = inspect.signature(self._fn)
            bound = signature.bind(self.module, *args, **kwargs)
            bound.apply_defaults()
            self._names = tuple(signature.parameters)
            local = dict(bound.arguments)
            entries = _cache_entries(self._fn)
            passing = [e for e in entries if e.guard_manager.check(local)]
            if passing:
                self._result = self._verdict(passing)
            else:  # this call compiles its code: what it reads is read off the entries it adds
                self._pending = {id(e.code) for e in entries}
        except Exception as e:  # noqa: BLE001 - a torch without these internals: never rerun
            self._result = (f"its compiled code could not be inspected ({type(e).__name__}: {e})", [])

    def result(self) -> Reads:
        """(why the call may not be rerun whole, or None; the parameters and buffers of the
        region it reads, each as (its name, the dict that holds it, its key))."""
        if self._result is None:
            try:
                added = [e for e in _cache_entries(self._fn) if id(e.code) not in self._pending]
                self._result = (self._verdict(added) if added else
                                (f"its compiled code could not be matched to this call (no cache entry of "
                                 f"{self._fn.__qualname__} passes its guards)", []))
            except Exception as e:  # noqa: BLE001
                self._result = (f"its compiled code could not be inspected ({type(e).__name__}: {e})", [])
        return self._result

    def _verdict(self, entries: List[Any]) -> Reads:
        """Every entry that may run this call (Dynamo runs the first whose guards pass) must
        read nothing but the call's arguments and the region's parameters and buffers."""
        found: List[Tuple[str, Dict[str, Tensor], str]] = []
        for entry in entries:
            why, state = _entry_reads(entry, self._names[0], self._names[1:])
            if why is not None:
                return why, []
            for path, kind, key in state:
                owner: Any = self.module
                for part in path:
                    owner = owner._modules[part]
                found.append((".".join(path + (key,)), getattr(owner, kind), key))
        return None, found


def _region_module(region: Any) -> torch.nn.Module:
    """The module whose ``forward`` a region's compiled code runs: a ``module.compile()``d
    module itself, a ``torch.compile(module)`` wrapper's module, or, for a compiled model's
    forward (what the provisioner calls for the whole-model region), the module it calls."""
    if isinstance(region, _optimized_module()):
        return region._orig_mod
    if isinstance(region, torch.nn.Module):
        return region
    for cell in getattr(region, "__closure__", None) or ():
        owner = getattr(cell.cell_contents, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner
    raise TypeError(f"no module found behind {region!r}")


def _cache_entries(fn: Any) -> List[Any]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return list(_debug_get_cache_entry_list(fn.__code__))


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
