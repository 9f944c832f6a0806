"""Recipes: the record of how to rebuild each traced storage, and their replay.

Owns ``StorageNode`` (one storage made inside a traced forward: its key, its creating op and
in-place ops as ``Step``s, whether and up to which state it can be rebuilt, and the data
holders the saved-tensor runtime registers on it), the recipe arguments ``Ref`` (a view of a
traced storage in a given state) and ``Leaf`` (a tensor from outside the traced region), the
per-frame ``RecomputeCache``, the ``Replayer`` that rebuilds storages in dependency order, and
the thread's replay scope behind ``is_recomputing``. ``TracingMode`` (tracing.py) writes
recipes; the activation runtime reads and replays them.

Invariants:

* A node never references a node created after it, except itself (encoded as ``SELF``), so
  nodes form a DAG and are freed by reference counting the moment nothing needs them; a replay
  walks that DAG depth-first with an explicit stack, inputs before their readers.
* A node holds its storage only weakly (a storage weak reference, freed with the node): a
  recipe never extends the life of an activation. The weak reference also keeps the storage's
  address from being reused while the node is in the frame's map, so the address is a sound
  key. A node cannot be copied or pickled, since a copy would free that handle twice.
* Replaying a recipe runs the same aten ops on bitwise-identical inputs with the same RNG state,
  inside a scope with no autograd and no autocast (the recorded ops already carry the dtypes
  autocast chose), so it reproduces the storage bit for bit. A ``Leaf`` modified in place or
  freed since the forward read it makes the replay raise instead of reading wrong data.
* The replay scope's exit restores the depth its entry found, so an interrupt leaves the
  thread's ``is_recomputing`` state as it was once the exit runs.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from bagualu2.runtime.op_effects import OpInfo
from bagualu2.shared import call_key, module_of

__all__ = ["Leaf", "RecomputeCache", "Ref", "ReplayDepth", "ReplayScope", "Replayer", "Step", "StorageNode", "ViewMeta", "call_key",
           "is_plain", "is_recomputing", "module_of", "recipe_refs", "reset_replay_depth", "step_inputs",
           "step_refs", "view_meta", "view_of"]


_STATE = threading.local()


def is_recomputing() -> bool:
    """True while bagualu2 replays a recipe, or while autograd runs a backward pass.

    Gate callbacks and module hooks that fire again during recomputation (bagualu2's own replay
    runs aten ops and fires no module hooks, but ``torch.utils.checkpoint`` reruns modules inside
    backward) use this to skip counting and decisions.
    """
    return getattr(_STATE, "replaying", 0) > 0 or torch._C._current_graph_task_id() != -1


class ReplayDepth:
    """Where bagualu2 recomputes: ``is_recomputing()`` true inside. A block rerun
    (``rerun.py``) enters only this: it runs the module with autograd, to capture its saves.

    The exit restores the depth the entry found (not one step back), so an interrupt that
    stops the entry halfway leaves nothing behind once the exit runs; ``reset_replay_depth``
    repairs the count where an interrupt stopped the entry before the ``with`` owned it."""

    __slots__ = ("_depth",)

    def __enter__(self) -> None:
        self._depth = getattr(_STATE, "replaying", 0)
        _STATE.replaying = self._depth + 1

    def __exit__(self, *exc: object) -> None:
        _STATE.replaying = self._depth


class ReplayScope(ReplayDepth):
    """Where recipes replay: ``is_recomputing()`` true, no autograd, and no autocast (the
    recorded ops already carry the dtypes autocast chose). Entered once per rebuilt chain;
    its exit, too, restores what its entry found."""

    __slots__ = ("_grad", "_autocast")

    def __enter__(self) -> None:
        self._grad = torch.is_grad_enabled()
        self._autocast = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        super().__enter__()
        torch.set_grad_enabled(False)
        for device in self._autocast:
            torch.set_autocast_enabled(device, False)

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
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
    was taken of); None when that would mean holding the graph, and then nothing is checked (a
    detach made below autograd, where the tracing mode runs, shares no version counter): the
    tracing mode's ``writes_across_blocks`` keeps such leaves from being written after they
    were read in a model that does so.
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
        return OpInfo.of(self.func).name


class StorageNode:
    """A storage created inside a traced forward, and how to rebuild it in any state."""

    __slots__ = (
        "key", "position", "nbytes", "device", "_weak", "creator", "mutations", "recomputable",
        "replayable", "why_not", "owners", "offloaded", "kept", "anchor", "cache", "version", "read_in",
        "made_in", "__weakref__",
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
        self.anchor: Optional[Tuple[torch.Tensor, int, Any, int]] = None  # (block input, state, pin, version)
        self.cache = cache
        # The version counter the storage's tensors read once the last op the tracing mode saw
        # on it has returned (``TracingMode.seen``); -1: none (an inference tensor).
        self.version = 0
        self.read_in = -1  # the stretch of the forward that last read it (``TracingMode._segment``)
        self.made_in = -1  # the stretch that made it

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

    @property
    def nbytes(self) -> int:
        """Bytes of the rebuilt storages it holds now."""
        return sum(storage.nbytes() for storage, _ in self._entries.values())


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
        with ReplayScope():
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
