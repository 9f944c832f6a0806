"""The save path's Python form: the residency ledger, the kept-save record and the saved-tensor
hooks' common cases, written in Python with the behaviour of their C++ form, ``bagualu2._saves``
(csrc/saves/ledger.h and hooks.cpp, whose notes state the invariants L1-L5 and H1-H4).

``bagualu2.runtime.ledger`` takes this form where the compiled one cannot load: ``_saves`` links
against torch's C++ API and loads only under the torch release it was built against (a wheel
built for another release, a build that could not import torch), or where
``BAGUALU2_SAVE_PATH=python`` asks for it (the tests run both forms). Same semantics, same errors
(``Error`` is a ``ValueError``, as ``bagualu2._saves.Error``), the same records kept and the same
tensors served back, bit for bit; what differs is the host cost per saved tensor (Python
bytecode where the compiled form makes one C call) and two guarantees that only code running no
bytecode can give:

* L2/L3 under an interrupt: a count and the registration of its holder change in adjacent
  statements, so a KeyboardInterrupt raised between them can still leave a count without its
  holder (the count then stays until the ledger dies) or the reverse. A kept record gives its
  count back as a pin does (a weak reference whose callback is a C method, collected at the
  ledger's next read), never in a finalizer that an interrupt could cut short.
* H4 needs nothing here: a Python error raised inside a hook comes out as itself.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["CalmPack", "Error", "Kept", "KeptUnpack", "Ledger"]


class Error(ValueError):
    """Misuse of the save path's types (as ``bagualu2._saves.Error``)."""


_PYTHON_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
_ExcludeKeys = torch._C._ExcludeDispatchKeyGuard
_modes_on_stack = torch._C._len_torch_dispatch_stack
_graph_task = torch._C._current_graph_task_id
_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor
_strided = torch.strided


def _tensor_data(t: torch.Tensor) -> torch.Tensor:
    """``t``'s tensor data (the same storage and version counter, no autograd metadata). With a
    dispatch mode on the stack a plain tensor's is taken with the Python key excluded (torch
    would run the mode's Python ``detach``), as the compiled form does; a subclass keeps its own."""
    if _modes_on_stack() and type(t) in (_Tensor, _Parameter):
        with _ExcludeKeys(_PYTHON_KEY):
            return t.detach()
    return t.detach()


def _tensor_of(obj: Any, what: str) -> torch.Tensor:
    if not isinstance(obj, _Tensor):
        raise Error(f"{what} must be a torch.Tensor, not {type(obj).__name__}")
    return obj


class _Entry:
    __slots__ = ("count", "nbytes", "weak")

    def __init__(self, nbytes: int, weak: int) -> None:
        self.count = 1
        self.nbytes = nbytes
        self.weak = weak  # a weak reference to the storage (L4): its address is not reused while a key


class _LedgerState:
    """What the ledger and its Kept records share: a record may outlive the ledger object."""

    __slots__ = ("held", "resident", "peak", "pins", "kept", "dead", "on_death", "__weakref__")

    def __init__(self) -> None:
        self.held: Dict[int, _Entry] = {}
        self.resident = 0
        self.peak = 0
        self.pins: Dict[weakref.ref, int] = {}  # a live pin's weak reference -> its storage's address
        self.kept: Dict[weakref.ref, int] = {}  # the counted Kept records, in the order they were kept
        self.dead: List[weakref.ref] = []  # weak references of holders that died, not yet collected
        self.on_death = self.dead.append

    def __del__(self) -> None:  # the weak references to the storages still held
        try:
            free = torch.UntypedStorage._free_weak_ref
            for entry in self.held.values():
                free(entry.weak)
            self.held.clear()
        except Exception:  # interpreter shutdown: torch may be gone
            pass

    def add(self, storage: torch.UntypedStorage, target: Optional[int]) -> Optional[bool]:
        key = storage._cdata
        entry = self.held.get(key)
        if entry is not None:
            entry.count += 1
            return True
        nbytes = storage.nbytes()
        if target is not None and self.resident + nbytes > target:
            return None
        self.held[key] = _Entry(nbytes, storage._weak_ref())
        self.resident += nbytes
        if self.resident > self.peak:
            self.peak = self.resident
        return False

    def sub(self, key: int) -> None:
        entry = self.held.get(key)
        if entry is None:
            raise Error("bagualu2 ledger: a count given back for a storage it does not hold")
        entry.count -= 1
        if entry.count == 0:
            self.resident -= entry.nbytes
            del self.held[key]
            torch.UntypedStorage._free_weak_ref(entry.weak)

    def collect(self) -> None:
        """Gives back the counts of the holders that died (L3), last queued first; one released
        and then dead is queued twice and counted back once."""
        dead = self.dead
        while dead:
            ref = dead[-1]
            key = self.pins.pop(ref, None)
            if key is None:
                key = self.kept.pop(ref, None)
            if key is not None:
                self.sub(key)
            dead.pop()


