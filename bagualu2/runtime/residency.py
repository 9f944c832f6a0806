"""Residency: where a runtime's saved activations live, the budget they are held to, and how
backward gets them back.

Owns ``Residency``, the object an ``ActivationRuntime`` (``bagualu2.runtime.activations``)
carries its choices out with (``runtime.residency``): the ledger and the budget, the kept
storages and the offloads in flight, making room, and the unpack hook that serves every packed
record in backward (reloading, prefetching, rebuilding). The runtime decides: frames, module
hooks and the pack hook that picks each save's choice; it tells the residency which frame runs
(``frame``). Nothing here reads a plan; it carries out choices made there, within the budget.

Invariants:

* Exact accounting: ``ResidencyLedger`` counts the device bytes of every storage held here
  (kept tensors, offload sources still in flight, leaves pinned by recipes; in backward,
  reloaded copies and rebuilt storages while they are held for more readers), once per
  storage, whichever frames hold it. Parameters and buffers are not activations and are not
  counted.
* Budget: releases aim at the running frame's ``Budget.target`` (else ``budget_bytes``);
  crossing its limit is a violation, reported through ``on_exceed``. What nothing can release
  (an input from outside the forward, what a recipe pins) gets room by offloading kept
  storages, earlier micro-batches' first (``_make_room``; with an engine and an enforced
  budget only). In backward, a copy or rebuilt storage that more readers need is held for them
  only within the budget (else each reader reloads or rebuilds its own), and prefetches stop
  at it and at the ledger's high-water mark since the last forward began: what backward holds
  stays within the budget beside what the forward left, and a prefetch makes no new peak.
* Fallbacks never lose data: an offload without an engine, one the arena cannot take and one
  whose copy fails before its store exists return None, for the caller to fall back; a copy
  that fails later keeps its device source (``OffloadStore.settle``). A reload that fails
  raises, naming the activation.
"""

from __future__ import annotations

import collections
import contextlib
import time
import weakref
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Set, Tuple

import torch

from bagualu2._C import RuntimeError as NativeRuntimeError
from bagualu2.shared import CopyTimes, Event, Measurements, OpReplayTimes, ReplayTimes
from bagualu2.runtime.frame import Frame
from bagualu2.runtime.ledger import Kept, ResidencyLedger, Pin
from bagualu2.runtime.parameters import ParameterStorages, storages_of
from bagualu2.runtime.rerun import RerunSaved
from bagualu2.runtime.stores import _modified_error, _Offloaded, CopyClock, OffloadStore, kept_tensor
from bagualu2.runtime.recipes import Replayer, StorageNode, ViewMeta, is_plain, view_meta, view_of
from bagualu2.runtime.tracing import TracingMode

__all__ = ["Residency"]


class _ReplayTally:
    """Backward's rebuilds of one operator key since the last ``take_replay_times``."""

    __slots__ = ("seconds", "micro_batches", "cache")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.micro_batches = 0
        self.cache: Optional[int] = None  # id of the last micro-batch's recompute cache


