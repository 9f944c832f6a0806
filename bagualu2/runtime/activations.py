"""Saved-tensor runtime: applies KEEP / OFFLOAD / RECOMPUTE to every saved activation.

Design note
-----------
While a provisioned forward runs (a *frame*, one micro-batch), ``ActivationRuntime`` has a
``TracingMode`` and a pair of saved-tensor hooks installed. For every tensor autograd saves, the
pack hook finds the storage's ``StorageNode`` (its producing op) and applies that op's choice
from the frame's plan:

* KEEP: the tensor itself is held, as autograd would.
* OFFLOAD: the whole storage is copied once into the ``HostArena`` through the ``CopyEngine``;
  every saved view of it refers to that one copy. Backward reloads it, prefetching the next
  offloaded storages of the frame (in reverse pack order) so the copy overlaps compute.
* RECOMPUTE: nothing is held but the node; unpack replays the recipe (``Replayer``), rebuilding
  inputs that were dropped or offloaded first, in dependency order. A frame that recomputes
  whole blocks (``Frame.rerun_blocks``) runs them untraced instead and reruns each in backward
  (``BlockRerun``).

Invariants:

* Exactness: the tensor unpack returns is bitwise equal to, and has the same size, strides,
  storage offset and dtype as, the tensor that was packed.
* Nothing lost: data is freed only with the packed objects that own it. Autograd drops those
  when the graph dies (after backward, or when the graph is discarded without one), so a packed
  activation may be unpacked any number of times (``retain_graph``) or never.
* Exact accounting: ``ResidencyLedger`` counts the device bytes of every storage the runtime
  holds (kept tensors, offload sources still in flight, leaves pinned by recipes; in backward,
  reloaded copies and rebuilt storages while it holds them for more readers), once per
  storage, whichever frames hold it. Parameters and buffers are not activations and are not
  counted.
* Budget: with ``enforce_budget`` set, a storage that would push the ledger over the budget is
  offloaded or recomputed instead of kept (waiting for in-flight offloads first); what cannot be
  released is a violation, reported through ``on_exceed``. An untraced frame (one whose plan was
  not expected to release anything) has no recipes, so there such a storage is offloaded. In
  backward, a copy or rebuilt storage that more readers need is held for them only within the
  budget (else each reader reloads or rebuilds its own), and prefetches stop at it: what
  backward holds stays within the budget beside what the forward left (a rerun block's
  captured saves excepted: one rerun makes them all).
* Fallbacks never lose data: an offload the arena cannot take becomes a recompute (or a keep),
  a recompute that cannot be replayed becomes an offload (or a keep), an offload whose copy
  fails keeps its device source (``_OffloadStore.settle``), and each is recorded. A reload that
  fails raises, naming the activation.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Deque, Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

from bagualu2 import _C
from bagualu2.runtime.rerun import BlockRerun, RerunSaved, unrestorable
from bagualu2.runtime.tracing import (
    Replayer, StorageNode, TracingMode, ViewMeta, is_plain, recipe_refs, step_inputs, view_meta, view_of,
)
from bagualu2.plan.planner import Choice

__all__ = ["ActivationRuntime", "AttachedHook", "Frame", "ResidencyLedger"]


def _unattached(*args: Any, **kwargs: Any) -> None:
    """What a copy of a module holds in place of an ``AttachedHook``: a hook that does nothing."""


def _detached() -> Callable[..., None]:
    return _unattached


class AttachedHook:
    """A module hook bagualu2 installs on a user's module (through ``register_forward_*``).

    A copy of the module (``copy.deepcopy``: an EMA or teacher model; ``torch.save`` of the
    whole module) is a plain module: it gets a hook that does nothing in this one's place, so
    it neither runs through nor reports to the original's runtime, and it pickles.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _unattached

    def __reduce__(self) -> Tuple[Callable[[], Callable[..., None]], tuple]:
        return _detached, ()


# Creating ops whose output is only a dtype cast or copy of their one tensor input: when that
# input is already stored, the output is regenerated from it instead of being stored twice.
_CAST_OPS = frozenset({"aten._to_copy.default", "aten.clone.default", "aten._to_dtype.default"})


class ResidencyLedger:
    """Device bytes held for activations, counted once per storage.

    A count is held by a ``_Pin`` (``acquire``) and given back by ``release`` or by the pin's
    death; ``resident`` is the sum of the sizes of storages with a positive count, ``peak`` its
    high-water mark.

    Interrupt safety: an interrupt (KeyboardInterrupt from a signal handler) lands between
    bytecodes where the interpreter checks for one (function entry, loop jumps, after calls), so
    it may land at the first line of a finalizer, which then never runs (Python reports it as
    "Exception ignored" and drops it). So a pin has no finalizer: its death is noticed by a
    weak reference whose callback is a C method (``list.append``), which runs no bytecode and
    cannot be interrupted, and its count is given back at the next read of the ledger
    (``collect``). Inside ``acquire`` and ``release`` the count and the registration of the
    pin change together, with no call between them: an interrupt sees both or neither.
    """

    def __init__(self) -> None:
        # Reentrant: a collection can run a finalizer that drops a pin while a call holds it.
        self._lock = threading.RLock()
        # cdata -> [count, nbytes, weak handle]; the weak handle keeps the address from being
        # reused by another storage while it is a key here
        self._held: Dict[int, List[Any]] = {}
        self._pins: Dict["weakref.ref[_Pin]", int] = {}  # a live pin's weak reference -> its storage
        self._dead: List["weakref.ref[_Pin]"] = []  # weak references of pins that died, not yet collected
        # Held here: releases run at interpreter exit too, when module globals may be gone.
        self._free_weak_ref = torch.UntypedStorage._free_weak_ref
        self._resident = 0
        self.peak = 0

    @property
    def resident(self) -> int:
        if self._dead:
            self.collect()
        return self._resident

    def acquire(self, storage: torch.UntypedStorage, pin: "_Pin") -> None:
        """Count ``storage`` for ``pin``'s life (or until ``release(pin._ref)``)."""
        cdata = storage._cdata
        ref = weakref.ref(pin, self._dead.append)
        nbytes = storage.nbytes()
        held = self._held
        with self._lock:
            if self._dead:
                self._collect_locked()
            if cdata in held:
                held[cdata][0] += 1
            else:
                weak = storage._weak_ref()
                # From here on no calls: the count and the pin's registration change together.
                held[cdata] = [1, nbytes, weak]
                self._resident += nbytes
                if self._resident > self.peak:
                    self.peak = self._resident
            self._pins[ref] = cdata
            pin._ref = ref

    def release(self, ref: "weakref.ref[_Pin]") -> None:
        """Give back the count a pin holds (its ``_ref``); nothing when it was given back."""
        pins, held = self._pins, self._held
        with self._lock:
            if ref in pins:
                cdata = pins[ref]
                del pins[ref]
                entry = held[cdata]
                entry[0] -= 1
                if not entry[0]:
                    del held[cdata]
                    self._resident -= entry[1]
                    self._free_weak_ref(entry[2])

    def collect(self) -> None:
        """Give back the counts of pins that died (their weak references' callbacks queued them)."""
        with self._lock:
            self._collect_locked()

    def _collect_locked(self) -> None:
        dead, pins, held = self._dead, self._pins, self._held
        while dead:
            ref = dead[-1]
            if ref in pins:  # as in release, inline: no call between unregistering and counting
                cdata = pins[ref]
                del pins[ref]
                entry = held[cdata]
                entry[0] -= 1
                if not entry[0]:
                    del held[cdata]
                    self._resident -= entry[1]
                    self._free_weak_ref(entry[2])
            del dead[-1]

    def holds(self, storage: torch.UntypedStorage) -> bool:
        if self._dead:
            self.collect()
        return storage._cdata in self._held

    def count(self, cdata: int) -> Optional[Tuple[int, int]]:
        """(counts, bytes) held on the storage at ``cdata``, or None when it is not held."""
        if self._dead:
            self.collect()
        entry = self._held.get(cdata)
        return None if entry is None else (entry[0], entry[1])

    def reset_peak(self) -> None:
        self.peak = self.resident


_THREAD = threading.local()


def _drain_graph() -> Tuple[torch.Tensor, torch.Tensor]:
    """This thread's drain graph (a leaf and a clone of it), made at its first call."""
    graph = getattr(_THREAD, "drain", None)
    if graph is None:
        with torch.enable_grad(), torch.autograd.graph.disable_saved_tensors_hooks("bagualu2: drain graph"):
            leaf = torch.zeros((), requires_grad=True)
            graph = _THREAD.drain = (leaf, leaf.clone())  # clone saves nothing
    return graph


def _drain_failed_backward() -> bool:
    """Free what a failed backward pass on this thread left queued; whether it ran.

    When a backward pass on the cpu raises (an interrupt, an error in a hook), torch leaves the
    tasks it had queued in the calling thread's ready queue, each holding its node and so the
    saved activations of the graph below it, and a later backward pass on that thread leaves
    them there too: it stops once its own graph is done, and the queue serves nodes made later
    first. A backward pass through a graph made before them (``_drain_graph``, made before the
    thread's first frame) ends only after the queue has served them, and it drops each one whose
    pass is gone. It costs a backward pass of one node (tens of microseconds), so it runs only
    where something is still held between frames; never inside a backward pass."""
    if torch._C._current_graph_task_id() != -1 or torch.is_inference_mode_enabled():
        return False
    leaf, out = _drain_graph()
    torch.autograd.grad(out, leaf, retain_graph=True)
    return True


