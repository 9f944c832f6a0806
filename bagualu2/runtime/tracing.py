"""Operator tracing: stable operator keys and recomputation recipes for every storage.

Design note
-----------
A ``TracingMode`` (a ``TorchDispatchMode``) sees every aten op that runs inside a provisioned
module's forward, below autograd. For each *storage* an op creates it records a ``StorageNode``:

* ``key``: the stable operator key ``"<module path>:<op>:<occurrence>"``, where the occurrence
  counts ops of that name inside one call of that module (``"<key>.<i>"`` for the op's output
  ``i > 0``). It does not depend on tensor shapes, so it is the same from micro-batch to
  micro-batch whatever the token counts, as long as the ops a module call runs do not depend
  on the data; a loop that stops early shifts the numbers of the ops after it in the same
  call, so such a loop belongs in a module of its own (the reference router's selection).
* a recipe to rebuild the storage: the creating op with its arguments (tensors replaced by
  ``Ref``s to the nodes that own their storages, or held directly when they come from outside
  the traced region), then every in-place op applied to the storage. A storage's *state* is the
  number of in-place ops applied so far; a ``Ref`` names the state it read. (Autograd's version
  counter is not usable here: it is bumped above the dispatch mode, after the op returns.)
  Random ops carry the RNG state they started from.

Invariants:

* A node never references a node created after it, except itself (encoded as ``SELF``), so
  nodes form a DAG and are freed by reference counting the moment nothing needs them. An
  in-place op on an older storage that reads newer ones (``buf[i] += f(buf)``) would break
  this; it is recorded without its arguments and ends the states that can be replayed
  (``replayable``). A later op reading such a storage, or one no replay can rebuild (made by
  an op that cannot be replayed), holds it as a ``Leaf`` instead.
* A node holds its storage only weakly (a storage weak reference, freed with the node): tracing
  never extends the life of an activation. The weak reference also keeps the storage's address
  from being reused while the node is in the frame's map, so the address is a sound key.
* Replaying a recipe runs the same aten ops on bitwise-identical inputs with the same RNG state,
  so it reproduces the storage bit for bit. Ops that mutate storages outside the traced region
  (running statistics, collectives; also the batch-norm ops whose schemas do not declare their
  running-statistics writes) or are not aten ops are marked non-recomputable, because replaying
  them would repeat their side effects.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Ref", "Step", "StorageNode", "TracingMode", "call_key", "is_recomputing", "module_of", "step_inputs",
           "step_refs", "ViewMeta"]

_STATE = threading.local()


def call_key(key: str) -> str:
    """The key of the op call that made ``key``'s storage: the key of the call's first output
    (``"<module path>:<op>:<occurrence>"``; output ``i > 0`` has ``"<that key>.<i>"``)."""
    head, _, occurrence = key.rpartition(":")
    return f"{head}:{occurrence.partition('.')[0]}" if "." in occurrence else key


def module_of(key: str) -> str:
    """The path of the module whose call ran ``key``'s op (the ``#<n>`` that numbers a module's
    second and later calls in one forward left out)."""
    return key.partition(":")[0].partition("#")[0]


def is_recomputing() -> bool:
    """True while bagualu2 replays a recipe, or while autograd runs a backward pass.

    Gate callbacks and module hooks that fire again during recomputation (bagualu2's own replay
    runs aten ops and fires no module hooks, but ``torch.utils.checkpoint`` reruns modules inside
    backward) use this to skip counting and decisions.
    """
    return getattr(_STATE, "replaying", 0) > 0 or torch._C._current_graph_task_id() != -1


class _ReplayScope:
    """Where recipes replay: ``is_recomputing()`` true, no autograd, and no autocast (the
    recorded ops already carry the dtypes autocast chose). Entered once per rebuilt chain.

    The exit restores the state the entry found (not one step back), so an interrupt that
    stops the entry halfway leaves nothing behind once the exit runs; ``reset_replay_depth``
    repairs the count where an interrupt stopped the entry before the ``with`` owned it."""

    __slots__ = ("_depth", "_grad", "_autocast")

    def __enter__(self) -> None:
        self._depth = getattr(_STATE, "replaying", 0)
        self._grad = torch.is_grad_enabled()
        self._autocast = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        _STATE.replaying = self._depth + 1
        torch.set_grad_enabled(False)
        for device in self._autocast:
            torch.set_autocast_enabled(device, False)

    def __exit__(self, *exc: object) -> None:
        _STATE.replaying = self._depth
        torch.set_grad_enabled(self._grad)
        for device in self._autocast:
            torch.set_autocast_enabled(device, True)


def reset_replay_depth() -> None:
    """Clear this thread's replay count: called where no replay can be running (a forward's
    start), since an interrupt inside a replay's entry can leave it raised."""
    _STATE.replaying = 0