class Residency:
    """The device side of an ``ActivationRuntime``, which owns it (its arguments are the
    runtime's): what is held, within which budget, and how each packed record becomes a tensor
    again in backward."""

    def __init__(self, engine: Any = None, *, budget_bytes: Optional[int] = None, enforce_budget: bool = True,
                 on_exceed: Optional[Callable[[int, int, str], None]] = None,
                 prefetch_bytes: int = 64 << 20, reload_in_place: bool = True) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be >= 0 or None")
        self.engine = engine
        self.budget_bytes = budget_bytes
        self.enforce_budget = enforce_budget
        self.on_exceed = on_exceed
        self.prefetch_bytes = prefetch_bytes
        self.reload_in_place = reload_in_place
        self.ledger = ResidencyLedger()
        # The leaves its recipes pin and the storages its recompute cache holds are charged here.
        self.mode = TracingMode(self.pin_leaf, self._charge)
        self.param_storages: Set[int] = set()
        self._params_of = ParameterStorages()  # the model whose storages ``param_storages`` holds
        self.frame: Optional[Frame] = None  # the running frame, set by the runtime: its Budget applies
        self.inflight: Deque["weakref.ref[OffloadStore]"] = collections.deque()
        # ``fn(key)`` with the operator key of every released (offloaded or recomputed)
        # activation backward unpacks, before it is served (the overlap driver: OverlapDriver).
        self.on_released_unpack = Event("released_unpack")
        # ``fn()`` as each backward pass that unpacks anything packed here ends (autograd's
        # final callback of the pass, on the thread that ran it; the provisioner learns there).
        self.on_backward_end = Event("backward_end")
        # ``fn(key, nbytes)`` as each offload has started (its copy submitted, its host copy made).
        self.on_offload = Event("offload")
        self._replays: Dict[str, _ReplayTally] = {}  # key -> its backward rebuilds' cost
        self._op_replays: Dict[str, List[float]] = {}  # key -> its op's replay times (Replayer)
        self.copies = CopyClock()  # what copies cost the caller's thread (take_copy_times)
        self.backward_passes = 0  # backward passes that unpacked anything packed here
        self._last_task = -1

    # -- parameters and leaves --------------------------------------------------------------
    def set_parameters(self, tensors: Iterator[torch.Tensor]) -> None:
        """Storages that are not activations (parameters, buffers): never offloaded or counted.
        A tensor subclass that wraps others (FSDP2's sharded ``DTensor`` parameters) is known
        by the storages of the tensors it holds: the ops that read it (FSDP2's all-gather of
        the shards) see those."""
        self.param_storages = {s._cdata for t in tensors for s in storages_of(t)}
        self._params_of.forget()

    def set_parameters_of(self, model: torch.nn.Module) -> None:
        """``set_parameters`` with every parameter and buffer of ``model`` and its submodules
        (those ``model.parameters()`` and ``model.buffers()`` yield). A provisioner calls it at
        every micro-batch (a wrapper applied since ``enable`` may have replaced them); the
        module tree is walked again only when ``ParameterStorages.current`` says it may have
        changed."""
        if self._params_of.current(model):
            return
        self.param_storages = self._params_of.walk(model)

    def is_parameter(self, t: torch.Tensor) -> bool:
        # A plain Tensor is never a Parameter: it skips the Parameter metaclass's isinstance (in
        # Python, and called for every save).
        if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
            return True
        # A view of a parameter the model did not hold when ``set_parameters`` ran (FSDP2's
        # unsharded parameters, registered around each module's forward and freed after it).
        base = t._base
        if base is not None and type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter):
            return True
        return is_plain(t) and t.untyped_storage()._cdata in self.param_storages

    def pin_leaf(self, t: torch.Tensor) -> Optional[Pin]:
        if not is_plain(t):
            return None
        storage = t.untyped_storage()
        # Most leaves are the model's weights, read by every op that uses them: known by their
        # storage first, before the slower checks for parameters set_parameters did not see.
        if storage._cdata in self.param_storages or self.is_parameter(t):
            return None
        frame = self.frame
        if frame is None or self.ledger.holds(storage):
            return Pin(self.ledger, storage)
        frame.stats.leaf_bytes += storage.nbytes()
        if storage._cdata not in self.mode.nodes:
            frame.stats.outside_bytes += storage.nbytes()
        else:
            frame.stats.traced_pin_bytes += storage.nbytes()
        if self._crosses(storage.nbytes(), pins=True) and not self._make_room(frame, storage.nbytes()):
            self._count_violation(frame, storage.nbytes(), f"a tensor of shape {tuple(t.shape)} a recipe holds")
        return Pin(self.ledger, storage)

    # -- budget -----------------------------------------------------------------------------
    def limit(self) -> Optional[int]:
        """The budget crossing which is a violation now: the running frame's, else
        ``budget_bytes``."""
        frame = self.frame
        return frame.budget.limit if frame is not None and frame.budget is not None else self.budget_bytes

    def target(self, pins: bool = False) -> Optional[int]:
        """Where releases aim now (``Budget.target`` of the running frame, else
        ``budget_bytes``); None without a budget."""
        frame = self.frame
        return frame.budget.target(pins) if frame is not None and frame.budget is not None else self.budget_bytes

    def would_cross(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more resident would cross where releases aim now, the room kept
        for pins included (what the overlap driver asks before a reload or early recompute)."""
        return self._crosses(nbytes, pins=True)

    def over_budget(self, storage: torch.UntypedStorage, pins: bool = False) -> bool:
        """Whether holding ``storage`` crosses the target (``pins``: one of the storages the
        pin headroom is left for)."""
        return not self.ledger.holds(storage) and self._crosses(storage.nbytes(), pins)

    def _crosses(self, nbytes: int, pins: bool = False) -> bool:
        """Whether ``nbytes`` more resident crosses the target."""
        target = self.target(pins)
        return target is not None and self.ledger.resident + nbytes > target

    def _room(self, storage: torch.UntypedStorage) -> bool:
        """Whether backward may hold ``storage`` for more readers within the budget."""
        return not self.over_budget(storage, pins=True)

    def _charge(self, storage: torch.UntypedStorage) -> Optional[Pin]:
        """Count a storage backward rebuilt and would hold for more readers (the recompute
        cache's), for the pin's life; None, and it is not held, where that crosses the budget."""
        return Pin(self.ledger, storage) if self._room(storage) else None

    def violate(self, frame: Frame, t: torch.Tensor, key: str) -> Any:
        """Keep ``t`` although that crosses the target, unless kept storages can make room; a
        violation where it crosses the limit."""
        nbytes = t.untyped_storage().nbytes()
        if not self._make_room(frame, nbytes):
            self._count_violation(frame, nbytes, key)
        return self.keep(frame, t)

    def _count_violation(self, frame: Frame, nbytes: int, key: str) -> None:
        limit = self.limit()
        if limit is not None and self.ledger.resident + nbytes > limit:
            frame.stats.violations += 1
            if self.on_exceed is not None:
                self.on_exceed(self.ledger.resident + nbytes, limit, key)

    # -- kept storages, and making room -----------------------------------------------------
    def keep(self, frame: Frame, t: torch.Tensor, storage: Optional[torch.UntypedStorage] = None,
             node: Optional[StorageNode] = None, target: Optional[int] = None) -> Optional[Kept]:
        """Keep ``t`` on the device, counted (``storage`` and ``node``: what the caller knows
        already, else looked up). With ``target``, only where that fits it: None, nothing kept
        and nothing counted, where a storage the ledger does not hold yet would cross it."""
        if node is None and frame.traced:
            node = self.mode.nodes.get((t.untyped_storage() if storage is None else storage)._cdata)
        kept = self.ledger.keep(t, node, 0 if node is None else node.state, frame.index, target)
        if kept is None:
            return None
        if kept.shared:
            frame.stats.shared_bytes += kept.nbytes
        else:
            frame.stats.bytes_by_choice["keep"] += kept.nbytes
        if node is not None:  # the record's tensor (detached if it was an op's output): it lives as long
            node.kept[node.state] = (weakref.ref(kept.tensor), t._version)
        return kept

    def _movable(self) -> List[Tuple[int, int, int, List[Kept]]]:
        """Kept storages ``_make_room`` may offload, in the order it would: (frame index,
        -bytes, cdata, the kept saves), those of earlier frames first, larger first. A storage
        is movable when kept saves, unchanged since and not moved, are all that hold it; they
        are found through the ledger's pins (no registry is kept per save)."""
        if self.target() is None or not self.enforce_budget or self.engine is None:
            return []
        by_storage: Dict[int, Tuple[int, List[Kept]]] = {}
        for kept, cdata in self.ledger.live(Kept):
            if kept.moved is None:
                entry = by_storage.get(cdata)
                if entry is None:
                    by_storage[cdata] = (kept.frame, [kept])
                else:
                    entry[1].append(kept)
        out = []
        for cdata, (index, saves) in by_storage.items():
            held = self.ledger.count(cdata)
            if held is not None and held[0] == len(saves) and all(k.tensor._version == k.version for k in saves):
                out.append((index, -held[1], cdata, saves))
        out.sort(key=lambda c: (c[0], c[1]))
        return out

    def movable_bytes(self) -> int:
        """Resident bytes that kept storages offloaded to make room would free."""
        return -sum(c[1] for c in self._movable())

    def make_room(self, need: int) -> bool:
        """Offload kept storages until ``need`` more bytes fit the running frame's budget, as
        ``_make_room`` does for what nothing releases: for a caller that knows the saves still to
        come before they are made (the provisioner at a spike's gate in an untraced forward, where
        offloading the saves as they cross would free nothing the forward still reads). True when
        they fit; False without a running frame."""
        frame = self.frame
        return frame is not None and self._make_room(frame, need)

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
            store = self.start_offload(frame, saves[0].tensor.untyped_storage(), "kept")
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
                k.drop()
            frame.stats.room_made_bytes += store.nbytes
            frame.stats.fallbacks.append(f"kept {store.nbytes} bytes offloaded to make room")
        return self.ledger.resident + need <= budget

    # -- offloads ---------------------------------------------------------------------------
    def offload(self, frame: Frame, node: StorageNode, storage: torch.UntypedStorage, state: int,
                 meta: ViewMeta) -> Optional[_Offloaded]:
        store = self.start_offload(frame, storage, node.key)
        if store is None:
            return None
        node.offloaded[state] = store
        return _Offloaded(store, meta, node, state)

    def start_offload(self, frame: Frame, storage: torch.UntypedStorage, key: str) -> Optional[OffloadStore]:
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
                frame.stats.offload_failures += 1
                return None
            if handle is None:
                frame.stats.offload_failures += 1
                return None
            pin: Optional[Pin] = None
            if self.over_budget(storage):
                self.settle(wait=True)
            if self.over_budget(storage):
                try:
                    handle.wait()  # no room even while the copy runs: copy synchronously
                except NativeRuntimeError as e:  # the copy failed: the caller falls back
                    frame.stats.fallbacks.append(f"{key}: offload failed ({e})")
                    frame.stats.offload_failures += 1
                    handle.release()
                    return None
            else:
                pin = Pin(self.ledger, storage)
            nbytes = storage.nbytes()
            store = OffloadStore(self.engine, handle, storage.device, nbytes, pin, frame, key,
                                  self.reload_in_place and storage.device.type == "cpu", self.copies,
                                  source, self.mode.nodes.get(storage._cdata))
            if pin is not None:
                self.inflight.append(weakref.ref(store))
            frame.stats.offloaded_storages += 1
            frame.stats.bytes_by_choice["offload"] += nbytes
            self.copies.offloads += 1
            self.copies.nbytes += nbytes
            if self.on_offload.subscribers:
                self.on_offload.emit(key, nbytes)
            return store
        finally:
            self.copies.seconds += time.perf_counter() - start

    def arena_in_use(self) -> int:
        return self.engine.arena.stats()["in_use"] if self.engine is not None else 0

    @property
    def inflight_bytes(self) -> int:
        """Device bytes held only until their offload copies complete."""
        return sum(s.nbytes for s in (ref() for ref in self.inflight) if s is not None and s.pin is not None)

    def settle(self, wait: bool = False) -> None:
        """Release device sources of completed offloads (all of them with ``wait``). Offloads
        complete in the order they started (one copy stream), so this stops at the first one
        still copying: a pack while many are in flight costs one query, not one per copy."""
        inflight = self.inflight
        while inflight:
            store = inflight[0]()
            if store is not None and not store.settle(wait):
                return
            inflight.popleft()

    # -- unpack -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def untraced(self) -> Iterator[None]:
        """Run bagualu2's own bookkeeping ops (gating callbacks) without tracing them."""
        self.mode.suspended += 1
        try:
            yield
        finally:
            self.mode.suspended -= 1

    def unpack(self, packed: Any) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task != self._last_task:
            self._last_task = task
            self.backward_passes += 1
            if self.on_backward_end.subscribers and task >= 0:  # -1: not inside a backward pass
                torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end.emit)
        if type(packed) is Kept:  # the common record first: a bare tensor is the rarest
            if packed.moved is not None:
                return self.unpack(packed.moved)
            if packed.tensor._version != packed.version:
                raise _modified_error(f"a tensor of shape {tuple(packed.tensor.shape)}", packed.version,
                                      packed.tensor._version)
            return packed.tensor
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, RerunSaved):  # a frame's module hooks skip the rerun's module calls
            return packed.record.take(packed.index, self.untraced)
        if isinstance(packed, _Offloaded):
            node = packed.node() if packed.node is not None else None
            if node is not None and node.state != packed.state:
                raise _modified_error(f"activation {node.key}", packed.state, node.state)
            watched = packed.watch() if packed.watch is not None else None
            if watched is not None and watched._version != packed.state:
                raise _modified_error(f"a tensor of shape {tuple(watched.shape)}", packed.state, watched._version)
            store = packed.store
            if self.on_released_unpack.subscribers:
                self.on_released_unpack.emit(store.key)
            start = time.perf_counter()
            if not store.frame.scheduled and not store.in_place:
                self._prefetch_before(store.frame, store)
            out = store.unpack(packed.meta, self.ledger, self._room)
            self.copies.seconds += time.perf_counter() - start
            return out
        node = packed.node
        if node.state != packed.state:
            raise _modified_error(f"activation {node.key}", packed.state, node.state)
        if self.on_released_unpack.subscribers:
            self.on_released_unpack.emit(node.key)
        start = time.perf_counter()
        node.cache.bind_to_backward()
        node.cache.evict_after(node.position)
        source = packed.source
        taken: List[torch.UntypedStorage] = []

        def available(n: StorageNode, s: int) -> Optional[torch.UntypedStorage]:
            # a cast regenerated from an offloaded storage is one of that store's readers
            if source is None or n.offloaded.get(s) is not source:
                return self.available(n, s)
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
            entry = self._replays[node.key] = _ReplayTally()
        # Reloads of offloaded inputs count as the copies' time, not the rebuild's.
        entry.seconds += time.perf_counter() - start - replayer.reload_seconds
        self.copies.seconds += replayer.reload_seconds
        if entry.cache != id(node.cache):  # a micro-batch's first rebuild of this key
            entry.micro_batches += 1
            entry.cache = id(node.cache)
        return out

    def available(self, node: StorageNode, state: int) -> Optional[torch.UntypedStorage]:
        # An anchor holds the storage as it is now: in the state it was anchored in only if no
        # in-place op has written it since, traced (the node's state moved) or not (its
        # version counter did).
        anchor = node.anchor
        if anchor is not None and anchor[1] == state == node.state and anchor[0]._version == anchor[3]:
            return anchor[0].untyped_storage()
        kept = kept_tensor(node, state)
        if kept is not None:
            return kept.untyped_storage()
        store = node.offloaded.get(state)
        if store is not None:
            return store.storage()
        return None

    def _prefetch_before(self, frame: Frame, store: OffloadStore) -> None:
        # Backward meets a frame's stores in about reverse pack order: keep up to
        # ``prefetch_bytes`` of reloads pending below the one being unpacked. A cursor makes
        # this O(1) amortized per unpack; a new backward pass (retain_graph) starts it again.
        # A prefetch only fills room that backward freed: it never lifts the ledger above its
        # high-water mark since the last forward began. Backward's own working set (activation
        # gradients) sits beside the ledger; at the budget's limit, prefetched copies would meet
        # it at a whole-memory peak the forward never showed, which no excess learned from
        # earlier windows accounts for.
        task = torch._C._current_graph_task_id()
        run = frame.runtime_state
        cursor = run.prefetch_cursor
        if cursor > store.index - 1 or task != run.prefetch_task:
            cursor = store.index - 1
            run.prefetch_task = task
        # Room below the high-water mark, less what the unpack itself reloads if not prefetched.
        room = self.ledger.peak - self.ledger.resident
        if store.prefetched is None and store.held is None:
            room -= store.nbytes
        while cursor >= 0:
            other = run.offloads[cursor]()
            if other is not None:
                if (run.prefetch_pending + other.nbytes > self.prefetch_bytes or self._crosses(other.nbytes, pins=True)
                        or other.nbytes > room):
                    break
                if other.prefetch(self.ledger):
                    room -= other.nbytes
            cursor -= 1
        run.prefetch_cursor = cursor

    def prefetch(self, store: "OffloadStore") -> bool:
        """Start reloading an offloaded storage now (charged to the ledger until backward
        uses it); False when one is already pending."""
        return store.prefetch(self.ledger)

    def recompute_ahead(self, node: StorageNode, state: int) -> Pin:
        """Rebuild a released storage now, before backward needs it, into its frame's recompute
        cache (where backward's unpack finds it). For the overlap scheduler's early recomputes,
        run while the device would otherwise idle; any thread may call it while no forward or
        backward of the same frame runs. Returns the ledger charge for the rebuilt storage:
        ``drop()`` it once backward has used it."""
        return Pin(self.ledger, Replayer(self.available).storage(node, state))

    # -- measured costs ---------------------------------------------------------------------
    def take_measurements(self) -> Measurements:
        """Everything measured since the last call, as one record (``take_op_replay_times``,
        ``take_replay_times`` and ``take_copy_times`` together): what the provisioner learns
        from as each backward pass ends."""
        return Measurements(self.take_op_replay_times(), self.take_replay_times(), self.take_copy_times())

    def take_copy_times(self) -> CopyTimes:
        """Seconds the calling thread spent offloading (submitting, waiting for room),
        reloading (submitting, waiting, prefetching; for a rebuild's offloaded inputs too) and
        releasing the host copies (their arena blocks, as backward drops them), with
        the number and bytes of offloads, since the last call."""
        return self.copies.take()

    def take_replay_times(self) -> Dict[str, ReplayTimes]:
        """Per operator key, since the last call: seconds its backward unpacks spent rebuilding
        (what recomputing really cost: the op, inputs rebuilt first, the replay's own work;
        several saved views of one storage are rebuilt once; reloads of offloaded inputs count
        in ``take_copy_times``) and the number of micro-batches that rebuilt it."""
        out = {k: ReplayTimes(v.seconds, v.micro_batches) for k, v in self._replays.items()}
        self._replays.clear()
        return out

    def take_op_replay_times(self) -> Dict[str, OpReplayTimes]:
        """Per operator key (unsaved storages' included), since the last call: seconds backward
        spent replaying the op call that makes its storage (and the in-place ops on it) inside
        a chain, its inputs already at hand, with the walk since the previous call, and how
        many such replays it timed; how many replays it made in all; and the seconds and
        number of its replays as a rebuild's first call, timed apart (its inputs made before
        the rebuild: ``Replayer``). What one replay of that op costs, whatever rebuild it was
        part of, and whether backward rebuilt a storage more often than once per micro-batch."""
        out = {k: OpReplayTimes(v[0], int(v[1]), int(v[2]), v[3], int(v[4])) for k, v in self._op_replays.items()}
        self._op_replays.clear()
        return out
