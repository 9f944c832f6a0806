"""Residency ledger: the device bytes the activation runtime holds, counted once per storage.

Owns ``ResidencyLedger``, ``Pin`` (the handle that holds one count) and
``_drain_failed_backward``, which frees what a failed backward pass left holding pins inside
autograd. Everything else in the
runtime that holds a storage on the device (a kept tensor, an offload's source while its copy
runs, a leaf a recipe pins, a copy backward reloads or rebuilds for more readers) does it
through a pin, so the budget is checked against one number that is exact whichever frames
share a storage.

Invariants: a storage's bytes are counted while at least one live pin holds it, and given back
once none does (a dead pin's at the next read of the ledger), even when an interrupt lands in the middle of the bookkeeping: a count
and the registration of its pin change together, with no call between them, and a pin has no
finalizer to be cut short (the class note says why).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["Pin", "ResidencyLedger"]


class ResidencyLedger:
    """Device bytes held for activations, counted once per storage.

    A count is held by a ``Pin`` (``acquire``) and given back by ``release`` or by the pin's
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
        self._pins: Dict["weakref.ref[Pin]", int] = {}  # a live pin's weak reference -> its storage
        self._dead: List["weakref.ref[Pin]"] = []  # weak references of pins that died, not yet collected
        self._on_death = self._dead.append  # the pins' weak reference callback, made once
        # Held here: releases run at interpreter exit too, when module globals may be gone.
        self._free_weak_ref = torch.UntypedStorage._free_weak_ref
        self._resident = 0
        self.peak = 0

    @property
    def resident(self) -> int:
        if self._dead:
            self.collect()
        return self._resident

    @property
    def pins(self) -> int:
        """How many live pins hold counts now (those that died are given back first)."""
        if self._dead:
            self.collect()
        return len(self._pins)

    def acquire(self, storage: torch.UntypedStorage, pin: "Pin", target: Optional[int] = None) -> Optional[bool]:
        """Count ``storage`` for ``pin``'s life (or until ``release(pin._ref)``); whether it was
        held already. With ``target``, a storage not held yet whose bytes would take
        ``resident`` over it is refused instead: None, and nothing is counted (the check and
        the count in one step, as each kept save takes them)."""
        cdata = storage._cdata
        ref = weakref.ref(pin, self._on_death)
        held = self._held
        with self._lock:
            if self._dead:
                self._collect_locked()
            entry = held.get(cdata)
            if entry is not None:
                entry[0] += 1
            else:
                nbytes = storage.nbytes()
                if target is not None and self._resident + nbytes > target:
                    return None
                entry = [1, nbytes, storage._weak_ref()]
                # From here on no calls: the count and the pin's registration change together.
                held[cdata] = entry
                self._resident += nbytes
                if self._resident > self.peak:
                    self.peak = self._resident
            self._pins[ref] = cdata
            pin._ref = ref
            return entry[0] > 1

    def release(self, ref: "weakref.ref[Pin]") -> None:
        """Give back the count a pin holds (its ``_ref``); nothing when it was given back.
        Queued as a death is, and collected at once: one way of giving a count back."""
        with self._lock:
            self._dead.append(ref)
            self._collect_locked()

    def collect(self) -> None:
        """Give back the counts of pins that died (their weak references' callbacks queued them)."""
        with self._lock:
            self._collect_locked()

    def _collect_locked(self) -> None:
        """Unregister each queued pin and give back its count, if it still holds one (a pin
        dropped and then dead is queued twice). No call comes between the two: an interrupt
        lands at a call's entry or once a call returns, so it sees both or neither; an entry
        leaves the queue only after that. Inline, not one call per pin: a step gives back a
        count per saved tensor."""
        dead, pins, held = self._dead, self._pins, self._held
        while dead:
            ref = dead[-1]
            if ref in pins:
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

    def live(self, kind: type) -> List[Tuple["Pin", int]]:
        """The live pins of type ``kind`` that hold counts, with the storage (cdata) each
        holds, in the order they were acquired: what holds each storage, found through the
        ledger instead of a registry of its own kept up per pin."""
        with self._lock:
            if self._dead:
                self._collect_locked()
            pins = [(ref(), cdata) for ref, cdata in self._pins.items()]
        return [(pin, cdata) for pin, cdata in pins if type(pin) is kind]


class Pin:
    """Holds one ledger count on a storage for as long as this object lives (or until
    ``drop``). No finalizer: the ledger notices its death (``ResidencyLedger``'s note)."""

    __slots__ = ("_ledger", "_ref", "__weakref__")

    def __init__(self, ledger: ResidencyLedger, storage: torch.UntypedStorage) -> None:
        self._ledger = ledger
        self._ref: Optional["weakref.ref[Pin]"] = None
        ledger.acquire(storage, self)

    def drop(self) -> None:
        ref = self._ref
        if ref is not None:
            self._ref = None
            self._ledger.release(ref)


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