class _Pin:
    """Holds one ledger count on a storage for as long as this object lives (or until
    ``drop``). No finalizer: the ledger notices its death (``ResidencyLedger``'s note)."""

    __slots__ = ("_ledger", "_ref", "__weakref__")

    def __init__(self, ledger: ResidencyLedger, storage: torch.UntypedStorage) -> None:
        self._ledger = ledger
        self._ref: Optional["weakref.ref[_Pin]"] = None
        ledger.acquire(storage, self)

    def drop(self) -> None:
        ref = self._ref
        if ref is not None:
            self._ref = None
            self._ledger.release(ref)


@dataclass
class FrameStats:
    """What one frame (micro-batch forward) did with its saved activations."""

    packed: int = 0
    bytes_by_choice: Dict[str, int] = field(default_factory=lambda: {"keep": 0, "offload": 0, "recompute": 0})
    offloaded_storages: int = 0
    shared_bytes: int = 0       # re-saves of a storage already held: stored once
    regenerated_bytes: int = 0  # casts/copies of a stored activation, rebuilt from it
    fallbacks: List[str] = field(default_factory=list)
    violations: int = 0
    leaf_bytes: int = 0         # storages recipes pin as they are (inputs, storages written in place)
    outside_bytes: int = 0      # storages from outside the forward it holds, saved or pinned
    room_made_bytes: int = 0    # kept storages (of it or earlier frames) offloaded to make room
    peak_resident: int = 0      # ledger high-water mark while this frame's forward ran
    rerun_blocks: int = 0       # block calls run untraced, to be rerun whole in backward
    start_resident: int = 0


def checked_choices(choices: Mapping[str, Choice]) -> Dict[str, Choice]:
    """A copy of ``choices`` (operator key -> ``Choice``); TypeError naming any entry that is not
    a ``Choice``."""
    out = dict(choices)
    for key, choice in out.items():
        if not isinstance(choice, Choice):
            raise TypeError(f"plan entry {key!r}: {choice!r} is not a bagualu2.Choice")
    return out


@dataclass(frozen=True)
class Budget:
    """What one micro-batch's forward holds its saved activations to, in device bytes.

    ``limit`` is the budget: only crossing it is a violation. Releases aim lower, at the
    ``target``: ``reserve`` is left for the micro-batches that will stack on this rank before
    this one's backward (pipeline warm-up), and ``pin_headroom`` within the rest for what
    recipes pin and nothing can release (the forward's inputs, labels the loss reads at the
    end), which only those pins may use.
    """

    limit: int
    reserve: int = 0
    pin_headroom: int = 0

    def target(self, pins: bool = False) -> int:
        """Where releases aim: the limit less the reserve, less the pin headroom unless the
        bytes are ``pins`` it is left for."""
        return max(0, self.limit - self.reserve - (0 if pins else self.pin_headroom))


class Frame:
    """One micro-batch's forward through a provisioned module.

    ``choices`` maps operator keys to a ``Choice``; keys not in it get ``default``. The
    provisioner may update ``choices`` while the forward runs (at MoE gating): a storage's
    choice is taken when it is first saved.
    """

    def __init__(self, choices: Optional[Mapping[str, Choice]] = None, default: Choice = Choice.KEEP,
                 index: int = 0, strict: bool = False) -> None:
        self.choices: Dict[str, Choice] = checked_choices(choices or {})
        self.default = default
        # The choice for operators first saved after an outermost block has run, outside every
        # block (a transformer's final norm, output layer and loss); None: ``default`` there too.
        # The runtime enters it in ``choices`` as each such key is saved.
        self.after_blocks: Optional[Choice] = None
        self.past_blocks = False  # set by the runtime: an outermost block ended, none has begun
        # True: every outermost block recomputes all it saves, by rerunning the block in
        # backward (``BlockRerun``, as torch.utils.checkpoint does); the blocks run untraced, so
        # ``choices`` and ``keys_seen`` hold only the operators outside them. Blocks holding
        # running statistics (batch norm), which a rerun would update twice, are traced and
        # recomputed op by op (``default``) instead, and so are block calls with an argument
        # that is neither a tensor nor a plain value (a KV cache the forward appends to).
        self.rerun_blocks = False
        self._rerun: Optional[BlockRerun] = None  # the block running untraced now
        self.strict = strict  # a key in ``choices`` that names no op of the forward is an error
        # What the forward is held to; None: the runtime's ``budget_bytes``, all of it.
        self.budget: Optional[Budget] = None
        # False: no tracing, saved tensors are only counted and kept. For forwards that cannot
        # need a release (an ample budget): they then cost about what the saved-tensor hooks cost.
        self.traced = True
        self.index = index
        self.stats = FrameStats()
        self.keys_seen: Dict[str, int] = {}  # operator key -> storage bytes, first save
        self.profile = False  # time every op, and fill ``saved_profile`` when the forward ends
        # key -> (bytes, seconds of its own ops, recomputable, unsaved inputs rebuilt first)
        self.saved_profile: Dict[str, Tuple[int, float, bool, Tuple[str, ...]]] = {}
        self.unsaved_seconds: Dict[str, float] = {}  # those unsaved inputs' own seconds
        # Overlap scheduling (bagualu2.plan.overlap.OverlapDriver): ``on_saved(key)`` is called once
        # per operator key, right after the first activation of that key is packed (the op has
        # run); with ``scheduled`` set, backward issues no reloads of its own beyond the one it
        # is waiting for: the schedule issues them.
        self.on_saved: Optional[Callable[[str], None]] = None
        self.scheduled = False
        self._offloads: List["weakref.ref[_OffloadStore]"] = []
        self._prefetch_cursor = 1 << 62  # next store index backward may prefetch (lazy issue)
        self._prefetch_task = -1  # the backward pass the cursor belongs to
        self._prefetch_pending = 0  # bytes prefetched and not used yet
        # released by recompute; recorded only while an overlap driver observes frames
        self._recomputes: List[Tuple[str, "weakref.ref[StorageNode]", int]] = []
        self._anchors: List[StorageNode] = []
        # Untraced frames, while the forward runs: storages offloaded without a node
        # (address -> the storage's weak ref, its version, the store's weak ref)
        self._untraced_offloads: Dict[int, Tuple[StorageWeakRef, int, "weakref.ref[_OffloadStore]"]] = {}
        self._recomputed: Set[Tuple[int, int]] = set()  # (id(node), state) of storages released by recompute

    def choice(self, key: str) -> Choice:
        return self.choices.get(key, self.default)

    def offload_stores(self) -> List["_OffloadStore"]:
        """This frame's host copies still alive, in pack (forward) order."""
        return [s for s in (ref() for ref in self._offloads) if s is not None]

    def recompute_nodes(self) -> List[Tuple[str, StorageNode, int]]:
        """``(key, node, state)`` of the storages this frame released by recompute and that
        are still needed (their packed objects alive), in forward order."""
        return [(k, n, st) for k, n, st in ((k, ref(), st) for k, ref, st in self._recomputes) if n is not None]