class Kept:
    """Kept(tensor): a saved tensor held as it is; made so, an uncounted record, held and charged
    to nothing (a parameter, a view of one). A counted one (``Ledger.keep``) is its own count,
    given back by ``drop()`` or when it dies."""

    __slots__ = ("_tensor", "_version", "_node", "_state", "_moved", "_frame", "_shared", "_nbytes",
                 "_ledger", "_ref", "__weakref__")

    def __init_subclass__(cls, **kwargs: Any) -> None:  # final: the hooks check the exact type
        raise TypeError("type 'Kept' is not an acceptable base type")

    def __init__(self, tensor: Any) -> None:
        t = _tensor_of(tensor, "the kept tensor")
        # An op's saved output is held as its tensor data: with its grad_fn it would be a
        # reference cycle through the node that holds this record.
        self._tensor: Optional[torch.Tensor] = _tensor_data(t) if t.grad_fn is not None else t
        self._version = t._version
        self._node: Any = None
        self._state = 0
        self._moved: Any = None
        self._frame = -1
        self._shared = False
        self._nbytes = 0
        self._ledger: Optional[_LedgerState] = None
        self._ref: Optional[weakref.ref] = None  # set while it holds a count

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        """The saved tensor, None once it moved (offloaded to make room)."""
        return self._tensor

    @tensor.setter
    def tensor(self, value: Any) -> None:
        if value is not None:
            raise Error("Kept.tensor can only be cleared (set to None)")
        self._tensor = None

    @tensor.deleter
    def tensor(self) -> None:
        raise Error("Kept.tensor can only be cleared (set to None)")

    @property
    def version(self) -> int:
        """Its version counter at the save."""
        return self._version

    @property
    def node(self) -> Any:
        """The traced storage it holds, or None."""
        return self._node

    @node.setter
    def node(self, value: Any) -> None:
        self._node = value

    @node.deleter
    def node(self) -> None:
        raise AttributeError("Kept.node cannot be deleted")

    @property
    def state(self) -> int:
        """That storage's state at the save."""
        return self._state

    @property
    def moved(self) -> Any:
        """Where it went when offloaded later to make room, or None."""
        return self._moved

    @moved.setter
    def moved(self, value: Any) -> None:
        self._moved = value

    @moved.deleter
    def moved(self) -> None:
        raise AttributeError("Kept.moved cannot be deleted")

    @property
    def frame(self) -> int:
        """The index of the frame that saved it (-1: none)."""
        return self._frame

    @property
    def shared(self) -> bool:
        """Whether its storage was held already when it was kept."""
        return self._shared

    @property
    def nbytes(self) -> int:
        """Its storage's bytes (0 when uncounted)."""
        return self._nbytes

    @property
    def pin(self) -> Optional["Kept"]:
        """Itself while it holds a count; None when uncounted or dropped."""
        return self if self._ref is not None else None

    def drop(self) -> None:
        """Give the count back now."""
        ref = self._ref
        if ref is not None:
            self._ref = None
            state = self._ledger
            key = state.kept.pop(ref, None)  # type: ignore[union-attr]
            if key is not None:
                state.sub(key)  # type: ignore[union-attr]


