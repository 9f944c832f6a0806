"""The excess: what the allocator shows beyond the activations at a micro-batch's whole-memory
peak (the forward's and backward's working sets, gradients, anything else), learned per
micro-batch, so that a budget on the whole memory holds without a hand-tuned reserve.

Owns ``Excess`` (the predictor), ``WholeMemory`` (one for traced forwards and one for untraced
ones, part of the provisioner's learned state), ``AllocatorView`` (the provisioner's reading of
the view and the excess it leaves each micro-batch), ``checked_allocator``
(what ``enable(allocator=...)`` accepts), ``read_allocator`` (one reading, checked) and
``largest_expert_bytes`` (the load feature the excess scales with).

Design note
-----------
With an allocator view the provisioner reads it as each forward begins: the bytes allocated now
and the peak since the last reading, the peak of the window that just ended (the last
micro-batch's forward, its backward, whatever ran between). Beside the ledger's peak over the same
window it gives one sample: ``excess = allocator peak - ledger peak``, at the load the window's
micro-batch was routed with, and whether the window held the budget. The load is the saved bytes
the cost model predicts for the most loaded expert's operators at that routing: a spike grows that
expert's temporaries and gradients, which is what grows the excess with the routing, and the gate
knows it before the experts run.

Why these bounds: the whole-memory peak ``P(L)`` of a micro-batch whose activations are held to
``L`` never falls when ``L`` rises, and rises by at most what ``L`` does (more room for
activations adds at most that many bytes anywhere). So a window that held (``P <= budget``,
activations peaking at ``l``) shows that ``budget - excess`` (``>= l``) would still have held:
its excess is *enough* at its load. A window that crossed shows that no limit above
``budget - excess`` holds: its excess is *needed* at its load. ``Excess.predict(load)`` is the
larger of what the misses need (a miss at a load no heavier than this one, or at a heavier one
less the slope's share of the difference) and the least that recent held windows at this load or
a heavier one found enough (above every held load, the heaviest ones' plus the slope times the
difference). A lighter window's excess plus the slope is a guess, not a bound: a spike's excess
grows with what its rank computes, not only with its heaviest expert, and the guess from a calm
window left a spike that had held before less than it needed again. The slope, bytes of excess per
byte of the most loaded expert's saves, starts at ``PRIOR_SLOPE`` (a spike's temporaries are
about as large as what its expert saves) and rises when a miss at a heavier load shows it must.

Traced and untraced forwards are learned apart (``WholeMemory``): a traced forward holds more
beyond the ledger (its records of how to rebuild what it saved), so a calm forward's excess, learned
from untraced ones, is too little for one traced after a spike. A traced forward is left at least
what an untraced one at its load would be, and an untraced one heavier than any untraced forward
seen (a spike that arrives after calm ones) at least what a traced one would be.

Invariants: after a window that crossed the budget at load ``m`` with excess ``x``, every
prediction at a load ``>= m`` is ``>= x`` (a known-too-low estimate is never used twice); a held
window at a lighter load never makes a heavier one's prediction fall below a miss; predictions are
non-negative and grow with the load; the state is bounded (``_RECENT`` held windows, ``_MISSES``
misses). Held windows are the recent ones only, so what lies outside the activations can grow
(an optimizer's state at its first step) and costs at most one crossing, then is needed.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from bagualu2.plan.cost_model import CostModel
from bagualu2.runtime.ledger import ResidencyLedger

__all__ = ["AllocatorView", "Excess", "PRIOR_SLOPE", "WholeMemory", "checked_allocator", "cuda_allocator", "largest_expert_bytes",
           "read_allocator"]

Allocator = Callable[[], Tuple[int, int]]

PRIOR_SLOPE = 1.0
"""Bytes of excess per byte the most loaded expert saves, before a miss shows more."""
_RECENT = 32  # held windows remembered, the last ones
_MISSES = 32  # misses remembered, the heaviest needs kept
_SAME_LOAD = 0.05  # loads within this fraction of each other are one load (no slope between them)


def cuda_allocator(device: torch.device) -> Allocator:
    """``device``'s caching allocator as an allocator view: ``torch.cuda.memory_allocated`` and
    ``torch.cuda.max_memory_allocated``, the peak then reset (``torch.cuda.reset_peak_memory_stats``,
    which resets the peak statistics a user reads too: under bagualu2 they cover the time since
    the last forward began)."""

    def read() -> Tuple[int, int]:
        now, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return now, peak

    return read


def checked_allocator(allocator: Union[None, str, Allocator], device: torch.device) -> Optional[Allocator]:
    """What ``enable(allocator=...)`` was given, as a callable (None: none): ``"cuda"`` for the
    model's CUDA device's allocator, or a callable returning ``(bytes allocated now, peak bytes
    since its last call)``. TypeError or ValueError naming the value and what to pass."""
    if allocator is None:
        return None
    if isinstance(allocator, str):
        if allocator != "cuda":
            raise ValueError(f"allocator={allocator!r}: pass 'cuda', a callable returning (bytes allocated now, "
                             f"peak bytes since its last call), or None")
        if device.type != "cuda":
            raise ValueError(f"allocator='cuda' needs the model on a CUDA device, it is on {device}; on this "
                             f"device pass a callable returning (bytes allocated now, peak bytes since its last "
                             f"call), or None")
        return cuda_allocator(device)
    if not callable(allocator):
        raise TypeError(f"allocator={allocator!r} ({type(allocator).__name__}) is not callable: pass 'cuda', a "
                        f"callable returning (bytes allocated now, peak bytes since its last call), or None")
    return allocator


def read_allocator(allocator: Allocator) -> Tuple[int, int]:
    """One reading ``(now, peak)``, checked: two ints, ``0 <= now <= peak``. TypeError or
    ValueError naming what the allocator view returned and what it must."""
    got = allocator()
    fix = ("an allocator view returns (bytes allocated now, peak bytes since its last call), two ints, "
           "the peak reset to what is allocated at each call")
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise TypeError(f"the allocator view returned {got!r}: {fix}")
    try:
        if any(isinstance(v, (bool, float)) for v in got):
            raise TypeError
        now, peak = (operator.index(v) for v in got)
    except TypeError:
        raise TypeError(f"the allocator view returned {got!r}, not two ints: {fix}") from None
    if now < 0 or peak < 0:
        raise ValueError(f"the allocator view returned negative bytes {got!r}: {fix}")
    if peak < now:
        raise ValueError(f"the allocator view returned a peak {peak:,} below the bytes allocated now {now:,}: "
                         f"{fix} (the peak since the last call includes what is allocated now)")
    return now, peak


def largest_expert_bytes(cost: CostModel, counts: Mapping[int, Sequence[int]]) -> int:
    """The saved bytes the cost model predicts at ``counts`` for the operators of the one expert
    (a grouped experts call: its whole layer) that saves the most; 0 before any profile."""
    by_expert: Dict[Tuple[int, int], int] = {}
    for key, op in cost.ops.items():
        if op.layer is not None and op.expert is not None:
            where = (op.layer, op.expert)
            by_expert[where] = by_expert.get(where, 0) + cost.predict_bytes(key, counts)
    return max(by_expert.values(), default=0)


class Excess:
    """What lies outside the activations at a micro-batch's whole-memory peak, by load (the
    module note says how it is learned and why the bounds hold)."""

    def __init__(self) -> None:
        self.slope = PRIOR_SLOPE
        self.held: Deque[Tuple[int, int]] = deque(maxlen=_RECENT)  # (load, excess) of recent windows that held
        self.missed: List[Tuple[int, int]] = []  # (load, excess) of windows that crossed, none dominated
        self.windows = 0  # windows learned from
        self.heaviest = 0  # the heaviest load of a window learned from
        self.over = 0  # of them, those whose whole-memory peak crossed the budget
        self.peak = 0  # the highest whole-memory peak read

    def observe(self, load: int, peak: int, activations_peak: int, budget: int) -> None:
        """A window whose micro-batch was routed at ``load`` peaked at ``peak`` bytes of whole
        memory, its activations at ``activations_peak``: it held ``budget`` or crossed it."""
        # Never below 0: a view that counts less than the ledger does leaves nothing for more.
        load, excess, held = max(0, int(load)), max(0, int(peak) - int(activations_peak)), peak <= budget
        self.windows += 1
        self.heaviest = max(self.heaviest, load)
        self.peak = max(self.peak, int(peak))
        if held:
            self.held.append((load, excess))
            self._steepen(self.missed, [(load, excess)])
            return
        self.over += 1
        # Held windows at this load or a heavier one that found less enough were wrong: dropped.
        near = load * (1.0 - _SAME_LOAD)
        for point in [p for p in self.held if p[0] >= near and p[1] < excess]:
            self.held.remove(point)
        self._steepen([(load, excess)], self.held)
        if not any(m <= load and x >= excess for m, x in self.missed):
            self.missed = [(m, x) for m, x in self.missed if not (m >= load and x <= excess)]
            self.missed.append((load, excess))
            if len(self.missed) > _MISSES:
                # The two nearest loads become one miss that needs what both did from the lighter
                # load up: more than either, never less.
                self.missed.sort()
                i = min(range(len(self.missed) - 1), key=lambda k: self.missed[k + 1][0] - self.missed[k][0])
                (m0, x0), (_, x1) = self.missed[i], self.missed.pop(i + 1)
                self.missed[i] = (m0, max(x0, x1))

    def _steepen(self, misses: Sequence[Tuple[int, int]], held: Sequence[Tuple[int, int]]) -> None:
        """Raise the slope so that no held window at a lighter load predicts less than a miss
        at a heavier one needs."""
        for m, x in misses:
            for hm, hx in held:
                if hm < m * (1.0 - _SAME_LOAD) and x > hx:
                    self.slope = max(self.slope, (x - hx) / (m - hm))

    def predict(self, load: int) -> int:
        """The excess to leave at ``load``: at least what every miss needs there, and the least
        that a recent held window at this load or a heavier one found enough (0 before any
        window); above every held window's load, the heaviest ones' plus the slope's share."""
        load = max(0, int(load))
        needed = max((x - self.slope * max(0, m - load) for m, x in self.missed), default=0.0)
        # A window at a lighter load says what is enough here only through the slope, a guess
        # until a miss steepens it: where a window at this load or above shows what was enough,
        # that is what is left (a spike's excess is not a calm one's plus the slope's share).
        floor = min(load * (1.0 - _SAME_LOAD), max((m for m, _ in self.held), default=0))
        enough = min((x + self.slope * max(0, load - m) for m, x in self.held if m >= floor), default=needed)
        return max(0, int(max(needed, enough)))