ViewMeta = Tuple[Tuple[int, ...], Tuple[int, ...], int, torch.dtype]


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_plain(t: torch.Tensor) -> bool:
    """A dense strided tensor with a storage of its own kind (not sparse, nested or a subclass)."""
    return type(t) in _PLAIN_TYPES and t.layout == torch.strided and not t.is_nested


def view_meta(t: torch.Tensor) -> ViewMeta:
    """Size, stride, storage offset and dtype: what rebuilds ``t`` from its storage."""
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def view_of(storage: torch.UntypedStorage, meta: ViewMeta) -> torch.Tensor:
    """A tensor over ``storage`` with exactly the size, strides, offset and dtype in ``meta``."""
    size, stride, offset, dtype = meta
    out = torch.empty((0,), dtype=dtype, device=storage.device)
    return out.set_(storage, offset, size, stride)


# Argument types recorded as they are: encoding skips them without a call each.
_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_NO_KWARGS: Dict[str, Any] = {}  # shared by every op called without keyword arguments; never written

SELF = object()  # marks, inside a mutation step, the storage the step mutates


class Ref:
    """A tensor argument of a recipe: a view of ``node``'s storage in ``state``."""

    __slots__ = ("node", "state", "meta")

    def __init__(self, node: Any, state: int, meta: ViewMeta) -> None:
        self.node = node  # StorageNode or SELF
        self.state = state
        self.meta = meta


class Leaf:
    """A tensor argument from outside the traced region (counted by ``pin`` while held).

    A tensor with autograd history is held detached: the graph holds this recipe through its
    saved tensors, so holding the graph back would make a reference cycle. ``source`` is what
    carries the version counter checked at replay (the tensor itself, or the parameter a view
    was taken of); None when that would mean holding the graph, and then nothing is checked.
    """

    __slots__ = ("tensor", "version", "pin", "source")

    def __init__(self, x: torch.Tensor, pin: Any) -> None:
        if x.grad_fn is None:
            self.tensor = self.source = x
        else:
            base = x._base
            self.source = base if base is not None and base.grad_fn is None else None
            self.tensor = x.detach()
        self.version = x._version
        self.pin = pin


class Step:
    """One op of a recipe: ``func(*args, **kwargs)``, replayed with ``rng_state`` restored."""

    __slots__ = ("func", "args", "kwargs", "rng_state", "out_index", "seconds", "siblings")

    def __init__(self, func: Any, args: tuple, kwargs: dict, rng_state: Optional[Tuple[torch.device, torch.Tensor]],
                 out_index: int = 0, seconds: float = 0.0, siblings: Sequence[Any] = ()) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.rng_state = rng_state
        self.out_index = out_index
        self.seconds = seconds  # measured forward time of the op (profiling frames only)
        self.siblings = siblings  # weak refs to every output node of a call with several

    @property
    def name(self) -> str:
        """The op's printable name (``aten.mul.Tensor``), computed once per op."""
        return _OpInfo.of(self.func).name