class _OffloadStore:
    """One storage's copy in the host arena, shared by every saved view of it.

    Several saved tensors may read one storage (the per-expert slices of a permuted token
    buffer, the q/k/v thirds of a fused projection, casts regenerated from it), each unpacked by
    a different backward node. ``refs`` counts them; the first use in a backward pass reloads the
    storage, and the device copy is then held, charged to the ledger, until the last of them has
    been used in that pass: the storage crosses the bus once per pass, not once per reader. A
    held copy modified in place through a view handed out is not handed out again: the next use
    reloads the saved bytes.

    With ``in_place`` (a cpu storage, whose "device" is host memory) nothing is copied back:
    every use reads the bytes where they lie in the arena (``OffloadHandle.host_view``), as
    ``save_on_cpu`` hands back its host copy on cpu. All readers then share those bytes, as
    they would share the storage without offloading, and one changed in place is an error for
    the next reader, as autograd's own check makes it without hooks. The ledger charges the
    bytes exactly as a reloaded copy.

    A copy that fails after submission (the engine's ticket raises at ``done``/``wait``) is
    survived here: while it runs the store holds the device ``source`` itself (and its ledger
    count), so when ``settle`` finds it failed the store keeps that source for good (a recorded
    fallback: the offload became a keep) and serves every use from it in place, as with
    ``in_place``; the arena block goes back at once. Should the storage have been written in
    place since (its node's state moved on), its saved bytes are gone and a use raises instead
    of reading newer ones. A reload that fails raises, naming the activation.
    """

    __slots__ = ("engine", "handle", "device", "nbytes", "in_place", "alias", "alias_version", "pin",
                 "prefetched", "prefetch_pin", "frame", "index", "key", "refs", "task", "unpacked", "held",
                 "held_version", "held_pin", "copies", "source", "source_node", "source_state", "failed",
                 "__weakref__")

    def __init__(self, engine: Any, handle: Any, device: torch.device, nbytes: int,
                 pin: Optional[_Pin], frame: Frame, key: str, in_place: bool = False,
                 copies: Optional[List[Any]] = None, source: Optional[torch.Tensor] = None,
                 node: Optional[StorageNode] = None) -> None:
        self.engine = engine
        self.handle = handle
        self.device = device
        self.nbytes = nbytes
        self.in_place = in_place
        self.alias: Optional[torch.Tensor] = None  # with in_place: uint8 tensor over the block
        self.alias_version = 0
        self.key = key
        self.pin: Optional[_Pin] = pin  # device source held until the copy completes
        # With ``pin``: the source itself (uint8 over its storage), kept for good if the copy
        # fails; and its traced node's state then, which must not move on for it to be read.
        self.source = source if pin is not None else None
        self.source_node = weakref.ref(node) if node is not None else None
        self.source_state = node.state if node is not None else 0
        self.failed = False  # the copy failed: ``source`` serves every use (``_keep_source``)
        self.prefetched: Any = None
        self.prefetch_pin: Optional[_Pin] = None  # the prefetch's device buffer, until used
        self.refs = 0  # saved tensors that read this store at unpack
        self.task = -2  # the backward pass (graph task id) that ``unpacked`` counts for
        self.unpacked = 0
        self.held: Optional[torch.Tensor] = None  # uint8 tensor over the reloaded storage
        self.held_version = 0  # its version when it was made: any change means an in-place write
        self.held_pin: Optional[_Pin] = None
        self.frame = frame  # kept alive by its stores: backward prefetches from its list
        self.copies = copies  # the runtime's copy seconds, which releasing the block adds to
        self.index = len(frame._offloads)
        frame._offloads.append(weakref.ref(self))

    def settle(self, wait: bool = False) -> bool:
        """Drop the device source once the copy is done; True when it is. A copy that failed
        keeps the source instead (``_keep_source``): it is done with too."""
        if self.pin is None or self.failed:
            return True
        try:
            if wait:
                self.handle.wait()
            elif not self.handle.done():
                return False
        except _C.RuntimeError as e:  # the copy failed after it was submitted
            self._keep_source(e)
            return True
        self.pin.drop()
        self.pin = None
        self.source = None
        return True

    def _keep_source(self, error: Exception) -> None:
        """The offload copy failed: keep the device source (still pinned, so still charged) as
        the copy every use reads in place, give the arena block back, record the fallback."""
        if self.source is None:  # not reachable through _start_offload, which always passes it
            raise RuntimeError(f"the offload copy of activation {self.key} failed and its source "
                               f"was not kept: {error}") from error
        self.failed = True
        self.in_place = True
        self.alias = self.source
        self.alias_version = self.source._version
        self.frame.stats.fallbacks.append(f"{self.key}: offload copy failed ({error}); kept on {self.device}")
        if not self.handle.released:
            self.handle.release()

    def prefetch(self, ledger: ResidencyLedger) -> bool:
        """Start reloading into a new device buffer, charged to ``ledger`` until used; False
        when a prefetch is pending or the device copy is held already (or the reload could
        not be submitted: the use reloads then)."""
        if self.pin is not None:
            self.settle()  # an offload found failed is read in place: nothing to prefetch
        if self.in_place or self.prefetched is not None or self.held is not None:
            return False
        try:
            self.prefetched = self.engine.reload_async(self.handle, device=self.device)
        except _C.RuntimeError as e:
            self.frame.stats.fallbacks.append(f"{self.key}: prefetch failed ({e}); reloaded when used")
            return False
        self.prefetch_pin = _Pin(ledger, self.prefetched.destination.untyped_storage())
        self.frame._prefetch_pending += self.nbytes
        return True

    def take(self, ledger: ResidencyLedger, need: bool = True,
             room: Optional[Callable[[torch.UntypedStorage], bool]] = None) -> Optional[torch.UntypedStorage]:
        """One reader's use in the running backward pass: the device copy, held (and charged
        to ``ledger``) while more of the ``refs`` readers are due, unless ``room`` says holding
        it would cross the budget (each reader then gets a copy of its own). A reader that
        found what it needed elsewhere passes ``need=False``: it is counted, nothing is
        reloaded, and None is returned."""
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.unpacked = task, 0
        self.unpacked += 1
        if not need:
            if self.unpacked >= self.refs:
                self._release_hold()
            return None
        storage = self.storage()
        if self.unpacked >= self.refs:
            self._release_hold()
        elif self.held is None and (room is None or room(storage)):
            self.held = self.alias if self.in_place else (
                torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage))
            self.held_version = self.held._version
            self.held_pin = _Pin(ledger, storage)
        return storage

    def unpack(self, meta: ViewMeta, ledger: ResidencyLedger,
               room: Optional[Callable[[torch.UntypedStorage], bool]] = None) -> torch.Tensor:
        """A tensor with ``meta``'s geometry over this storage's device copy."""
        storage = self.take(ledger, room=room)
        held = self.alias if self.in_place else self.held
        if held is None or not held.numel():  # the pass's last (or only) reader of a copy
            return view_of(storage, meta)
        # A view of the held copy (or of the block): the tensors handed out share its version
        # counter.
        size, stride, offset, dtype = meta
        return held.view(dtype).as_strided(size, stride, offset)

    def _held(self) -> Optional[torch.Tensor]:
        if self.held is None or self.held._version == self.held_version:
            return self.held
        self._release_hold()  # changed in place through a view handed out: reload the saved bytes
        return None

    def _release_hold(self) -> None:
        self.held = None
        if self.held_pin is not None:
            self.held_pin.drop()
            self.held_pin = None

    def storage(self) -> torch.UntypedStorage:
        """The device copy: the held one, else the pending prefetch, else a reload now (the
        source kept in place where the offload copy failed); a reload that fails raises,
        naming the activation."""
        held = self._held()
        if held is not None:
            return held.untyped_storage()
        if self.pin is not None:
            self.settle()  # a copy found failed keeps its source: nothing to reload
        try:
            if self.prefetched is not None:
                prefetched, self.prefetched = self.prefetched, None
                self.prefetch_pin.drop()
                self.prefetch_pin = None
                self.frame._prefetch_pending -= self.nbytes
                buffer = prefetched.wait()
            elif self.in_place:
                buffer = self._in_place()
            else:
                buffer = self.engine.reload(self.handle, device=self.device)
        except _C.RuntimeError as e:
            # Issued while the offload ran, a reload fails with it: which of the two failed?
            if self.pin is not None:
                self.settle(wait=True)
            if not self.failed:
                raise RuntimeError(f"reloading offloaded activation {self.key} ({self.nbytes} bytes) "
                                   f"failed: {e}") from e
            buffer = self._in_place()  # the offload's: read its kept source
        return buffer.untyped_storage()

    def _in_place(self) -> torch.Tensor:
        if self.alias is None:
            self.alias = self.handle.host_view()
            self.alias_version = self.alias._version
        elif self.alias._version != self.alias_version:
            raise _modified_error(f"offloaded activation {self.key}", self.alias_version, self.alias._version)
        node = self.source_node() if self.failed and self.source_node is not None else None
        if node is not None and node.state != self.source_state:
            raise RuntimeError(f"the offload copy of activation {self.key} failed and its storage was "
                               f"written in place since (state {self.source_state} -> {node.state}): "
                               f"the saved bytes are lost")
        return self.alias

    def __del__(self) -> None:
        # Its pins give their counts back as they die with it, and its handle's arena block is
        # freed when the handle dies: an interrupt that cuts this short (at its first line even)
        # leaves nothing held.
        try:
            start = time.perf_counter()
            if self.prefetched is not None:
                self.frame._prefetch_pending -= self.nbytes
                try:
                    self.prefetched.wait()
                except _C.RuntimeError:  # a failed reload: it ended all the same
                    pass
            if not self.handle.released:  # a cycle's collector may have finalized the handle first
                self.handle.release()
            if self.copies is not None:  # part of what the offload cost the thread
                self.copies[0] += time.perf_counter() - start
        except Exception:  # a finalizer must not raise (interpreter teardown, a failed copy)
            pass


def _modified_error(what: str, saved: int, now: int) -> RuntimeError:
    # Autograd's own version check does not run for tensors packed by hooks, so do it here.
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} was saved at version {saved} and is now at version {now}"
    )


class _Kept:
    """A saved tensor held as it is; ``moved`` once offloaded later to make room (``_make_room``)."""

    __slots__ = ("tensor", "pin", "version", "node", "state", "moved", "__weakref__")

    def __init__(self, tensor: torch.Tensor, pin: Optional[_Pin], node: Optional[StorageNode] = None) -> None:
        self.tensor: Optional[torch.Tensor] = tensor
        self.pin = pin
        self.version = tensor._version
        self.node = node  # the traced storage it holds, and that storage's state at the save
        self.state = node.state if node is not None else 0
        self.moved: Optional[_Offloaded] = None


def _uncounted(t: torch.Tensor) -> _Kept:
    """``t`` held as it is and charged to nothing: a parameter (or a view of one), or a tensor
    the ledger cannot count. An op's saved output is detached (holding its grad_fn would be a
    reference cycle)."""
    return _Kept(t if t.grad_fn is None else t.detach(), None)