def _keep_record(s: _LedgerState, t: torch.Tensor, node: Any, state: int, frame: int,
                 target: Optional[int]) -> Optional[Kept]:
    """A record of ``t`` counted, or None (nothing counted) where its storage is not held yet
    and its bytes would take resident over ``target`` (L5)."""
    s.collect()
    kept = Kept(t)
    storage = t.untyped_storage()
    held = s.add(storage, target)
    if held is None:
        return None
    kept._node = node
    kept._state = state
    kept._frame = frame
    kept._shared = held
    kept._nbytes = storage.nbytes()
    kept._ledger = s
    ref = kept._ref = weakref.ref(kept, s.on_death)
    s.kept[ref] = storage._cdata
    return kept


def _keep_plain_record(s: _LedgerState, obj: Any, param_storages: Any, frame: int, target: Optional[int],
                       traced: Optional[dict] = None) -> Optional[Kept]:
    """The calm keep (``Ledger.keep_plain``; csrc/saves/ledger.h ``keep_plain_record``)."""
    kind = type(obj)
    parameter = kind is _Parameter
    if (kind is not _Tensor and not parameter) or _modes_on_stack():
        return None
    if obj.layout != _strided or obj.is_nested:
        return None
    cdata = obj.untyped_storage()._cdata
    if parameter or cdata in param_storages:
        return Kept(obj)
    if traced and cdata in traced:
        return None
    if obj._is_view() and type(obj._base) is not _Tensor:  # a view of a subclass: the full way
        return None
    return _keep_record(s, obj, None, 0, frame, target)


def _storage_of(obj: Any) -> torch.UntypedStorage:
    if not isinstance(obj, torch.UntypedStorage):
        raise Error(f"storage must be a torch.UntypedStorage, not {type(obj).__name__}")
    return obj


class Ledger:
    """Device bytes held for activations, counted once per storage."""

    __slots__ = ("_s",)

    def __init__(self) -> None:
        self._s = _LedgerState()

    @property
    def resident(self) -> int:
        self._s.collect()
        return self._s.resident

    @property
    def peak(self) -> int:
        return self._s.peak

    @peak.setter
    def peak(self, value: int) -> None:
        self._s.peak = int(value)

    @property
    def pins(self) -> int:
        """How many holders (pins and Kept records) hold counts now."""
        self._s.collect()
        return len(self._s.pins) + len(self._s.kept)

    def reset_peak(self) -> None:
        self._s.peak = self.resident

    def acquire(self, storage: Any, pin: Any, target: Optional[int] = None) -> Optional[bool]:
        """A pin's count (L2): whether the storage was held already, or None (nothing counted)
        where it would take resident over ``target`` (L5)."""
        s = self._s
        storage = _storage_of(storage)
        ref = weakref.ref(pin, s.on_death)
        key = storage._cdata
        s.collect()
        held = s.add(storage, target)
        if held is None:
            return None
        s.pins[ref] = key
        pin._ref = ref
        return held

    def release(self, ref: Any) -> None:
        """Gives back the count a pin holds (its weak reference); nothing when it was given back."""
        self._s.dead.append(ref)
        self._s.collect()

    def collect(self) -> None:
        self._s.collect()

    def holds(self, storage: Any) -> bool:
        storage = _storage_of(storage)
        self._s.collect()
        return storage._cdata in self._s.held

    def count(self, cdata: int) -> Optional[Tuple[int, int]]:
        self._s.collect()
        entry = self._s.held.get(cdata)
        return None if entry is None else (entry.count, entry.nbytes)

    def live(self, kind: Any) -> List[Tuple[Any, int]]:
        """The live holders of type ``kind`` with the storage each holds, in the order they were
        counted: the Kept records for Kept, else the pins whose type is ``kind``."""
        s = self._s
        s.collect()
        out = []
        if kind is Kept:
            for ref, key in s.kept.items():
                kept = ref()
                if kept is not None:
                    out.append((kept, key))
            return out
        for ref, key in s.pins.items():
            pin = ref()
            if pin is not None and type(pin) is kind:
                out.append((pin, key))
        return out

    def keep(self, tensor: Any, node: Any, state: int, frame: int, target: Optional[int]) -> Optional[Kept]:
        return _keep_record(self._s, _tensor_of(tensor, "the kept tensor"), node, state, frame, target)

    def keep_plain(self, tensor: Any, param_storages: Any, frame: int, target: Optional[int]) -> Optional[Kept]:
        if not isinstance(param_storages, (set, frozenset)):
            raise Error(f"param_storages must be a set, not {type(param_storages).__name__}")
        return _keep_plain_record(self._s, tensor, param_storages, frame, target)