class StorageNode:
    """A storage created inside a traced forward, and how to rebuild it in any state."""

    __slots__ = (
        "key", "position", "nbytes", "device", "_weak", "creator", "mutations", "recomputable",
        "replayable", "why_not", "owners", "offloaded", "kept", "anchor", "cache", "__weakref__",
    )

    def __init__(self, key: str, position: int, storage: torch.UntypedStorage, creator: Step,
                 recomputable: bool, why_not: str, cache: "RecomputeCache") -> None:
        self.key = key
        self.position = position
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self._weak = storage._weak_ref()  # a plain integer handle: no objects per node for it
        self.creator = creator
        self.mutations: Tuple[Step, ...] = ()  # a tuple: most storages are never written in place
        self.recomputable = recomputable  # the creating op can be replayed
        self.replayable = 0  # leading mutations that can be replayed
        self.why_not = why_not
        # Paths of the modules that filled, inside this forward, storages from outside it that a
        # rebuild of this node reads (FSDP2's unsharded parameters): None for most nodes.
        self.owners: Optional[frozenset] = None
        # Data holders registered by the saved-tensor runtime, by state.
        self.offloaded: Dict[int, Any] = {}
        self.kept: Dict[int, Tuple["weakref.ref[torch.Tensor]", int]] = {}  # state -> (tensor, version)
        self.anchor: Optional[Tuple[torch.Tensor, int, Any]] = None  # (block input, state, pin)
        self.cache = cache

    @property
    def state(self) -> int:
        """The storage's current state: how many in-place ops have been applied to it."""
        return len(self.mutations)

    def rebuildable(self, state: int) -> bool:
        """Whether replaying the recipe reproduces the storage in ``state``."""
        return self.recomputable and state <= self.replayable

    def __repr__(self) -> str:
        return f"StorageNode({self.key!r}, {self.nbytes} B, state={self.state})"

    def __del__(self, free: Callable[[int], None] = torch.UntypedStorage._free_weak_ref) -> None:
        # ``free`` bound at definition: module globals may be gone at interpreter exit.
        weak = getattr(self, "_weak", None)  # None: an interrupt stopped __init__ before it was set
        if weak is not None:
            free(weak)

    def __reduce__(self) -> Any:
        # A copy would free the weak handle a second time.
        raise TypeError(f"{self!r} cannot be copied or pickled: it belongs to one traced forward")


def _rng_state(func: Any, args: tuple, kwargs: dict) -> Tuple[torch.device, torch.Tensor]:
    device = kwargs.get("device")
    if device is None:
        for a in args:
            if isinstance(a, torch.Tensor):
                device = a.device
                break
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cpu":
        return device, torch.get_rng_state()
    return device, torch.cuda.get_rng_state(device)


def _set_rng_state(state: Tuple[torch.device, torch.Tensor]) -> None:
    device, value = state
    if device.type == "cpu":
        torch.set_rng_state(value)
    else:
        torch.cuda.set_rng_state(value, device)


def step_refs(step: Step) -> Iterator[Ref]:
    """The references to traced storages ``step`` reads (not to the one it mutates)."""
    stack: List[Any] = [step.args, list(step.kwargs.values())]
    while stack:
        x = stack.pop()
        if isinstance(x, Ref):
            if x.node is not SELF:
                yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def recipe_refs(node: "StorageNode", state: int) -> Iterator[Ref]:
    """The references to traced storages that rebuilding ``node`` in ``state`` reads."""
    for step in (node.creator,) + node.mutations[:state]:
        yield from step_refs(step)


def step_inputs(step: Step) -> Iterator["StorageNode"]:
    """The traced storages ``step`` reads (not the one it mutates)."""
    return (ref.node for ref in step_refs(step))


def _reads_newer(step: Step, position: int) -> bool:
    """Whether ``step`` reads a storage created after ``position``."""
    return any(node.position > position for node in step_inputs(step))


# aten ops that update their running_mean / running_var arguments in place although their
# schemas do not mark them written: replaying one would update the statistics a second time.
_UNDECLARED_WRITES = frozenset({
    "aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
    "aten::batch_norm_update_stats", "aten::batch_norm_gather_stats_with_counts",
})

# Namespaces of collectives. Their ops write into tensors they were given without their schemas
# saying so (``c10d::alltoall_base_`` fills its output, ``_c10d_functional::wait_tensor`` is
# where a functional collective's result becomes valid), and replaying one in backward would
# issue a collective on one rank only: a deadlock, or ranks out of step.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "symm_mem"})


def _tensor_arg(arg: Any) -> bool:
    """Whether a schema argument holds tensors (``Tensor``, ``Tensor?``, ``Tensor[]``, ...)."""
    return "Tensor" in str(arg.type)


# Collectives that only read their tensors.
_SENDS = frozenset({"send", "isend"})


def _collective_writes(arg: Any, op_name: str) -> bool:
    """Whether a collective writes ``arg``: c10d's schemas declare no writes, but name what a
    collective reads ``input*`` (all-gather, all-to-all, reduce-scatter: ``output*`` is written)
    and what it updates in place ``tensors`` (all-reduce, broadcast, receive), and
    ``wait_tensor``'s ``tensor`` is where a functional collective's result becomes valid. A
    tensor a collective only reads must not count as written: a saved activation that was sent
    would look modified at its unpack."""
    return (_tensor_arg(arg) and op_name not in _SENDS and not arg.name.startswith("input")
            and arg.name != "sparse_indices")