class _Offloaded:
    """A saved view of an offloaded storage. In-place changes after the save are seen through
    the storage's node (``state``: its mutations) or, in untraced frames, through the saved
    tensor while it lives (``state``: its version)."""

    __slots__ = ("store", "meta", "node", "state", "watch")

    def __init__(self, store: _OffloadStore, meta: ViewMeta, node: Optional[StorageNode], state: int,
                 watch: Optional[torch.Tensor] = None) -> None:
        self.store = store
        store.refs += 1
        self.meta = meta
        self.node = weakref.ref(node) if node is not None else None
        self.watch = weakref.ref(watch) if watch is not None else None
        self.state = state


class _Recomputed:
    __slots__ = ("node", "state", "meta", "source")

    def __init__(self, node: StorageNode, state: int, meta: ViewMeta,
                 source: Optional[_OffloadStore] = None) -> None:
        self.node = node
        self.state = state
        self.meta = meta
        self.source = source  # the offloaded storage a regenerated cast is rebuilt from
        if source is not None:
            source.refs += 1


class _Attachment:
    """One module tree's hooks (``ActivationRuntime.attach``): installed while traced frames
    run, and ``remove()`` takes them off for good."""

    def __init__(self, runtime: "ActivationRuntime",
                 hooks: List[Tuple[torch.nn.Module, AttachedHook, AttachedHook]]) -> None:
        self._runtime = runtime
        self._hooks = hooks
        self._handles: List[Any] = []

    def install(self, on: bool) -> None:
        if on and not self._handles:
            for module, enter, leave in self._hooks:
                self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
                self._handles.append(module.register_forward_hook(leave))
        elif not on:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def remove(self) -> None:
        self.install(False)
        if self in self._runtime._attachments:
            self._runtime._attachments.remove(self)


