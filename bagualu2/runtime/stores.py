"""What a saved activation becomes once packed: kept, offloaded, or released for recompute.

Owns the packed records autograd holds in a saved tensor's place (``_Offloaded``,
``_Recomputed``; the kept one, ``Kept``, is the ledger's), ``OffloadStore``, a storage's one copy in the host arena that every saved view
of it reads, ``CopyClock``, what copies cost (the stores' releases included), and the two
lookups of where a traced storage's bytes are already held (``kept_tensor``,
``regeneration_source``). The runtime (``bagualu2.runtime.activations``)
decides which record a save gets and turns records back into tensors; the records only hold
what that takes.

Invariants:

* A record owns what its data needs (a pin, a store, a node), so the data lives exactly as
  long as autograd holds the record: it may be unpacked any number of times, or never.
* A record remembers the version (or the traced storage's state) it was saved at, so a use
  after an in-place change raises as autograd's own check would (``_modified_error``), instead
  of reading newer bytes.
* A store whose copy fails keeps its device source rather than lose the bytes; a reload that
  fails raises, naming the activation.

Also what a hook handled, by its record (``observed_hook``: the runtime's ``on_hook`` event).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Optional, Tuple

import torch

from bagualu2._C import RuntimeError as NativeRuntimeError
from bagualu2.shared import CopyTimes
from bagualu2.runtime.frame import Frame
from bagualu2.runtime.ledger import Kept, ResidencyLedger, Pin
from bagualu2.runtime.recipes import StorageNode, ViewMeta, view_of
from bagualu2.runtime.rerun import RerunSaved


class CopyClock:
    """What copies cost a runtime's threads since it was last taken: the runtime adds each
    offload (its seconds, count and bytes) and reload, and each ``OffloadStore`` the seconds
    releasing its block took; ``take`` hands the sum back as a frozen ``CopyTimes`` and starts
    again."""

    __slots__ = ("seconds", "offloads", "nbytes")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.offloads = 0
        self.nbytes = 0

    def take(self) -> CopyTimes:
        """What was added since the last call."""
        out = CopyTimes(self.seconds, self.offloads, self.nbytes)
        self.seconds, self.offloads, self.nbytes = 0.0, 0, 0
        return out


class OffloadStore:
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
                 pin: Optional[Pin], frame: Frame, key: str, in_place: bool = False,
                 copies: Optional["CopyClock"] = None, source: Optional[torch.Tensor] = None,
                 node: Optional[StorageNode] = None) -> None:
        self.engine = engine
        self.handle = handle
        self.device = device
        self.nbytes = nbytes
        self.in_place = in_place
        self.alias: Optional[torch.Tensor] = None  # with in_place: uint8 tensor over the block
        self.alias_version = 0
        self.key = key
        self.pin: Optional[Pin] = pin  # device source held until the copy completes
        # With ``pin``: the source itself (uint8 over its storage), kept for good if the copy
        # fails; and its traced node's state then, which must not move on for it to be read.
        self.source = source if pin is not None else None
        self.source_node = weakref.ref(node) if node is not None else None
        self.source_state = node.state if node is not None else 0
        self.failed = False  # the copy failed: ``source`` serves every use (``_keep_source``)
        self.prefetched: Any = None
        self.prefetch_pin: Optional[Pin] = None  # the prefetch's device buffer, until used
        self.refs = 0  # saved tensors that read this store at unpack
        self.task = -2  # the backward pass (graph task id) that ``unpacked`` counts for
        self.unpacked = 0
        self.held: Optional[torch.Tensor] = None  # uint8 tensor over the reloaded storage
        self.held_version = 0  # its version when it was made: any change means an in-place write
        self.held_pin: Optional[Pin] = None
        self.frame = frame  # kept alive by its stores: backward prefetches from its list
        self.copies = copies  # the runtime's copy clock, which releasing the block adds to
        self.index = len(frame.runtime_state.offloads)
        frame.runtime_state.offloads.append(weakref.ref(self))

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
        except NativeRuntimeError as e:  # the copy failed after it was submitted
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
        except NativeRuntimeError as e:
            self.frame.stats.fallbacks.append(f"{self.key}: prefetch failed ({e}); reloaded when used")
            return False
        self.prefetch_pin = Pin(ledger, self.prefetched.destination.untyped_storage())
        self.frame.runtime_state.prefetch_pending += self.nbytes
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
            self.held_pin = Pin(ledger, storage)
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
                self.frame.runtime_state.prefetch_pending -= self.nbytes
                buffer = prefetched.wait()
            elif self.in_place:
                buffer = self._in_place()
            else:
                buffer = self.engine.reload(self.handle, device=self.device)
        except NativeRuntimeError as e:
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
                self.frame.runtime_state.prefetch_pending -= self.nbytes
                try:
                    self.prefetched.wait()
                except NativeRuntimeError:  # a failed reload: it ended all the same
                    pass
            if not self.handle.released:  # a cycle's collector may have finalized the handle first
                self.handle.release()
            if self.copies is not None:  # part of what the offload cost the thread
                self.copies.seconds += time.perf_counter() - start
        except Exception:  # a finalizer must not raise (interpreter teardown, a failed copy)
            pass


def _modified_error(what: str, saved: int, now: int) -> RuntimeError:
    # Autograd's own version check does not run for tensors packed by hooks, so do it here.
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} was saved at version {saved} and is now at version {now}"
    )


class _Offloaded:
    """A saved view of an offloaded storage. In-place changes after the save are seen through
    the storage's node (``state``: its mutations) or, in untraced frames, through the saved
    tensor while it lives (``state``: its version)."""

    __slots__ = ("store", "meta", "node", "state", "watch")

    def __init__(self, store: OffloadStore, meta: ViewMeta, node: Optional[StorageNode], state: int,
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
                 source: Optional[OffloadStore] = None) -> None:
        self.node = node
        self.state = state
        self.meta = meta
        self.source = source  # the offloaded storage a regenerated cast is rebuilt from
        if source is not None:
            source.refs += 1


def kept_tensor(node: StorageNode, state: int) -> Optional[torch.Tensor]:
    """The tensor a kept save holds of ``node``'s storage at ``state``, if it is alive and
    unchanged since: what a recipe reads instead of rebuilding it."""
    entry = node.kept.get(state)
    if entry is None:
        return None
    kept = entry[0]()
    return kept if kept is not None and kept._version == entry[1] else None


# Creating ops whose output is only a dtype cast or copy of their one tensor input: when that
# input is already stored, the output is regenerated from it instead of being stored twice.
# The overloads themselves, not their names: this is asked at every traced save.
_CAST_OPS = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.clone.default})


def regeneration_source(node: StorageNode, state: int) -> Tuple[bool, Optional[OffloadStore]]:
    """Whether the storage is a cast/copy (or chain of them) of a stored activation with
    nothing applied afterwards, and the offloaded store it is then rebuilt from (None when
    the source is kept)."""
    while node.creator.func in _CAST_OPS and not node.mutations and node.recomputable:
        source = node.creator.args[0] if node.creator.args else None
        src_node = getattr(source, "node", None)
        if not isinstance(src_node, StorageNode):
            return False, None
        store = src_node.offloaded.get(source.state)
        if store is not None:
            return True, store
        if kept_tensor(src_node, source.state) is not None:
            return True, None
        node = src_node
    return False, None


_RECORDS = {Kept: "kept", _Offloaded: "offloaded", _Recomputed: "recomputed", RerunSaved: "recomputed"}


def _record(packed: Any) -> str:
    """What a saved-tensor hook packed or unpacked: "kept", "offloaded" or "recomputed" (a
    store of the runtime; "recomputed" also for a block rerun whole), or "tensor" (saved as it
    is: too small, a parameter, or untraced)."""
    return _RECORDS.get(type(packed), "tensor")


def observed_hook(hook: str, run: Callable[[Any], Any], observer: Callable[[str, str, float], None]) -> Callable[[Any], Any]:
    """``run`` (a pack or unpack hook) timed, each call reported to ``observer`` (the runtime's
    ``on_hook`` event) with what it packed or unpacked."""
    def timed(x: Any) -> Any:
        start = time.perf_counter()
        out = run(x)
        observer(hook, _record(out if hook == "pack" else x), time.perf_counter() - start)
        return out
    return timed