def _is_collective(func: Any) -> bool:
    schema = func._schema
    return func.namespace in _COLLECTIVE_NAMESPACES or any(
        "c10d" in str(a.type) for a in (*schema.arguments, *schema.returns))


def _declares_writes(func: Any) -> bool:
    """Whether ``func``'s schema annotates what it writes: aten and prims ops do, and so does any
    op whose schema annotates aliasing at all. c10d's collectives annotate nothing."""
    if func.namespace in ("aten", "prims"):
        return True
    schema = func._schema
    return any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))


class _OpInfo:
    """Per-OpOverload facts computed once: printable name, written args, random, and why it
    cannot be replayed ("" when it can).

    Which arguments an op writes: what its schema declares; for collectives whose schemas
    declare nothing (c10d's), what ``_collective_writes`` reads from their argument names. Other
    ops are taken at their schemas' word, as torch's functionalization takes them: a custom op
    that writes without declaring it is outside what the tracer can see. Collectives and ops
    from outside aten are never replayed: what they wrote or made is kept or offloaded, and a
    recompute chain stops there.
    """

    __slots__ = ("func", "name", "written", "random", "why_not", "replayable", "collective")
    _cache: Dict[int, "_OpInfo"] = {}

    def __init__(self, func: Any) -> None:
        self.func = func
        self.name = str(func)
        schema = func._schema
        self.collective = _is_collective(func)
        if self.collective and not _declares_writes(func):
            op_name = schema.name.partition("::")[2]
            self.written = tuple(i for i, a in enumerate(schema.arguments) if _collective_writes(a, op_name))
        else:
            self.written = tuple(
                i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
            )
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        if self.collective:
            self.why_not = f"{self.name} is a collective: replaying it in backward would desynchronize ranks"
        elif func.namespace not in ("aten", "prims"):
            self.why_not = f"{self.name} is not an aten op"
        elif schema.name in _UNDECLARED_WRITES:
            self.why_not = f"{self.name} updates running statistics in place: a replay would update them again"
        else:
            self.why_not = ""
        self.replayable = not self.why_not

    @classmethod
    def of(cls, func: Any) -> "_OpInfo":
        # Keyed by id: an OpOverload hashes in Python, and lives as long as its op (the info
        # holds it, so the id is never reused).
        info = cls._cache.get(id(func))
        if info is None:
            info = cls._cache[id(func)] = _OpInfo(func)
        return info


def _written_tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in a written argument (a tensor, or lists of them: ``Tensor(a!)[]``)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _written_tensors(v)