class ActivationRuntime:
    """Applies per-operator KEEP / OFFLOAD / RECOMPUTE choices to saved activations.

    Args:
        engine: a ``bagualu2.CopyEngine`` for OFFLOAD, or None (OFFLOAD then falls back).
        min_bytes: storages smaller than this are kept, unless keeping one would cross the budget.
        budget_bytes: the activation budget the ledger is held to, or None for no budget; a
            frame with a ``Budget`` of its own is held to that while its forward runs.
        enforce_budget: release (offload, else recompute) a storage that would exceed the budget
            instead of keeping it. Static baselines turn this off to show what they would do.
        on_exceed: called with (resident, budget, key) when the budget is exceeded anyway; it may
            raise (``on_exceed="raise"`` in ``bagualu2.enable``).
        prefetch_bytes: how far ahead of use backward reloads offloaded storages.
        reload_in_place: backward reads an offloaded cpu storage where it lies in the host arena
            instead of copying it back (see ``_OffloadStore``); False copies it back as on a
            device (the way to exercise reloads and prefetches on a cpu-only machine).
    """

    def __init__(self, engine: Any = None, *, min_bytes: int = 0, budget_bytes: Optional[int] = None,
                 enforce_budget: bool = True,
                 on_exceed: Optional[Callable[[int, int, str], None]] = None,
                 prefetch_bytes: int = 64 << 20, reload_in_place: bool = True) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes={min_bytes} must be >= 0")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be >= 0 or None")
        self.engine = engine
        self.min_bytes = min_bytes
        self.budget_bytes = budget_bytes
        self.enforce_budget = enforce_budget
        self.on_exceed = on_exceed
        self.prefetch_bytes = prefetch_bytes
        self.reload_in_place = reload_in_place
        self.ledger = ResidencyLedger()
        self.mode = TracingMode(self._pin_leaf, self._charge)
        self._params: Set[int] = set()
        self._frame: Optional[Frame] = None
        self._inflight: Deque["weakref.ref[_OffloadStore]"] = collections.deque()
        # Overlap scheduling: called with each frame as it starts, and with the operator key
        # of every released activation backward unpacks (bagualu2.plan.overlap.OverlapDriver).
        self.frame_observer: Optional[Callable[[Frame], None]] = None
        self.unpack_observer: Optional[Callable[[str], None]] = None
        # Called as each backward pass that unpacks anything packed here ends (autograd's
        # final callback of the pass, on the thread that ran it).
        self.backward_observer: Optional[Callable[[], None]] = None
        # key -> [seconds, micro-batches, id of the last one's recompute cache] of backward rebuilds
        self._replays: Dict[str, List[Any]] = {}
        self._op_replays: Dict[str, List[float]] = {}  # key -> its op's replay times (Replayer)
        self._copies: List[Any] = [0.0, 0, 0]  # caller seconds, offloads, bytes (take_copy_times)
        self.backward_passes = 0  # backward passes that unpacked anything packed here
        self._last_task = -1
        # Storages kept under a budget, by storage (cdata -> (frame index, its _Kept saves)):
        # what _make_room may offload when something nothing else can release needs room.
        self._kept: Dict[int, Tuple[int, List["weakref.ref[_Kept]"]]] = {}
        self._kept_limit = 1024  # registry size at which entries of dead saves are dropped
        self._told_unrestorable = False  # a block call that could not be rerun was warned of
        self._traced_blocks: Set[str] = set()  # outermost blocks seen traced: whether they issue collectives is known
        self._attachments: List["_Attachment"] = []  # module trees attached (``attach``)
        # The thread and the Python frame of the ``with frame(...)`` running now: a frame whose
        # forward is no longer on that thread's stack was left by an interrupt (``_frame_left``).
        self._frame_owner: Optional[Tuple[int, Any]] = None

    # -- frames -----------------------------------------------------------------------------
    @property
    def active_frame(self) -> Optional[Frame]:
        return self._frame

    def set_parameters(self, tensors: Iterator[torch.Tensor]) -> None:
        """Storages that are not activations (parameters, buffers): never offloaded or counted."""
        self._params = {t.untyped_storage()._cdata for t in tensors}

    def frame(self, frame: Frame) -> ContextManager[Frame]:
        """Trace and provision one micro-batch's forward (``with runtime.frame(f): ...``).

        A frame that an interrupt left open (the interrupt landed in its cleanup, or in the
        ``with`` statement's exit before the cleanup began) is closed by the next ``frame`` or
        ``collect``: one whose ``with`` statement is no longer running on its thread. A frame
        still running on another thread is an error, as is one started inside another."""
        holder: List[Any] = []
        scope = self._frame_scope(frame, holder)
        holder.append(weakref.ref(scope.gen))  # type: ignore[attr-defined]
        return scope

    @contextlib.contextmanager
    def _frame_scope(self, frame: Frame, holder: List[Any]) -> Iterator[Frame]:
        if self._frame is not None and not self._close_left_frame():
            thread = self._frame_owner[0] if self._frame_owner is not None else None
            if thread is not None and thread != threading.get_ident():
                raise RuntimeError(
                    "bagualu2: a provisioned forward of this model is running on another thread; a "
                    "provisioned model runs one forward at a time (give each thread its own model)")
            raise RuntimeError(
                "bagualu2: a provisioned forward started inside another one; enable bagualu2 on "
                "the outer module only"
            )
        self._clear_left_scopes()
        self.collect()
        _drain_graph()  # made before this frame's graph: see _drain_failed_backward
        self.mode.reset()
        self.mode.profile = frame.profile
        self._module_hooks(frame.traced)
        # The caller of ``with``: this generator's caller is contextlib's __enter__.
        self._frame_owner = (threading.get_ident(), sys._getframe(2), holder[0])
        self._frame = frame
        if self.frame_observer is not None:
            self.frame_observer(frame)
        frame.stats.start_resident = self.ledger.resident
        self.ledger.reset_peak()
        tracing = self.mode if frame.traced else contextlib.nullcontext()
        grad = torch.is_grad_enabled()
        try:
            pack = self._pack if frame.traced else self._pack_calm
            with tracing, torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                try:
                    yield frame
                finally:
                    if frame._rerun is not None:  # the block raised: its forward hook did not run
                        self._close_rerun(frame)
            if frame.strict:
                self._check_keys(frame)
        finally:
            # The caller's grad mode, whatever an interrupt stopped inside the forward (the
            # entry of a gate's ``torch.no_grad()``, after it switched grad off) left.
            torch.set_grad_enabled(grad)
            self._close_frame(frame)

    def _clear_left_scopes(self) -> None:
        """Undo what an interrupt inside the entry of one of bagualu2's ``with`` statements left
        on this thread: the entry had pushed its state, the ``with`` never owned it, so no exit
        popped it. Called where a frame starts and ends, where none of them is in use."""
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        while hooks is not None and getattr(hooks[0], "__self__", None) is self:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        modes = _get_current_dispatch_mode_stack()
        if modes and modes[-1] is self.mode:
            try:
                self.mode.__exit__(None, None, None)
            except IndexError:  # its own exit was cut short after it popped its flags
                _pop_mode()

    def _close_frame(self, frame: Frame) -> None:
        """End ``frame``: the frame's own cleanup, and the repair of one an interrupt left open.
        Every step may run again (an interrupt may stop this one too): the frame stays the
        running one, for ``_close_left_frame`` to close again, until the last step."""
        frame.stats.peak_resident = max(frame.stats.peak_resident, self.ledger.peak)
        if frame.profile and not frame.saved_profile:
            frame.saved_profile, frame.unsaved_seconds = self._profile(frame)
        self.settle()
        for node in frame._anchors:
            if node.offloaded:
                node.anchor = None
        frame._anchors = []
        frame._untraced_offloads = {}
        frame._recomputed = set()
        frame._rerun = None
        self.mode.reset()  # the frame's nodes, and the anchors they pin
        self._clear_left_scopes()
        self._frame_owner = None
        self._frame = None

    def _close_left_frame(self) -> bool:
        """Close the running frame if an interrupt left it open: its ``with`` statement's frame
        is off its thread's stack, or the scope's generator is done (its cleanup began). True
        when it was so (or no frame runs)."""
        frame, owner = self._frame, self._frame_owner
        if frame is None:
            return True
        if owner is not None:
            thread, caller, gen_ref = owner
            gen = gen_ref()
            running = gen is not None and gen.gi_frame is not None and not gen.gi_running
            if running:
                top = sys._getframe(1) if thread == threading.get_ident() else sys._current_frames().get(thread)
                while top is not None and top is not caller:
                    top = top.f_back
                running = top is not None
            if running:
                return False
        self._frame_owner = None
        # What the interrupted exit did not undo: the tracing mode and the saved-tensor hooks
        # (this thread's stacks) and the frame's module hooks.
        if self.mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack():
            while torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
                if torch.utils._python_dispatch._pop_mode() is self.mode:
                    break
        top_hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top_hooks is not None and getattr(top_hooks[1], "__self__", None) is self:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._close_frame(frame)
        return True

    def attach(self, root: torch.nn.Module) -> List[Any]:
        """Name operators by module path and anchor block inputs, through module hooks that
        traced frames install.

        A *block* is a module held in a ``ModuleList`` (transformer layers, experts). Its first
        tensor input is anchored: held for the frame's recipes so a recompute chain never reaches
        back past the block, as with per-block checkpointing. An anchor whose storage is
        offloaded is dropped when the forward ends. The inputs of outermost blocks (layers, not
        the experts inside them) also bound the recompute cache (``RecomputeCache``), and their
        ends tell which saves come after the blocks (``Frame.after_blocks``); in a frame with
        ``rerun_blocks`` they run untraced, to be rerun in backward.

        The hooks are on ``root``'s modules only from a traced frame's start to the next
        untraced frame's: an untraced forward calls its modules with no hooks of bagualu2's, on
        torch's fast path (a module with a hook takes the slow one, a cost a calm step, which
        needs none of them, should not pay). Each
        module's pre-hook is installed ahead of the module's other pre-hooks and its forward
        hook behind its other forward hooks, so the module's path names what its own hooks run,
        and a rerun block is called with the arguments its call had before any pre-hook changed
        them. Returns handles whose ``remove()`` detaches.
        """
        blocks = {id(child) for m in root.modules() if isinstance(m, torch.nn.ModuleList) for child in m}
        block_paths = [name for name, m in root.named_modules() if id(m) in blocks]
        hooks: List[Tuple[torch.nn.Module, AttachedHook, AttachedHook]] = []
        for name, module in root.named_modules():
            if module is root:
                continue
            block = 0
            if id(module) in blocks:
                nested = any(name.startswith(p + ".") for p in block_paths)
                block = 1 if nested else 2
            rerunnable = block == 2 and not any(
                isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats for m in module.modules())

            def enter(mod: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], _name: str = name,
                      _block: int = block, _rerunnable: bool = rerunnable) -> None:
                frame = self._frame
                if frame is None or not frame.traced or self.mode.suspended or frame._rerun is not None:
                    return
                if _block == 2:
                    frame.past_blocks = False
                    if _rerunnable and frame.rerun_blocks and self._open_rerun(frame, mod, _name, args, kwargs):
                        return
                    self._traced_blocks.add(_name)
                self.mode.push_module(_name)
                if _block and args and isinstance(args[0], torch.Tensor):
                    self._anchor(args[0], outermost=_block == 2)

            def leave(mod: torch.nn.Module, args: tuple, out: Any, _block: int = block) -> None:
                frame = self._frame
                if frame is None or not frame.traced or self.mode.suspended:
                    return
                if frame._rerun is not None:
                    if frame._rerun.module is mod:
                        self._close_rerun(frame)
                        frame.past_blocks = True
                    return
                self.mode.pop_module()
                if _block == 2:
                    frame.past_blocks = True

            hooks.append((module, AttachedHook(enter), AttachedHook(leave)))
        attachment = _Attachment(self, hooks)
        self._attachments.append(attachment)
        return [attachment]

    def _module_hooks(self, on: bool) -> None:
        """Install (``on``) or remove every attachment's module hooks."""
        for attachment in self._attachments:
            attachment.install(on)

    def _open_rerun(self, frame: Frame, module: torch.nn.Module, name: str, args: tuple,
                    kwargs: Dict[str, Any]) -> bool:
        """Run this block call untraced, to be rerun whole in backward; False (trace it) when
        another dispatch mode was entered inside the frame's (that one must see the ops), when
        the block issues a collective or writes a storage from outside the forward, or has not
        yet been traced to tell (a rerun in backward would do it again: a collective on one rank
        only, ranks out of step or waiting for one another; a counter counted twice), or when an
        argument is an object the forward may change (``unrestorable``; told once)."""
        if torch.utils._python_dispatch._get_current_dispatch_mode() is not self.mode:
            return False
        flat, spec = tree_flatten((args, kwargs))
        other = unrestorable(flat)
        if other is not None:
            why = (f"{name} is called with a {type(other).__name__}, which its forward may change: traced "
                   f"and recomputed op by op, not rerun")
            frame.stats.fallbacks.append(why)
            if not self._told_unrestorable:
                self._told_unrestorable = True
                warnings.warn(f"bagualu2: {why} (slower; a Hugging Face model passes its KV cache: set "
                              f"model.config.use_cache = False for training)", stacklevel=2)
            return False
        if name not in self._traced_blocks or name in self.mode.side_effect_modules:
            return False
        self.mode.__exit__(None, None, None)  # off torch's dispatch stack: the block's ops skip Python
        frame._rerun = BlockRerun(module, name, flat, spec, self._pin_leaf, lambda s: _Pin(self.ledger, s))
        frame.stats.rerun_blocks += 1
        return True

    def _close_rerun(self, frame: Frame) -> None:
        record, frame._rerun = frame._rerun, None
        frame.stats.bytes_by_choice["recompute"] += sum(record.storages.values())
        record.storages.clear()  # counted: the graph need not hold the addresses
        self.mode.__enter__()

    def _anchor(self, t: torch.Tensor, outermost: bool) -> None:
        node = self.mode.nodes.get(t.untyped_storage()._cdata)
        if node is not None and node.anchor is None and self._frame is not None:
            if self._over_budget(t.untyped_storage()):
                return  # no room: recompute chains reach further back instead
            with self.untraced():
                held = t.detach()  # holding t's autograd graph would be a reference cycle
            node.anchor = (held, node.state, _Pin(self.ledger, t.untyped_storage()))
            self._frame._anchors.append(node)
            anchors = node.cache.anchors
            if outermost and (not anchors or anchors[-1] < node.position):
                anchors.append(node.position)

    def _check_keys(self, frame: Frame) -> None:
        known = {node.key for node in self.mode.nodes.values()}
        unknown = sorted(set(frame.choices) - known)
        if unknown:
            import difflib

            hints = [difflib.get_close_matches(k, known, n=1) for k in unknown[:3]]
            raise ValueError(
                f"the plan names {len(unknown)} operator key(s) that no op of this forward has, e.g. "
                + ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in zip(unknown, hints))
                + "; keys look like '<module path>:<aten op>:<occurrence>', see Frame.keys_seen"
            )

    def _profile(self, frame: Frame) -> Tuple[Dict[str, Tuple[int, float, bool, Tuple[str, ...], Tuple[str, ...]]],
                                               Dict[str, float]]:
        """Per saved key: bytes, seconds of its own ops, whether it can be rebuilt, the
        storages nothing saved (freed after the forward) that rebuilding it must rebuild first,
        up to saved storages and block inputs, and the saved storages that rebuild reads; and
        the unsaved storages' own seconds."""
        by_key = {node.key: node for node in self.mode.nodes.values()}
        saved = frame.keys_seen
        unsaved: Dict[str, float] = {}
        chains: Dict[int, Tuple[str, ...]] = {}

        def own_seconds(node: StorageNode) -> float:
            return node.creator.seconds + sum(m.seconds for m in node.mutations)

        def chain(root: StorageNode) -> Tuple[str, ...]:
            # Depth-first, inputs before the storages that read them, without recursion: a
            # chain of unsaved storages can be as long as the forward.
            inputs: Dict[int, List[StorageNode]] = {}
            stack: List[StorageNode] = [root]
            while stack:
                node = stack[-1]
                if id(node) in chains:
                    stack.pop()
                    continue
                if id(node) not in inputs:
                    inputs[id(node)] = [n for step in (node.creator,) + node.mutations for n in step_inputs(step)
                                        if n is not node and n.key not in saved and n.anchor is None]
                    stack.extend(n for n in inputs[id(node)] if id(n) not in chains)
                    continue
                stack.pop()
                keys: Dict[str, None] = {}
                for n in inputs[id(node)]:
                    unsaved[n.key] = own_seconds(n)
                    keys[n.key] = None
                    keys.update(dict.fromkeys(chains[id(n)]))
                chains[id(node)] = tuple(keys)
            return chains[id(root)]

        def reads(root: StorageNode, unsaved_inputs: Tuple[str, ...]) -> Tuple[str, ...]:
            keys: Dict[str, None] = {}
            for node in [root] + [by_key[k] for k in unsaved_inputs]:
                for step in (node.creator,) + node.mutations:
                    keys.update((n.key, None) for n in step_inputs(step) if n.key in saved and n is not root)
            return tuple(keys)

        out: Dict[str, Tuple[int, float, bool, Tuple[str, ...], Tuple[str, ...]]] = {}
        for key, nbytes in saved.items():
            node = by_key.get(key)
            if node is not None:
                inputs = chain(node)
                out[key] = (nbytes, own_seconds(node), node.rebuildable(node.state), inputs, reads(node, inputs))
        return out, unsaved

    @contextlib.contextmanager
    def untraced(self) -> Iterator[None]:
        """Run bagualu2's own bookkeeping ops (gating callbacks) without tracing them."""
        self.mode.suspended += 1
        try:
            yield
        finally:
            self.mode.suspended -= 1

    def collect(self) -> None:
        """Give back what an interrupt left held: a frame it left open (``frame``), ledger
        counts of dead pins, the arena blocks of offload stores that died while their copies
        ran, and what a failed backward left queued. Idempotent, and resumable after an
        interrupt of its own: an entry goes only once what it held is given back."""
        if self._frame is not None:
            self._close_left_frame()
        self.ledger.collect()
        if self.engine is not None:
            self.engine.prune()  # tickets of stores that died, kept while their copies ran
        # Something still held outside a frame may be what a failed backward left queued.
        if self._frame is None and (self.ledger.resident or self._arena_in_use()) and _drain_failed_backward():
            self.ledger.collect()
            if self.engine is not None:
                self.engine.prune()

    def _arena_in_use(self) -> int:
        return self.engine.arena.stats()["in_use"] if self.engine is not None else 0

    @property
    def inflight_bytes(self) -> int:
        """Device bytes held only until their offload copies complete."""
        return sum(s.nbytes for s in (ref() for ref in self._inflight) if s is not None and s.pin is not None)

    def settle(self, wait: bool = False) -> None:
        """Release device sources of completed offloads (all of them with ``wait``). Offloads
        complete in the order they started (one copy stream), so this stops at the first one
        still copying: a pack while many are in flight costs one query, not one per copy."""
        inflight = self._inflight
        while inflight:
            store = inflight[0]()
            if store is not None and not store.settle(wait):
                return
            inflight.popleft()

    # -- parameters and leaves --------------------------------------------------------------
    def _is_parameter(self, t: torch.Tensor) -> bool:
        # A plain Tensor is never a Parameter: it skips the Parameter metaclass's isinstance (in
        # Python, and called for every save).
        if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
            return True
        # A view of a parameter the model did not hold when ``set_parameters`` ran (FSDP2's
        # unsharded parameters, registered around each module's forward and freed after it).
        base = t._base
        if base is not None and type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter):
            return True
        return is_plain(t) and t.untyped_storage()._cdata in self._params

    def _room(self, storage: torch.UntypedStorage) -> bool:
        """Whether backward may hold ``storage`` for more readers within the budget."""
        return not self._over_budget(storage, pins=True)

    def _charge(self, storage: torch.UntypedStorage) -> Optional[_Pin]:
        """Count a storage backward rebuilt and would hold for more readers (the recompute
        cache's), for the pin's life; None, and it is not held, where that crosses the budget."""
        return _Pin(self.ledger, storage) if self._room(storage) else None

    def _pin_leaf(self, t: torch.Tensor) -> Optional[_Pin]:
        if not is_plain(t) or self._is_parameter(t):
            return None
        storage = t.untyped_storage()
        frame = self._frame
        if frame is None or self.ledger.holds(storage):
            return _Pin(self.ledger, storage)
        frame.stats.leaf_bytes += storage.nbytes()
        if storage._cdata not in self.mode.nodes:
            frame.stats.outside_bytes += storage.nbytes()
        if self._crosses(storage.nbytes(), pins=True) and not self._make_room(frame, storage.nbytes()):
            self._count_violation(frame, storage.nbytes(), f"a tensor of shape {tuple(t.shape)} a recipe holds")
        return _Pin(self.ledger, storage)

    # -- pack -------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        frame = self._frame
        if frame is None:
            return t
        if frame._rerun is not None:
            frame.stats.packed += 1
            return frame._rerun.save(t, counted=is_plain(t) and not self._is_parameter(t))
        if self._is_parameter(t):
            return _uncounted(t)
        self.mode.suspended += 1  # the runtime's own ops are not part of the model
        try:
            # ... and on a plain tensor they skip Python dispatch altogether: through the mode,
            # even suspended, each op (a detach, an offload's byte view) pays a Python call.
            # A subclass's ops keep their own dispatch.
            with torch._C._DisableTorchDispatch() if is_plain(t) else contextlib.nullcontext():
                seen = len(frame.keys_seen)
                packed = self._pack_in(frame, t)
                if frame.on_saved is not None and len(frame.keys_seen) > seen:
                    frame.on_saved(next(reversed(frame.keys_seen)))  # _pack_in adds at most one key
            return packed
        finally:
            self.mode.suspended -= 1

    def _pack_calm(self, t: torch.Tensor) -> Any:
        """The pack hook of an untraced frame. Its common case, a plain tensor that fits the
        budget, is counted and kept here, with nothing else to ask (calm micro-batches save
        about a hundred tensors each on the reference model, and this is most of what
        provisioning them costs), and so is a parameter (or a view of one: held, never counted);
        anything else takes the full way (``_pack``): a subclass, another dispatch mode on the
        stack, offloads in flight or made by this frame, a save that would cross the budget."""
        frame = self._frame
        if (frame is None or self._inflight or frame._untraced_offloads
                or torch._C._len_torch_dispatch_stack() or not is_plain(t)):
            return self._pack(t)
        storage = t.untyped_storage()
        base = t._base
        if (storage._cdata in self._params or type(t) is not torch.Tensor
                or (base is not None and type(base) is not torch.Tensor)):  # a parameter, or a view of one
            if self._is_parameter(t):
                return _uncounted(t)
            return self._pack(t)
        if self._over_budget(storage):
            return self._pack(t)
        frame.stats.packed += 1
        return self._keep(frame, t, storage)

    def _pack_in(self, frame: Frame, t: torch.Tensor) -> Any:
        stats = frame.stats
        stats.packed += 1
        if self._inflight:  # the offloads' share of the thread's time
            start = time.perf_counter()
            self.settle()
            self._copies[0] += time.perf_counter() - start
        if not is_plain(t):
            stats.fallbacks.append(f"kept a {type(t).__name__} with layout {t.layout}: not a plain strided "
                                   f"tensor, so it is neither counted nor released")
            return _uncounted(t)
        storage = t.untyped_storage()
        if not frame.traced:
            return self._pack_untraced(frame, t, storage)
        node = self.mode.nodes.get(storage._cdata)
        if node is None:
            # From outside the traced forward: no recipe, and not this frame's to release. It is
            # what the pin headroom is left for, so only the target itself bounds it.
            if not self.ledger.holds(storage):
                stats.outside_bytes += storage.nbytes()
            if self._over_budget(storage, pins=True):
                self.settle(wait=True)
                if self._over_budget(storage, pins=True):
                    return self._violate(frame, t, f"a saved input of shape {tuple(t.shape)}")
            return self._keep(frame, t)
        nbytes = node.nbytes
        frame.keys_seen.setdefault(node.key, nbytes)
        if nbytes < self.min_bytes and not self._over_budget(storage):
            return self._keep(frame, t)
        state = node.state
        meta = view_meta(t)
        store = node.offloaded.get(state)
        if store is not None:
            stats.shared_bytes += nbytes
            return _Offloaded(store, meta, node, state)
        regenerable, source = self._regeneration_source(node, state)
        if regenerable:
            stats.regenerated_bytes += nbytes
            self._add_reader(node, state)
            return _Recomputed(node, state, meta, source)
        if frame.past_blocks and frame.after_blocks is not None:
            frame.choices.setdefault(node.key, frame.after_blocks)
        choice = frame.choice(node.key)
        if choice == Choice.KEEP and self._over_budget(storage):
            self.settle(wait=True)
            if self._over_budget(storage):
                if self.enforce_budget:
                    choice = Choice.OFFLOAD if self.engine is not None else Choice.RECOMPUTE
                    stats.fallbacks.append(f"{node.key}: keep -> {choice.name.lower()} (budget)")
                else:
                    return self._violate(frame, t, node.key)
        rebuildable = node.rebuildable(state)
        why_not = node.why_not
        if rebuildable and not self.mode.rebuild_safe(node):
            rebuildable = False
            why_not = (f"its rebuild reads storages that {', '.join(sorted(node.owners))} filled and frees after "
                       f"its forward (sharded parameters)")
        if choice == Choice.RECOMPUTE:
            if rebuildable:
                return self._recompute(frame, node, state, meta)
            stats.fallbacks.append(f"{node.key}: recompute -> offload ({why_not})")
            choice = Choice.OFFLOAD
        if choice == Choice.OFFLOAD:
            packed = self._offload(frame, node, storage, state, meta)
            if packed is not None:
                return packed
            if rebuildable:
                stats.fallbacks.append(f"{node.key}: offload -> recompute (arena full or no engine)")
                return self._recompute(frame, node, state, meta)
            stats.fallbacks.append(f"{node.key}: offload -> keep (arena full or no engine; not recomputable)")
        if self._over_budget(storage):
            return self._violate(frame, t, node.key)
        return self._keep(frame, t)

    def _pack_untraced(self, frame: Frame, t: torch.Tensor, storage: torch.UntypedStorage) -> Any:
        """Keep, unless that would cross an enforced budget: then offload (no recipe exists to
        recompute from). A storage offloaded earlier in the frame, unchanged, is shared."""
        found = frame._untraced_offloads.get(storage._cdata) if frame._untraced_offloads else None
        store = found[2]() if found is not None and not found[0].expired() and found[1] == t._version else None
        if store is not None:
            frame.stats.shared_bytes += storage.nbytes()
            return _Offloaded(store, view_meta(t), None, t._version, t)
        if not self._over_budget(storage):
            return self._keep(frame, t)
        self.settle(wait=True)
        if not self._over_budget(storage):
            return self._keep(frame, t)
        store = self._start_offload(frame, storage, "untraced") if self.enforce_budget else None
        if store is None:
            return self._violate(frame, t, f"a saved tensor of shape {tuple(t.shape)} (untraced forward)")
        frame.stats.fallbacks.append(f"untraced forward over budget: offloaded {storage.nbytes()} bytes")
        frame._untraced_offloads[storage._cdata] = (StorageWeakRef(storage), t._version, weakref.ref(store))
        return _Offloaded(store, view_meta(t), None, t._version, t)

    def _recompute(self, frame: Frame, node: StorageNode, state: int, meta: ViewMeta) -> "_Recomputed":
        if (id(node), state) in frame._recomputed:  # another saved view of a released storage
            frame.stats.shared_bytes += node.nbytes
        else:
            frame._recomputed.add((id(node), state))
            frame.stats.bytes_by_choice["recompute"] += node.nbytes
            if self.frame_observer is not None:
                frame._recomputes.append((node.key, weakref.ref(node), state))
        self._add_reader(node, state)
        return _Recomputed(node, state, meta)

    def _add_reader(self, node: StorageNode, state: int) -> None:
        """Count a released saved view as a reader of its storage in the recompute cache; the
        first time, also the storage's rebuild as a reader of each storage its recipe reads,
        and so on through the inputs that nothing holds now (rebuilt with it)."""
        node.cache.add_reader(node.position, state)
        stack = [(node, state)]
        while stack:
            n, s = stack.pop()
            if not n.cache.release(n.position, s):
                continue  # counted already
            for ref in recipe_refs(n, s):
                ref.node.cache.add_reader(ref.node.position, ref.state)
                if self._available(ref.node, ref.state) is None:
                    stack.append((ref.node, ref.state))

    def _regeneration_source(self, node: StorageNode, state: int) -> Tuple[bool, Optional[_OffloadStore]]:
        """Whether the storage is a cast/copy (or chain of them) of a stored activation with
        nothing applied afterwards, and the offloaded store it is then rebuilt from (None when
        the source is kept)."""
        while node.creator.name in _CAST_OPS and not node.mutations and node.recomputable:
            source = node.creator.args[0] if node.creator.args else None
            src_node = getattr(source, "node", None)
            if not isinstance(src_node, StorageNode):
                return False, None
            store = src_node.offloaded.get(source.state)
            if store is not None:
                return True, store
            if self._kept_tensor(src_node, source.state) is not None:
                return True, None
            node = src_node
        return False, None

    def limit(self) -> Optional[int]:
        """The budget crossing which is a violation now: the running frame's, else
        ``budget_bytes``."""
        frame = self._frame
        return frame.budget.limit if frame is not None and frame.budget is not None else self.budget_bytes

    def target(self, pins: bool = False) -> Optional[int]:
        """Where releases aim now (``Budget.target`` of the running frame, else
        ``budget_bytes``); None without a budget."""
        frame = self._frame
        return frame.budget.target(pins) if frame is not None and frame.budget is not None else self.budget_bytes

    def would_cross(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more resident would cross where releases aim now, the room kept
        for pins included (what the overlap driver asks before a reload or early recompute)."""
        return self._crosses(nbytes, pins=True)

    def _over_budget(self, storage: torch.UntypedStorage, pins: bool = False) -> bool:
        """Whether holding ``storage`` crosses the target (``pins``: one of the storages the
        pin headroom is left for)."""
        return not self.ledger.holds(storage) and self._crosses(storage.nbytes(), pins)

    def _crosses(self, nbytes: int, pins: bool = False) -> bool:
        """Whether ``nbytes`` more resident crosses the target."""
        target = self.target(pins)
        return target is not None and self.ledger.resident + nbytes > target

    def _violate(self, frame: Frame, t: torch.Tensor, key: str) -> Any:
        """Keep ``t`` although that crosses the target, unless kept storages can make room; a
        violation where it crosses the limit."""
        nbytes = t.untyped_storage().nbytes()
        if not self._make_room(frame, nbytes):
            self._count_violation(frame, nbytes, key)
        return self._keep(frame, t)

    def _count_violation(self, frame: Frame, nbytes: int, key: str) -> None:
        limit = self.limit()
        if limit is not None and self.ledger.resident + nbytes > limit:
            frame.stats.violations += 1
            if self.on_exceed is not None:
                self.on_exceed(self.ledger.resident + nbytes, limit, key)

    def _keep(self, frame: Frame, t: torch.Tensor, storage: Optional[torch.UntypedStorage] = None) -> _Kept:
        if storage is None:
            storage = t.untyped_storage()
        if self.ledger.holds(storage):
            frame.stats.shared_bytes += storage.nbytes()
        else:
            frame.stats.bytes_by_choice["keep"] += storage.nbytes()
        if t.grad_fn is not None:
            t = t.detach()  # an op's saved output: holding its grad_fn would be a reference cycle
        node = self.mode.nodes.get(storage._cdata) if frame.traced else None
        kept = _Kept(t, _Pin(self.ledger, storage), node)
        if node is not None:
            node.kept[node.state] = (weakref.ref(t), t._version)
        if self.target() is not None and self.enforce_budget and self.engine is not None:
            entry = self._kept.get(storage._cdata)
            if entry is None:
                if len(self._kept) >= self._kept_limit:
                    self._live_kept()
                    self._kept_limit = max(1024, 2 * len(self._kept))
                entry = self._kept[storage._cdata] = (frame.index, [])
            entry[1].append(weakref.ref(kept))
        return kept

    def _movable(self) -> List[Tuple[int, int, int, List[_Kept]]]:
        """Kept storages ``_make_room`` may offload, in the order it would: (frame index,
        -bytes, cdata, the kept saves), those of earlier frames first, larger first."""
        if self.target() is None or not self.enforce_budget or self.engine is None:
            return []
        out = []
        for cdata, (index, saves) in self._live_kept().items():
            held = self.ledger.count(cdata)
            if held is not None and held[0] == len(saves) and all(k.tensor._version == k.version for k in saves):
                out.append((index, -held[1], cdata, saves))
        out.sort(key=lambda c: (c[0], c[1]))
        return out

    def movable_bytes(self) -> int:
        """Resident bytes that kept storages offloaded to make room would free."""
        return -sum(c[1] for c in self._movable())

    def _live_kept(self) -> Dict[int, Tuple[int, List[_Kept]]]:
        """The registry's storages with kept saves still alive and not moved (dropping the rest)."""
        out = {}
        for cdata, (index, refs) in list(self._kept.items()):
            saves = [k for k in (ref() for ref in refs) if k is not None and k.moved is None and k.pin is not None]
            if saves and self.ledger.count(cdata) is not None:
                out[cdata] = (index, saves)
            else:
                del self._kept[cdata]
        return out

    def _make_room(self, frame: Frame, need: int) -> bool:
        """Offload kept storages until ``need`` more bytes fit the budget: the last resort when
        something no plan releases (an input from outside the forward, what a recipe pins)
        would cross it, typically because more micro-batches are in flight than their plans
        foresaw. Storages of earlier micro-batches go first (their forwards no longer use
        them), larger first; a storage goes only when kept saves are all that hold it, unchanged
        since (only with a copy engine, and when the budget is enforced). True when ``need``
        fits, after in-flight offloads have settled."""
        budget = self.target(pins=True)
        if budget is None:
            return True
        self.settle(wait=True)
        for _, _, cdata, saves in self._movable():
            if self.ledger.resident + need <= budget:
                break
            store = self._start_offload(frame, saves[0].tensor.untyped_storage(), "kept")
            if store is None:
                break  # the arena is full
            store.settle(wait=True)  # at the budget: the copy cannot run beside the source
            for k in saves:
                t = k.tensor
                if k.node is None:  # an in-place change is seen while another tensor of it lives
                    k.moved = _Offloaded(store, view_meta(t), None, k.version, t)
                else:  # ... or through the traced storage; its recipes find it offloaded
                    k.moved = _Offloaded(store, view_meta(t), k.node, k.state)
                    k.node.kept.pop(k.state, None)
                    k.node.offloaded.setdefault(k.state, store)
                k.tensor = None
                k.pin.drop()
            del self._kept[cdata]
            frame.stats.room_made_bytes += store.nbytes
            frame.stats.fallbacks.append(f"kept {store.nbytes} bytes offloaded to make room")
        return self.ledger.resident + need <= budget

    def _offload(self, frame: Frame, node: StorageNode, storage: torch.UntypedStorage, state: int,
                 meta: ViewMeta) -> Optional[_Offloaded]:
        store = self._start_offload(frame, storage, node.key)
        if store is None:
            return None
        node.offloaded[state] = store
        return _Offloaded(store, meta, node, state)

    def _start_offload(self, frame: Frame, storage: torch.UntypedStorage, key: str) -> Optional[_OffloadStore]:
        """Copy ``storage`` into the arena; None when there is no engine or no room there."""
        if self.engine is None:
            return None
        start = time.perf_counter()
        try:
            source = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)
            try:
                handle = self.engine.offload(source)
            except RuntimeError as e:  # the copy could not be submitted: the caller falls back
                frame.stats.fallbacks.append(f"{key}: offload failed ({e})")
                return None
            if handle is None:
                return None
            pin: Optional[_Pin] = None
            if self._over_budget(storage):
                self.settle(wait=True)
            if self._over_budget(storage):
                try:
                    handle.wait()  # no room even while the copy runs: copy synchronously
                except _C.RuntimeError as e:  # the copy failed: the caller falls back
                    frame.stats.fallbacks.append(f"{key}: offload failed ({e})")
                    handle.release()
                    return None
            else:
                pin = _Pin(self.ledger, storage)
            nbytes = storage.nbytes()
            store = _OffloadStore(self.engine, handle, storage.device, nbytes, pin, frame, key,
                                  self.reload_in_place and storage.device.type == "cpu", self._copies,
                                  source, self.mode.nodes.get(storage._cdata))
            if pin is not None:
                self._inflight.append(weakref.ref(store))
            frame.stats.offloaded_storages += 1
            frame.stats.bytes_by_choice["offload"] += nbytes
            self._copies[1] += 1
            self._copies[2] += nbytes
            return store
        finally:
            self._copies[0] += time.perf_counter() - start

    # -- unpack -----------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task != self._last_task:
            self._last_task = task
            self.backward_passes += 1
            if self.backward_observer is not None and task >= 0:  # -1: not inside a backward pass
                torch.autograd.Variable._execution_engine.queue_callback(self.backward_observer)
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, RerunSaved):  # a frame's module hooks skip the rerun's module calls
            return packed.record.take(packed.index, self.untraced)
        if isinstance(packed, _Kept):
            if packed.moved is not None:
                return self._unpack(packed.moved)
            if packed.tensor._version != packed.version:
                raise _modified_error(f"a tensor of shape {tuple(packed.tensor.shape)}", packed.version,
                                      packed.tensor._version)
            return packed.tensor
        if isinstance(packed, _Offloaded):
            node = packed.node() if packed.node is not None else None
            if node is not None and node.state != packed.state:
                raise _modified_error(f"activation {node.key}", packed.state, node.state)
            watched = packed.watch() if packed.watch is not None else None
            if watched is not None and watched._version != packed.state:
                raise _modified_error(f"a tensor of shape {tuple(watched.shape)}", packed.state, watched._version)
            store = packed.store
            if self.unpack_observer is not None:
                self.unpack_observer(store.key)
            start = time.perf_counter()
            if not store.frame.scheduled and not store.in_place:
                self._prefetch_before(store.frame, store)
            out = store.unpack(packed.meta, self.ledger, self._room)
            self._copies[0] += time.perf_counter() - start
            return out
        node = packed.node
        if node.state != packed.state:
            raise _modified_error(f"activation {node.key}", packed.state, node.state)
        if self.unpack_observer is not None:
            self.unpack_observer(node.key)
        start = time.perf_counter()
        node.cache.bind_to_backward()
        node.cache.evict_after(node.position)
        source = packed.source
        taken: List[torch.UntypedStorage] = []

        def available(n: StorageNode, s: int) -> Optional[torch.UntypedStorage]:
            # a cast regenerated from an offloaded storage is one of that store's readers
            if source is None or n.offloaded.get(s) is not source:
                return self._available(n, s)
            if not taken:
                taken.append(source.take(self.ledger, room=self._room))
            return taken[0]

        replayer = Replayer(available, self._op_replays)
        out = view_of(replayer.storage(node, packed.state), packed.meta)
        if source is not None and not taken:
            source.take(self.ledger, need=False)
        node.cache.served(node.position, packed.state)
        entry = self._replays.get(node.key)
        if entry is None:
            entry = self._replays[node.key] = [0.0, 0, None]
        # Reloads of offloaded inputs count as the copies' time, not the rebuild's.
        entry[0] += time.perf_counter() - start - replayer.reload_seconds
        self._copies[0] += replayer.reload_seconds
        if entry[2] != id(node.cache):  # a micro-batch's first rebuild of this key
            entry[1] += 1
            entry[2] = id(node.cache)
        return out

    def take_copy_times(self) -> Tuple[float, int, int]:
        """Seconds the calling thread spent offloading (submitting, waiting for room),
        reloading (submitting, waiting, prefetching; for a rebuild's offloaded inputs too) and
        releasing the host copies (their arena blocks, as backward drops them), with
        the number and bytes of offloads, since the last call."""
        out = (self._copies[0], self._copies[1], self._copies[2])
        self._copies[:] = [0.0, 0, 0]  # in place: the live stores add their release to it
        return out

    def take_replay_times(self) -> Dict[str, Tuple[float, int]]:
        """Per operator key, since the last call: seconds its backward unpacks spent rebuilding
        (what recomputing really cost: the op, inputs rebuilt first, the replay's own work;
        several saved views of one storage are rebuilt once; reloads of offloaded inputs count
        in ``take_copy_times``) and the number of micro-batches that rebuilt it."""
        out = {k: (v[0], v[1]) for k, v in self._replays.items()}
        self._replays.clear()
        return out

    def take_op_replay_times(self) -> Dict[str, Tuple[float, int, int, float, int]]:
        """Per operator key (unsaved storages' included), since the last call: seconds backward
        spent replaying the op call that makes its storage (and the in-place ops on it) inside
        a chain, its inputs already at hand, with the walk since the previous call, and how
        many such replays it timed; how many replays it made in all; and the seconds and
        number of its replays as a rebuild's first call, timed apart (its inputs made before
        the rebuild: ``Replayer``). What one replay of that op costs, whatever rebuild it was
        part of, and whether backward rebuilt a storage more often than once per micro-batch."""
        out = {k: (v[0], int(v[1]), int(v[2]), v[3], int(v[4])) for k, v in self._op_replays.items()}
        self._op_replays.clear()
        return out

    def recompute_ahead(self, node: StorageNode, state: int) -> _Pin:
        """Rebuild a released storage now, before backward needs it, into its frame's recompute
        cache (where backward's unpack finds it). For the overlap scheduler's early recomputes,
        run while the device would otherwise idle; any thread may call it while no forward or
        backward of the same frame runs. Returns the ledger charge for the rebuilt storage:
        ``drop()`` it once backward has used it."""
        return _Pin(self.ledger, Replayer(self._available).storage(node, state))

    def prefetch(self, store: "_OffloadStore") -> bool:
        """Start reloading an offloaded storage now (charged to the ledger until backward
        uses it); False when one is already pending."""
        return store.prefetch(self.ledger)

    @staticmethod
    def _kept_tensor(node: StorageNode, state: int) -> Optional[torch.Tensor]:
        entry = node.kept.get(state)
        if entry is None:
            return None
        kept = entry[0]()
        return kept if kept is not None and kept._version == entry[1] else None

    def _available(self, node: StorageNode, state: int) -> Optional[torch.UntypedStorage]:
        if node.anchor is not None and node.anchor[1] == state:
            return node.anchor[0].untyped_storage()
        kept = self._kept_tensor(node, state)
        if kept is not None:
            return kept.untyped_storage()
        store = node.offloaded.get(state)
        if store is not None:
            return store.storage()
        return None

    def _prefetch_before(self, frame: Frame, store: _OffloadStore) -> None:
        # Backward meets a frame's stores in about reverse pack order: keep up to
        # ``prefetch_bytes`` of reloads pending below the one being unpacked. A cursor makes
        # this O(1) amortized per unpack; a new backward pass (retain_graph) starts it again.
        task = torch._C._current_graph_task_id()
        cursor = frame._prefetch_cursor
        if cursor > store.index - 1 or task != frame._prefetch_task:
            cursor = store.index - 1
            frame._prefetch_task = task
        while cursor >= 0:
            other = frame._offloads[cursor]()
            if other is not None:
                if frame._prefetch_pending + other.nbytes > self.prefetch_bytes or self._crosses(other.nbytes, pins=True):
                    break
                other.prefetch(self.ledger)
            cursor -= 1
        frame._prefetch_cursor = cursor