class WholeMemory:
    """The excess of traced forwards and of untraced ones, each its own ``Excess``."""

    def __init__(self) -> None:
        self.traced = Excess()
        self.untraced = Excess()

    def observe(self, traced: bool, load: int, peak: int, activations_peak: int, budget: int) -> None:
        """A window whose forward was ``traced`` or not (``Excess.observe``)."""
        (self.traced if traced else self.untraced).observe(load, peak, activations_peak, budget)

    def predict(self, traced: bool, load: int) -> int:
        """The excess to leave at ``load`` in a forward ``traced`` or not: its own kind's, or the
        other's before its own has a window; a traced one at least an untraced one's, and an
        untraced one heavier than any untraced window at least a traced one's (a spike after
        calm forwards, whose excess only traced ones have shown)."""
        own, other = (self.traced, self.untraced) if traced else (self.untraced, self.traced)
        if not own.windows:
            return other.predict(load)
        if traced or (load > own.heaviest and other.windows):
            return max(own.predict(load), other.predict(load))
        return own.predict(load)

    @property
    def windows(self) -> int:
        return self.traced.windows + self.untraced.windows

    @property
    def over(self) -> int:
        return self.traced.over + self.untraced.over

    @property
    def peak(self) -> int:
        return max(self.traced.peak, self.untraced.peak)