class TracingMode(TorchDispatchMode):
    """Records a ``StorageNode`` for every storage created by ops of the traced forward.

    ``nodes`` maps a storage address to its node for the current frame. The module path of the
    innermost module call is maintained by module hooks through ``push_module`` / ``pop_module``.
    ``pin_leaf(t)`` is called for every tensor from outside the region that a recipe holds and
    returns an object that counts it for as long as the recipe lives; ``charge(storage)`` counts a
    storage rebuilt in backward while the frame's ``RecomputeCache`` holds it. With ``profile``
    set, each op is timed.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in a Dynamo-disabling shim that costs more
        # per op than the recording itself; the traced forward runs eagerly, not compiled.
        return False

    def __init__(self, pin_leaf: Callable[[torch.Tensor], Any],
                 charge: Optional[Callable[[torch.UntypedStorage], Any]] = None) -> None:
        super().__init__()
        self.nodes: Dict[int, StorageNode] = {}
        self._charge = charge
        self.cache = RecomputeCache(charge)
        self.profile = False
        self.suspended = 0
        self._pin_leaf = pin_leaf
        self._calls: List[Tuple[str, Dict[str, int]]] = [("", {})]
        self._call_counts: Dict[str, int] = {}
        # Paths of the modules whose calls, in any frame, had an effect a rerun would repeat:
        # a collective, or a write into a storage from outside the traced forward (a buffer, a
        # counter, a parameter an FSDP2 unshard fills). They are never rerun whole in backward
        # (``ActivationRuntime``'s rerun blocks).
        self.side_effect_modules: Set[str] = set()
        # Storages from outside the traced forward that an op inside it wrote, with the path of
        # the module whose call wrote them (see _record_mutation and StorageNode.owners).
        self.written_outside: Dict[int, Tuple[StorageWeakRef, str]] = {}
        self._owners: Set[str] = set()

    # -- module path ------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new frame: forget the previous frame's nodes and module calls."""
        self.nodes = {}
        self.written_outside = {}
        self.cache = RecomputeCache(self._charge)
        self._calls = [("", {})]
        self._call_counts = {}

    def push_module(self, path: str) -> None:
        n = self._call_counts.get(path, 0)
        self._call_counts[path] = n + 1
        self._calls.append((path if n == 0 else f"{path}#{n}", {}))

    def pop_module(self) -> None:
        if len(self._calls) > 1:
            self._calls.pop()

    def _side_effect(self) -> None:
        """The running op has an effect a rerun would repeat: mark every module call it is in."""
        for path, _ in self._calls[1:]:
            self.side_effect_modules.add(path.partition("#")[0])

    def module_path(self) -> str:
        """The path of the innermost module call running now ("" outside every module)."""
        return module_of(self._calls[-1][0] + ":")

    def rebuild_safe(self, node: StorageNode) -> bool:
        """Whether a rebuild of ``node`` for a save made now reads only storages that are there
        when backward unpacks it. A storage filled in this forward by a module's call (FSDP2
        unshards a module's parameters in its pre-forward and frees them after its forward) is
        there again only while backward runs inside that module, so a save may be rebuilt from
        it only if it is made inside that module."""
        if not node.owners:
            return True
        path = self.module_path()
        return all(path == o or path.startswith(o + ".") or not o for o in node.owners)

    # -- recording --------------------------------------------------------------------------
    def _encode(self, x: Any, mutated: Optional[StorageNode]) -> Any:
        if isinstance(x, torch.Tensor):
            if not is_plain(x):
                return Leaf(x, None)
            cdata = x.untyped_storage()._cdata
            node = self.nodes.get(cdata)
            if node is None or (node is not mutated and not node.rebuildable(len(node.mutations))):
                if node is None and cdata in self.written_outside:
                    self._owners.add(self.written_outside[cdata][1])
                return Leaf(x, self._pin_leaf(x))
            if node.owners and node is not mutated and node.anchor is None:  # a rebuild stops at a held anchor
                self._owners.update(node.owners)
            return Ref(SELF if node is mutated else node, len(node.mutations), view_meta(x))
        if isinstance(x, (list, tuple)):
            return type(x)([v if type(v) in _SCALARS else self._encode(v, mutated) for v in x])
        if isinstance(x, dict):  # keyword arguments (an attention mask is keyword-only)
            return {k: self._encode(v, mutated) for k, v in x.items()} if x else _NO_KWARGS
        return x

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not kwargs:
            kwargs = _NO_KWARGS
        if self.suspended:
            return func(*args, **kwargs)
        info = _OpInfo.of(func)
        rng = _rng_state(func, args, kwargs) if info.random else None
        if self.profile:
            start = time.perf_counter()
            out = func(*args, **kwargs)
            seconds = time.perf_counter() - start
        else:
            out = func(*args, **kwargs)
            seconds = 0.0
        if info.collective:
            self._side_effect()
        if info.written:
            written = self._record_mutation(func, info, args, kwargs, rng, seconds)
            if not func.is_view:
                self._record_outputs(func, info, args, kwargs, out, rng, seconds, written)
        else:
            self._record_outputs(func, info, args, kwargs, out, rng, seconds)
        return out

    def _record_outputs(self, func: Any, info: _OpInfo, args: tuple, kwargs: dict, out: Any,
                        rng: Any, seconds: float, written: Optional[Set[int]] = None) -> None:
        """Give each fresh output storage of an op a node. ``written``: the storages the op
        wrote (an op with ``written`` is not replayed, so its fresh outputs can be kept or
        offloaded but not rebuilt)."""
        if func.is_view:
            return  # views alias a storage that has a node already, or a leaf
        outs = out if isinstance(out, (tuple, list)) else (out,)
        encoded: Optional[Tuple[tuple, dict]] = None
        replayable = info.replayable and written is None
        why_not = info.why_not or ("" if replayable else f"{info.name} also writes its arguments: a replay would "
                                                          f"write them again")
        several = len(outs) > 1
        siblings: List[Any] = []
        for index, o in enumerate(outs):
            if not is_plain(o):  # also false for what is not a tensor
                continue
            storage = o.untyped_storage()
            if storage._cdata in self.nodes or (written is not None and storage._cdata in written):
                continue  # an op returning one of its inputs, or what it wrote
            if encoded is None:
                # What is never replayed keeps no references to its inputs.
                self._owners = set()
                encoded = (self._encode(args, None), self._encode(kwargs, None)) if replayable else ((), {})
                owners = frozenset(self._owners) if self._owners else None
                path, counts = self._calls[-1]
                n = counts.get(info.name, 0)
                counts[info.name] = n + 1
                key = f"{path}:{info.name}:{n}"
            step = Step(func, encoded[0], encoded[1], rng if replayable else None, index, seconds,
                        siblings if several else ())
            node = StorageNode(
                key if index == 0 else f"{key}.{index}", len(self.nodes), storage, step, replayable,
                why_not, self.cache,
            )
            node.owners = owners
            self.nodes[storage._cdata] = node
            if several:
                siblings.append(weakref.ref(node))

    def _record_mutation(self, func: Any, info: _OpInfo, args: tuple, kwargs: dict, rng: Any,
                         seconds: float) -> Set[int]:
        """Record an in-place op on every traced storage it writes; returns the addresses of
        every storage it wrote, traced or not. A write to a storage from outside the traced
        forward (a parameter an FSDP2 unshard fills, a buffer) is remembered in
        ``written_outside``: what reads such a storage is not replayed (``_encode``)."""
        schema_args = func._schema.arguments
        targets: List[Tuple[StorageNode, torch.Tensor]] = []
        written: Set[int] = set()
        foreign = False
        for i in info.written:
            for t in _written_tensors(args[i] if i < len(args) else kwargs.get(schema_args[i].name)):
                if not is_plain(t):
                    foreign = True
                    continue
                cdata = t.untyped_storage()._cdata
                written.add(cdata)
                node = self.nodes.get(cdata)
                if node is None:
                    foreign = True
                    self._side_effect()
                    # Held weakly: the address stays a sound key while the entry lives.
                    self.written_outside[cdata] = (StorageWeakRef(t.untyped_storage()), self.module_path())
                elif all(node is not n for n, _ in targets):
                    targets.append((node, t))
        for node, t in targets:
            if node.replayable == len(node.mutations):
                self._owners = set(node.owners or ())
                step = Step(func, self._encode(args, node), self._encode(kwargs, node), rng, 0, seconds)
                node.owners = frozenset(self._owners) if self._owners else None
                if foreign or len(targets) > 1 or not info.replayable:
                    node.why_not = info.why_not or f"{info.name} also writes storage outside this node"
                elif _reads_newer(step, node.position):
                    node.why_not = f"{info.name} writes it from storages created after it"
                else:
                    node.replayable += 1
            if len(node.mutations) >= node.replayable:
                step = Step(func, (), {}, None, 0, seconds)  # not replayable: keep no references
            node.mutations += (step,)
        return written


