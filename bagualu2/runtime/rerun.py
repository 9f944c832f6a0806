"""Whole-block rerun: how a block whose every saved activation is recomputed gets them back.

Design note
-----------
Replaying recipes op by op (``recipes.Replayer``) needs the forward traced, and the tracing
mode's own price (torch's Python dispatch for every aten op, before any recording) is about a
tenth of a cpu forward. When the plan recomputes everything a block saves (a frame with
``Frame.rerun_blocks``: ``policy="recompute_all"``), nothing of that block needs a recipe: the
runtime runs the block untraced and packs every tensor it saves as an index into one
``BlockRerun``. The first unpack of the block in a backward pass reruns the block's module on
its held inputs, with grad on and the forward's RNG and autocast states, capturing what the
rerun saves; each unpack takes its tensor from that capture. This is what
``torch.utils.checkpoint`` does, inside the runtime's frames and ledger.

Invariants:

* Exactness: the rerun reads the inputs the forward read (held; an in-place change since is
  an error, as autograd's own check makes it; a block called with any other object, such as a
  KV cache the forward appends to, is not rerun but traced), starts from the forward's RNG states and runs
  under its autocast state, so it saves bitwise the same tensors. Each captured tensor must
  have the size, strides and dtype of the one packed at its index, and the rerun must save as
  many, or the unpack fails naming the block and the first tensor that differs (a module whose
  state changed between forward and backward). The rerun stops right after the last save.
* A compiled region's rerun also checks the parameters and buffers its code reads besides its
  inputs (``watch``: ``compiled.py`` learns which from Dynamo's guards): the same tensors, at the
  versions they had as the call began, or it raises naming the tensor; a buffer the call wrote
  itself on its first call planned to be rerun is read from a copy taken as it began.
* Nothing lost: the inputs are held, and charged to the ledger (``pin``), while a packed
  object of the block lives; a backward pass that unpacks reruns the block once for itself, so
  several passes (``retain_graph``) work, and a graph dropped without backward frees it all.
* A captured tensor is handed out once and then dropped: backward holds one block's rebuilt
  saves at a time beside what autograd itself holds. Each captured storage is charged to the
  ledger until the last captured tensor of it is handed out.
* While the rerun runs, ``is_recomputing()`` is true: gate callbacks skip it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_unflatten

from bagualu2.runtime import recipes

__all__ = ["BlockRerun", "RerunCapture", "RerunSaved", "unrestorable"]

# Argument types a rerun passes again as they were: values, not objects a forward may change.
_VALUES = frozenset({type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
                     torch.memory_format})


def unrestorable(flat: List[Any]) -> Optional[Any]:
    """The first of a call's flattened arguments that a rerun cannot pass again as it was, or
    None. Tensors (held, version-checked) and plain values are restorable; any other object (a
    KV cache the forward appends to, a module) the forward may have changed."""
    return next((x for x in flat if not isinstance(x, torch.Tensor) and type(x) not in _VALUES), None)


_Meta = Tuple[torch.Size, Tuple[int, ...], torch.dtype]


class _RerunDone(Exception):
    """Raised by the capture hook after the last save: the rest of the block is not rerun."""


class BlockRerun:
    """One outermost block call of a frame run untraced: its inputs, RNG and autocast states,
    and what it saved (the metadata only; the tensors come back from the rerun).

    Args:
        module: the block.
        name: its module path, for messages.
        flat, spec: the call's arguments, flattened (``torch.utils._pytree.tree_flatten``; see
            ``unrestorable``); the tensors among them are held detached.
        pin: called with each held input tensor; returns the object that charges it to the
            ledger for as long as this record lives (None: not charged).
        charge: called with each storage a rerun captured; returns the object that charges it
            to the ledger until the last captured tensor of it is taken.
    """

    __slots__ = ("module", "name", "_flat", "_spec", "_grad", "_versions", "_rng", "_device", "_device_rng",
                 "_autocast", "_pins", "_metas", "storages", "_task", "_captured", "_charge", "_charges",
                 "_held", "_state", "_before", "__weakref__")

    def __init__(self, module: torch.nn.Module, name: str, flat: List[Any], spec: Any,
                 pin: Callable[[torch.Tensor], Any], charge: Callable[[torch.UntypedStorage], Any]) -> None:
        self.module = module
        self.name = name
        self._spec = spec
        self._flat: List[Any] = []
        self._grad: List[bool] = []
        self._versions: List[int] = []
        self._pins: List[Any] = []
        self._device: Optional[torch.device] = None
        for x in flat:
            if isinstance(x, torch.Tensor):
                self._grad.append(x.requires_grad)
                self._versions.append(x._version)
                x = x.detach()  # a view sharing x's version counter, without its graph
                pinned = pin(x)
                if pinned is not None:
                    self._pins.append(pinned)
                if self._device is None and x.device.type == "cuda":
                    self._device = x.device
            self._flat.append(x)
        self._rng = torch.get_rng_state()
        self._device_rng = torch.cuda.get_rng_state(self._device) if self._device is not None else None
        self._autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                          for d in ("cpu",) + (("cuda",) if self._device is not None else ())]
        self._metas: List[Optional[_Meta]] = []
        self.storages: Dict[int, int] = {}  # address -> bytes of the storages the block saved (while it runs)
        self._task = -2  # the backward pass ``_captured`` was rerun for
        self._captured: Dict[int, torch.Tensor] = {}
        self._charge = charge
        self._charges: Dict[int, List[Any]] = {}  # address -> [captured tensors of it not taken, charge]
        self._held: Optional[Tuple[List[Any], List[int], List[Any]]] = None  # the inputs while copies stand in
        # The parameters and buffers the block's code reads besides its arguments, as watched
        # (``watch``): (name, the dict holding it, key, the tensor, its version, a copy or None).
        self._state: List[Tuple[str, Dict[str, torch.Tensor], str, torch.Tensor, int, Optional[torch.Tensor]]] = []
        # The block's parameters and buffers as the call began (``snapshot``), until ``watch``.
        self._before: Dict[int, Tuple[torch.Tensor, int, Optional[torch.Tensor]]] = {}

    def hold_copies(self) -> None:
        """Rerun from copies of the tensor inputs, taken now, until ``drop_copies``: for a call
        that may write its own inputs in place, which a rerun from the inputs themselves would
        then refuse. The copies are not charged to the ledger: they stand for the call's inputs
        once per region (``CompiledRegions``), and what the budget learns from a frame must not
        count them."""
        self._held = (self._flat, self._versions, self._pins)
        with torch.no_grad():
            self._flat = [x.clone() if isinstance(x, torch.Tensor) else x for x in self._flat]
        self._versions = [x._version for x in self._flat if isinstance(x, torch.Tensor)]

    @property
    def holds_copies(self) -> bool:
        """Whether copies of the inputs stand in for them (``hold_copies``)."""
        return self._held is not None

    def drop_copies(self) -> None:
        """Rerun from the inputs themselves again: the call left them as they were."""
        if self._held is not None:
            self._flat, self._versions, self._pins = self._held
            self._held = None
        self._state = [entry[:5] + (None,) for entry in self._state]

    def snapshot(self, module: torch.nn.Module) -> None:
        """The versions of ``module``'s parameters and buffers as the call begins (before it
        may write them), and, while copies of the inputs stand in (``hold_copies``), copies of
        its buffers: a call that writes a buffer it reads (a running statistic) is rerun from
        the copy, and writes that. What the call reads of them is known later (``watch``)."""
        with torch.no_grad():
            for t in module.parameters():
                self._before[id(t)] = (t, t._version, None)
            for t in module.buffers():
                self._before[id(t)] = (t, t._version, t.clone() if self._held is not None else None)

    def watch(self, state: List[Tuple[str, Dict[str, torch.Tensor], str]]) -> None:
        """Check at the rerun that the parameters and buffers ``state`` names (name, the dict
        that holds it, its key: what a compiled region reads besides its arguments) are the
        tensors and versions ``snapshot`` saw (any other: the version it has now)."""
        for name, owner, key in state:
            t = owner[key]
            before = self._before.get(id(t))
            version, copy = (before[1], before[2]) if before is not None and before[0] is t else (t._version, None)
            self._state.append((name, owner, key, t, version, copy))
        self._before = {}

    def state_written(self) -> bool:
        """Whether a watched parameter or buffer was written in place or rebound since ``watch``."""
        return any(owner.get(key) is not t or t._version != v for _, owner, key, t, v, _ in self._state)

    def inputs_written(self) -> bool:
        """Whether the call wrote an input in place (its version moved since the call began)."""
        held = self._held[0] if self._held is not None else self._flat
        versions = self._held[1] if self._held is not None else self._versions
        return any(x._version != v for x, v in zip((x for x in held if isinstance(x, torch.Tensor)), versions))

    def save(self, t: torch.Tensor, counted: bool) -> "RerunSaved":
        """Pack one tensor the block saves (``counted``: a plain activation, whose storage
        ``storages`` sums; parameters and tensors without one are rerun too, uncounted)."""
        if counted:
            self._metas.append((t.shape, t.stride(), t.dtype))
            storage = t.untyped_storage()
            self.storages.setdefault(storage._cdata, storage.nbytes())
        else:
            self._metas.append(None)
        return RerunSaved(self, len(self._metas) - 1)

    def take(self, index: int, scope: Callable[[], Any]) -> torch.Tensor:
        """The saved tensor ``index``, rerunning the block first (inside ``scope()``, a context
        manager) when this backward pass has not, or has handed that tensor out already."""
        task = torch._C._current_graph_task_id()
        if task != self._task or index not in self._captured:
            self._captured, self._charges = {}, {}  # what an earlier pass left untaken
            with scope():
                self._captured = self._rerun()
            self._task = task
            for i, t in self._captured.items():
                if self._metas[i] is not None:  # an activation, not a parameter
                    storage = t.untyped_storage()
                    entry = self._charges.setdefault(storage._cdata, [0, None])
                    entry[0] += 1
                    if entry[1] is None:
                        entry[1] = self._charge(storage)
        out = self._captured.pop(index)
        if self._metas[index] is not None:
            cdata = out.untyped_storage()._cdata
            entry = self._charges[cdata]
            entry[0] -= 1
            if entry[0] == 0:
                del self._charges[cdata]
        return out

    def _rerun(self) -> Dict[int, torch.Tensor]:
        for i, (x, version) in enumerate(zip((x for x in self._flat if isinstance(x, torch.Tensor)), self._versions)):
            if x._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: input {i} of block {self.name} (shape {tuple(x.shape)}) was saved at version "
                    f"{version} and is now at version {x._version}")
        swapped: List[Tuple[Dict[str, torch.Tensor], str, torch.Tensor, torch.Tensor]] = []
        for name, owner, key, t, version, copy in self._state:
            if owner.get(key) is t and t._version != version and copy is not None:
                swapped.append((owner, key, t, copy))  # written since (by the call itself): rerun from the copy
                continue
            if owner.get(key) is not t or t._version != version:
                now = "another tensor" if owner.get(key) is not t else f"version {t._version}"
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {name} of block {self.name}, which its compiled code reads, was at version "
                    f"{version} in its forward and is now {now}: bagualu2 would rerun the block from it in "
                    f"backward; write it after backward, or plan the block to be kept or offloaded")
        try:
            for owner, key, _, copy in swapped:
                owner[key] = copy
            return self._rerun_from()
        finally:
            for owner, key, t, _ in swapped:
                owner[key] = t

    def _rerun_from(self) -> Dict[int, torch.Tensor]:
        grads = iter(self._grad)
        flat = [x.detach().requires_grad_(next(grads)) if isinstance(x, torch.Tensor) else x for x in self._flat]
        args, kwargs = tree_unflatten(flat, self._spec)
        capture = RerunCapture(len(self._metas) - 1)

        def unreachable(_: Any) -> torch.Tensor:
            raise AssertionError("the rerun's own graph is never run backward")

        devices = [self._device] if self._device is not None else []
        with recipes.ReplayDepth(), torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self._rng)
            if self._device_rng is not None:
                torch.cuda.set_rng_state(self._device_rng, self._device)
            with contextlib.ExitStack() as scope:
                scope.enter_context(torch.enable_grad())
                for device_type, enabled, dtype in self._autocast:
                    scope.enter_context(torch.autocast(device_type, enabled=enabled, dtype=dtype))
                scope.enter_context(torch.autograd.graph.saved_tensors_hooks(capture, unreachable))
                try:
                    self.module(*args, **kwargs)
                except _RerunDone:
                    pass
        self._check(capture.captured)
        return capture.captured

    def _check(self, captured: Dict[int, torch.Tensor]) -> None:
        if len(captured) != len(self._metas):
            raise RuntimeError(
                f"bagualu2: block {self.name} saved {len(self._metas)} tensors for backward in its forward but "
                f"{len(captured)} when rerun in backward: its forward must run the same way twice (a module "
                f"attribute or routing override changed between forward and backward?); run backward "
                f"before changing it, or use a per-operator plan, which replays recorded ops")
        for index, meta in enumerate(self._metas):
            if meta is None:
                continue
            size, stride, dtype = meta
            t = captured[index]
            if t.shape != size or t.stride() != stride or t.dtype != dtype:
                raise RuntimeError(
                    f"bagualu2: block {self.name} saved tensor {index} as {tuple(size)} {dtype} (strides "
                    f"{stride}) in its forward but as {tuple(t.shape)} {t.dtype} (strides {t.stride()}) when "
                    f"rerun in backward: its forward must run the same way twice (a module attribute or "
                    f"routing override changed between forward and backward?); run backward before changing "
                    f"it, or use a per-operator plan, which replays recorded ops")


class RerunCapture:
    """A rerun's pack hook: keeps each saved tensor by its index, and ends the rerun at the
    last one the forward saved. A class, not a closure, so that its code can be hidden from
    Dynamo once (``regions.hide_from_dynamo``): a rerun of a compiled region with graph breaks
    runs it between the region's graphs, where Dynamo would otherwise trace it and recompile
    it as ``captured`` grows."""

    __slots__ = ("captured", "last")

    def __init__(self, last: int) -> None:
        self.captured: Dict[int, torch.Tensor] = {}
        self.last = last

    def __call__(self, t: torch.Tensor) -> None:
        index = len(self.captured)
        if index > self.last:
            raise _RerunDone
        self.captured[index] = t.detach()
        if index == self.last:
            raise _RerunDone


class RerunSaved:
    """What the pack hook returns for a tensor a rerun block saved: the record and an index."""

    __slots__ = ("record", "index")

    def __init__(self, record: BlockRerun, index: int) -> None:
        self.record = record
        self.index = index