def _one_argument(hook: str, args: tuple, kwargs: dict) -> Any:
    if len(args) != 1 or kwargs:
        raise TypeError(f"{hook} takes one positional argument (the saved tensor or its record)")
    return args[0]


class CalmPack:
    """CalmPack(ledger, residency, frame, fallback): the pack hook of a frame. Its common case, a
    calm save of a plain tensor that fits the budget, is counted and kept here, and so is a
    parameter (held, never counted); anything else takes the full way, ``fallback`` (the
    compiled form's note in csrc/saves/hooks.cpp says which saves). It reads the runtime's state
    where the runtime keeps it, at each call (H2)."""

    __slots__ = ("_ledger", "_residency", "_frame", "_fallback", "_run", "_mode", "_traced", "_index",
                 "packed", "kept_bytes", "shared_bytes")

    def __init__(self, ledger: Any, residency: Any, frame: Any, fallback: Callable[[Any], Any]) -> None:
        if not isinstance(ledger, Ledger):
            raise Error(f"CalmPack: ledger must be a {__name__}.Ledger, not {type(ledger).__name__}")
        if not callable(fallback):
            raise Error(f"CalmPack: fallback must be callable, not {type(fallback).__name__}")
        self._ledger = ledger._s
        self._residency = residency
        self._frame = frame
        self._fallback = fallback
        self._run = frame.runtime_state
        self._mode = residency.mode
        self._traced = bool(frame.traced)
        self._index = int(frame.index)
        self.packed = 0  # saves it kept, counted
        self.kept_bytes = 0  # bytes of the storages it counted first
        self.shared_bytes = 0  # bytes of storages held already when kept

    @property
    def fallback(self) -> Callable[[Any], Any]:
        """What takes the saves it does not keep."""
        return self._fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = _one_argument("CalmPack", args, kwargs)
        run, res, frame = self._run, self._residency, self._frame
        if not run.calm or res.frame is not frame or res.inflight or run.untraced_offloads:
            return self._fallback(t)
        budget = frame.budget
        target = res.budget_bytes if budget is None else budget.save_target
        nodes = None
        if self._traced:
            nodes = self._mode.nodes
            if not isinstance(nodes, dict):
                raise Error(f"CalmPack: the tracing mode's nodes must be a dict, not {type(nodes).__name__}")
        kept = _keep_plain_record(self._ledger, t, res.param_storages, self._index,
                                  None if target is None else int(target), nodes)
        if kept is None:
            return self._fallback(t)
        if kept._ref is not None:  # counted (a parameter is not)
            self.packed += 1
            if kept._shared:
                self.shared_bytes += kept._nbytes
            else:
                self.kept_bytes += kept._nbytes
        return kept


class KeptUnpack:
    """KeptUnpack(fallback): the unpack hook: a Kept record, unmoved and unchanged, inside the
    backward pass that unpacked last, is served here; anything else goes to ``fallback`` (H3)."""

    __slots__ = ("_fallback", "_last_task")

    def __init__(self, fallback: Callable[[Any], Any]) -> None:
        if not callable(fallback):
            raise Error(f"KeptUnpack: fallback must be callable, not {type(fallback).__name__}")
        self._fallback = fallback
        self._last_task = -2  # no task yet: the first call always reaches the fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        packed = _one_argument("KeptUnpack", args, kwargs)
        task = _graph_task()
        if task == self._last_task and type(packed) is Kept:
            t = packed._tensor
            if packed._moved is None and t is not None and t._version == packed._version:
                return t
        self._last_task = task
        return self._fallback(packed)