# -- replay ---------------------------------------------------------------------------------
class RecomputeCache:
    """Storages recomputed during one frame's backward, so a chain is replayed once.

    Backward consumes a frame's blocks in reverse order, and a storage is only an input of
    storages created after it. So when backward asks for a storage in the block that starts at
    anchor ``a``, cached storages of later blocks will not be needed again and are evicted: the
    cache holds at most about one block's recomputed activations. Within the block, a storage
    is dropped as soon as its readers in the running pass are done (``served``), as checkpoint
    drops a recomputed tensor at its unpack. Its readers (``add_reader``) are the saved views of
    it that the runtime released and the rebuilds whose recipes read it (of released storages
    and of the storages rebuilding those rebuilds first); a reader that was not counted (a
    storage saved later, a second access) replays it again. Evicting too early costs a second
    replay, never a wrong value; counting a reader that never comes keeps the storage until
    the block is left. The cache is cleared when the backward pass that uses it ends (each
    backward unpack calls ``bind_to_backward``), so entries rebuilt ahead of that pass, by an
    early recompute, are cleared with it. ``charge(storage)`` returns what counts a cached
    storage as resident (``ActivationRuntime``'s ledger) for as long as it is cached, or None
    where holding it would cross the budget: it is then not cached.
    """

    __slots__ = ("_entries", "_task", "anchors", "_readers", "_served", "_released", "_charge")

    def __init__(self, charge: Optional[Callable[[torch.UntypedStorage], Any]] = None) -> None:
        self._charge = charge
        # (position, state) -> (the rebuilt storage, its charge)
        self._entries: Dict[Tuple[int, int], Tuple[torch.UntypedStorage, Any]] = {}
        self._task = -1
        self.anchors: List[int] = []  # positions of block inputs, ascending
        # by (position, state): readers in each backward pass, readers done in the running one,
        # and the storages whose rebuilds are counted as readers (``release``)
        self._readers: Dict[Tuple[int, int], int] = {}
        self._served: Dict[Tuple[int, int], int] = {}
        self._released: Set[Tuple[int, int]] = set()

    def get(self, position: int, state: int) -> Optional[torch.UntypedStorage]:
        entry = self._entries.get((position, state))
        return entry[0] if entry is not None else None

    def put(self, position: int, state: int, storage: torch.UntypedStorage) -> None:
        if self._charge is None:
            self._entries[(position, state)] = (storage, None)
            return
        charge = self._charge(storage)
        if charge is not None:  # else no room: a later reader rebuilds it again
            self._entries[(position, state)] = (storage, charge)

    def add_reader(self, position: int, state: int) -> None:
        """One more reader of the storage in each backward pass."""
        key = (position, state)
        self._readers[key] = self._readers.get(key, 0) + 1

    def release(self, position: int, state: int) -> bool:
        """Mark the storage as one backward will rebuild (released by a pack, or an input such
        a rebuild rebuilds first); whether it was not yet (its rebuild is then to be counted as
        a reader of its recipe's inputs)."""
        key = (position, state)
        if key in self._released:
            return False
        self._released.add(key)
        return True

    def released(self, position: int, state: int) -> bool:
        return (position, state) in self._released

    def served(self, position: int, state: int) -> None:
        """A reader of the storage is done; once all of them are in this backward pass, the
        storage is dropped."""
        key = (position, state)
        n = self._served.get(key, 0) + 1
        self._served[key] = n
        if n >= self._readers.get(key, 0):
            self._entries.pop(key, None)

    def evict_after(self, position: int) -> None:
        """Drop storages of the blocks that start after ``position``'s block."""
        if self._entries:
            i = bisect.bisect_right(self.anchors, position)
            if i < len(self.anchors):
                boundary = self.anchors[i]
                for key in [k for k in self._entries if k[0] >= boundary]:
                    del self._entries[key]

    def bind_to_backward(self) -> None:
        """Clear the cache when the running backward pass ends; nothing outside one."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:
            self._task = task
            self._served = {}
            entries = self._entries
            torch.autograd.Variable._execution_engine.queue_callback(entries.clear)

    def __len__(self) -> int:
        return len(self._entries)


class Replayer:
    """Rebuilds storages from their recipes, in dependency order, reusing what is at hand.

    ``source(node, state)`` returns the storage from an anchor, a kept tensor or an offloaded
    copy, or None when it must be recomputed; recomputed storages go to the node's frame cache.
    What must be rebuilt is found by an explicit depth-first walk (inputs before the storages
    that read them), so a chain of dropped storages of any length is rebuilt without deep
    recursion. A storage ``source`` hands out is asked for once per replayer (one unpack). With
    ``times``, each storage's own replay (its op call and in-place ops, its inputs at hand, and
    the walk since the previous op call) is timed into ``times[key]``: [seconds, timed
    replays, replays, seconds as a rebuild's first, replays as a rebuild's first] (the first
    op call of a rebuild is timed apart: its inputs were made before the rebuild); what
    ``source`` took to hand out offloaded storages (reloads) is in ``reload_seconds``.
    """

    def __init__(self, source: Callable[[StorageNode, int], Optional[torch.UntypedStorage]],
                 times: Optional[Dict[str, List[float]]] = None) -> None:
        self._source = source
        self._times = times
        self.reload_seconds = 0.0  # spent in ``source`` on offloaded storages: not replaying
        self._found: Dict[Tuple[int, int], torch.UntypedStorage] = {}  # (id(node), state) -> storage

    def storage(self, node: StorageNode, state: int) -> torch.UntypedStorage:
        found = self._at_hand(node, state)
        if found is None:
            self._rebuild(node, state)
            found = self._found[(id(node), state)]
        return found

    def _at_hand(self, node: StorageNode, state: int) -> Optional[torch.UntypedStorage]:
        key = (id(node), state)
        found = self._found.get(key)
        if found is None:
            if node.offloaded.get(state) is not None:  # a reload (or a wait for one)
                start = time.perf_counter()
                found = self._source(node, state)
                self.reload_seconds += time.perf_counter() - start
            else:
                found = self._source(node, state)
            if found is None:
                found = node.cache.get(node.position, state)
            if found is not None:
                self._found[key] = found
        return found

    def _rebuild(self, root: StorageNode, root_state: int) -> None:
        stack: List[Tuple[StorageNode, int, bool]] = [(root, root_state, False)]
        # Each op call inside the chain is timed from the previous one's end (its share of the
        # walk: the lookups and bookkeeping between them, reloads aside) to its own. The
        # rebuild's first (its inputs made before the rebuild, in cpu caches or not, so it
        # costs more alone than inside a chain) is timed apart, from its own start: the walk
        # down to it is entering the rebuild.
        timed = self._times
        lead = True
        mark, reloaded = 0.0, 0.0
        with _ReplayScope():
            while stack:
                node, state, inputs_ready = stack.pop()
                if self._at_hand(node, state) is not None:
                    continue
                if inputs_ready:
                    if lead and timed is not None:
                        mark, reloaded = time.perf_counter(), self.reload_seconds
                    found = self._recompute(node, state)
                    if timed is not None:
                        now = time.perf_counter()
                        entry = timed.get(node.key)
                        if entry is None:
                            entry = timed[node.key] = [0.0, 0, 0, 0.0, 0]
                        spent = now - mark - (self.reload_seconds - reloaded)
                        if lead:
                            entry[3] += spent
                            entry[4] += 1
                        else:
                            entry[0] += spent
                            entry[1] += 1
                        entry[2] += 1
                        mark, reloaded, lead = now, self.reload_seconds, False
                    node.cache.put(node.position, state, found)
                    self._found[(id(node), state)] = found
                    if node.cache.released(node.position, state):  # its inputs counted this rebuild
                        for ref in recipe_refs(node, state):
                            ref.node.cache.served(ref.node.position, ref.state)
                    continue
                stack.append((node, state, True))
                for ref in recipe_refs(node, state):
                    if self._at_hand(ref.node, ref.state) is None:
                        stack.append((ref.node, ref.state, False))

    def _recompute(self, node: StorageNode, state: int) -> torch.UntypedStorage:
        if not node.rebuildable(state):
            raise RuntimeError(
                f"bagualu2: activation {node.key} is needed to recompute another but was dropped "
                f"and cannot be recomputed ({node.why_not})"
            )
        out = self._run(node.creator, None)  # below _rebuild's replay, no-grad, no-autocast scope
        outs = out if isinstance(out, (tuple, list)) else (out,)
        storage = outs[node.creator.out_index].untyped_storage()
        for sibling_ref in node.creator.siblings:  # other outputs of the same op call
            sibling = sibling_ref()
            if sibling is not None and sibling is not node and sibling.creator.out_index < len(outs):
                sibling.cache.put(sibling.position, 0, outs[sibling.creator.out_index].untyped_storage())
        for step in node.mutations[:state]:
            self._run(step, storage)
        return storage

    def _decode(self, x: Any, self_storage: Optional[torch.UntypedStorage]) -> Any:
        if isinstance(x, Ref):
            if x.node is SELF:
                assert self_storage is not None
                return view_of(self_storage, x.meta)
            return view_of(self.storage(x.node, x.state), x.meta)
        if isinstance(x, Leaf):
            if x.source is not None and x.source._version != x.version:
                raise RuntimeError(
                    f"bagualu2: a tensor of shape {tuple(x.tensor.shape)} used to recompute an "
                    f"activation was modified in place after the forward (version {x.version} -> "
                    f"{x.source._version}); keep or offload that activation instead"
                )
            t = x.tensor
            if t.numel() and t.untyped_storage().nbytes() < (t.storage_offset() + 1) * t.element_size():
                # Freed since the forward read it (an FSDP2 parameter resharded): running the op
                # would read freed memory.
                raise RuntimeError(
                    f"bagualu2: a tensor of shape {tuple(t.shape)} used to recompute an activation has "
                    f"been freed since the forward read it (a sharded parameter resharded?)"
                )
            return t
        if isinstance(x, (list, tuple)):
            return type(x)([v if type(v) in _SCALARS else self._decode(v, self_storage) for v in x])
        if isinstance(x, dict):
            return {k: self._decode(v, self_storage) for k, v in x.items()} if x else x
        return x

    def _run(self, step: Step, self_storage: Optional[torch.UntypedStorage]) -> Any:
        args = self._decode(step.args, self_storage)
        kwargs = self._decode(step.kwargs, self_storage)
        if step.rng_state is None:
            return step.func(*args, **kwargs)
        device = step.rng_state[0]
        saved = (device, torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device))
        _set_rng_state(step.rng_state)
        try:
            return step.func(*args, **kwargs)
        finally:
            _set_rng_state(saved)