class AllocatorView:
    """A provisioner's allocator view: read as each forward begins, it teaches ``excess`` the
    window that ends and says what each micro-batch leaves outside its activations (``now``)."""

    def __init__(self, read: Allocator, excess: WholeMemory, cost: CostModel, model: torch.nn.Module) -> None:
        self.read = read
        self.excess = excess  # the provisioner's piece (its learned state)
        self.cost = cost
        self.model = model
        self.now = 0  # what this micro-batch leaves outside its activations
        self.outside = 0  # allocated beyond the activations as the last forward began
        self.last_load = 0  # the load at the last micro-batch's routing
        self.worst_load: Optional[int] = None  # the load at the worst routing, once profiling ended
        self.window_traced = False  # whether the forward of the window the next reading ends was traced

    def begin(self, first: bool, counts: Mapping[int, Sequence[int]], ledger: ResidencyLedger,
              budget: int) -> Optional[int]:
        """A forward begins (``first``: the first, whose reading covers what ran before): learn
        from the window that ends, whose micro-batch routed ``counts``, beside ``ledger``'s
        peak over it; set ``now`` for the last routing in an untraced forward. The window's peak
        when it crossed ``budget``, else None."""
        now, peak = read_allocator(self.read)
        crossed = None
        if not first and self.cost.ready and counts:
            self.excess.observe(self.window_traced, largest_expert_bytes(self.cost, counts), peak, ledger.peak, budget)
            crossed = peak if peak > budget else None
        self.outside = max(0, now - ledger.resident)
        self.last_load = largest_expert_bytes(self.cost, counts) if counts else 0
        self.now = self.at(self.last_load, False)
        return crossed

    def at(self, load: int, traced: bool) -> int:
        """The excess to leave at ``load`` in a forward ``traced`` or not (``WholeMemory.predict``),
        and at least what was allocated beyond the activations as this forward began; before any
        window was learned from, that and the gradients backward will allocate (trainable
        parameters without one yet)."""
        if not self.excess.windows:
            return self.outside + sum(p.numel() * p.element_size() for p in self.model.parameters()
                                      if p.requires_grad and p.grad is None)
        return max(self.excess.predict(traced, load), self.outside)

    def at_routing(self, counts: Mapping[int, Sequence[int]], traced: bool) -> int:
        """``at`` the load of ``counts``."""
        return self.at(largest_expert_bytes(self.cost, counts), traced)

    def profiled(self, worst: Optional[Mapping[int, Sequence[int]]]) -> None:
        """Profiling ended: the worst routing (``RoutingRecord.worst``; None: no bound)."""
        self.worst_load = None if worst is None else largest_expert_bytes(self.cost, worst)

    def worst(self) -> int:
        """The excess at the worst routing (``now`` before profiling ended)."""
        return self.now if self.worst_load is None else self.at(self.worst_load, False)
