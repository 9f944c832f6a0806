"""Planner: which saved activations to keep, offload or recompute.

Contract (docs/CONTRACTS.md, ``bagualu2.plan.planner``):

- ``Planner(quantum_bytes=None).solve(candidates, must_free_bytes, offload_window_s,
  reload_window_s, offload_setup_s=0.0) -> Plan`` picks one :class:`Choice` per
  :class:`Candidate` minimizing the exposed time

      sum(recompute_s of RECOMPUTE)
      + max(0, sum(offload_s of OFFLOAD) - offload_window_s)
      + max(0, sum(reload_s of OFFLOAD) - reload_window_s)
      + offload_setup_s if anything is offloaded (default 0)

  subject to ``freed_bytes >= must_free_bytes``. The C++ dynamic program (csrc/sched/planner.h)
  rounds item bytes down and the target up, so a feasible plan always frees enough exact bytes;
  copy times are rounded up, so ``Plan.bound_s`` never underestimates ``Plan.exposed_s``.
  ``exposed_s`` itself is exact. When even releasing every releasable op is not enough,
  ``plan.feasible`` is False, ``plan.shortfall_bytes`` says by how much, and the plan releases
  every releasable op (the best effort) at the least exposed time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

from bagualu2._C import Planner as NativePlanner
from bagualu2.shared import Choice

__all__ = ["Choice", "Candidate", "Plan", "Planner"]


_CHOICES: Tuple[Choice, Choice, Choice] = (Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE)


@dataclass(frozen=True)
class Candidate:
    """One saved activation the planner may release.

    Attributes:
        key: operator key, unique within one ``solve`` call.
        nbytes: device bytes released when not kept.
        recompute_s: seconds to recompute it in backward (always exposed).
        offload_s: seconds of its D2H copy (shares the forward copy window).
        reload_s: seconds of its H2D copy (shares the backward copy window).
        can_offload: whether OFFLOAD is allowed.
        can_recompute: whether RECOMPUTE is allowed.
    """

    key: str
    nbytes: int
    recompute_s: float
    offload_s: float
    reload_s: float
    can_offload: bool = True
    can_recompute: bool = True


@dataclass(frozen=True)
class Plan:
    """The planner's answer: one :class:`Choice` per candidate key.

    Attributes:
        choices: key -> choice, in candidate order.
        feasible: False when releasing every releasable op still frees too little.
        freed_bytes: exact bytes released by the plan.
        shortfall_bytes: ``max(0, must_free_bytes - bytes of all releasable ops)``.
        exposed_s: exact exposed time of the plan (formula in the module docstring).
        bound_s: the DP's conservative estimate of the exposed time (``>= exposed_s``).
        quantum_bytes: byte quantum the DP used (1 when bytes were handled exactly).
        offload_quantum_s: time quantum of the forward window (0.0: handled exactly).
        reload_quantum_s: time quantum of the backward window (0.0: handled exactly).
    """

    choices: Dict[str, Choice]
    feasible: bool = True
    freed_bytes: int = 0
    shortfall_bytes: int = 0
    exposed_s: float = 0.0
    bound_s: float = 0.0
    quantum_bytes: int = 1
    offload_quantum_s: float = 0.0
    reload_quantum_s: float = 0.0
    _mix: Dict[Choice, int] = field(default_factory=dict, repr=False, compare=False)

    def __getitem__(self, key: str) -> Choice:
        return self.choices[key]

    def __contains__(self, key: object) -> bool:
        return key in self.choices

    def __iter__(self) -> Iterator[str]:
        return iter(self.choices)

    def __len__(self) -> int:
        return len(self.choices)

    def get(self, key: str, default: Choice = Choice.KEEP) -> Choice:
        """Choice for ``key``, or ``default`` (KEEP) for ops the planner never saw."""
        return self.choices.get(key, default)

    def mix(self) -> Dict[Choice, int]:
        """Number of ops per choice, every choice present (zeros included)."""
        if not self._mix:
            counts = {c: 0 for c in Choice}
            for c in self.choices.values():
                counts[c] += 1
            self._mix.update(counts)
        return dict(self._mix)

    @staticmethod
    def keep_all(keys: Sequence[str] = ()) -> "Plan":
        """The all-KEEP plan over ``keys`` (what ``must_free_bytes <= 0`` returns)."""
        return Plan(choices={k: Choice.KEEP for k in keys})


class Planner:
    """Multiple-choice knapsack DP with shared copy windows (C++, torch-free).

    Args:
        quantum_bytes: byte quantum of the DP; None picks one automatically (the gcd of the
            candidate sizes when the state table allows it, exact in that case). The quantum
            is raised when the table would exceed ``max_cells``.
        time_quantum_s: copy-time quantum for both windows; None picks ``window / slots``.
        max_cells: DP states per op (latency and memory cap); None picks one from the
            number of candidates (about 2^18 state updates per solve).

    A Planner reuses its tables between solves and is not thread-safe; use one per thread.
    """

    def __init__(
        self,
        quantum_bytes: Optional[int] = None,
        *,
        time_quantum_s: Optional[float] = None,
        max_cells: Optional[int] = None,
    ) -> None:
        self._impl = NativePlanner(
            int(quantum_bytes or 0), float(time_quantum_s or 0.0), int(max_cells or 0)
        )
        self._max_cells = int(max_cells or 0)

    def solve(
        self,
        candidates: Sequence[Candidate],
        must_free_bytes: int,
        offload_window_s: float,
        reload_window_s: float,
        offload_setup_s: float = 0.0,
    ) -> Plan:
        """Choose KEEP / OFFLOAD / RECOMPUTE per candidate.

        Args:
            candidates: ops that may be released; keys must be unique.
            must_free_bytes: bytes the plan must release; ``<= 0`` returns all KEEP at once.
            offload_window_s: forward compute time that hides D2H copies (``>= 0``, may be inf).
            reload_window_s: backward compute time that hides H2D copies (``>= 0``, may be inf).
            offload_setup_s: exposed seconds a plan pays once if it offloads anything (``>= 0``;
                a micro-batch's first offload costs more than its own copy).

        Returns:
            The plan of least exposed time freeing at least ``must_free_bytes``; see
            :class:`Plan` for the infeasible case.

        Raises:
            ValueError: negative or non-finite sizes or times, NaN windows, duplicate keys.
        """
        if not offload_setup_s >= 0.0 or math.isinf(offload_setup_s):
            raise ValueError(f"offload_setup_s={offload_setup_s} must be a finite number >= 0")
        plan = self._solve(candidates, must_free_bytes, offload_window_s, reload_window_s)
        if offload_setup_s == 0.0 or not any(c == Choice.OFFLOAD for c in plan.choices.values()):
            return plan
        # The best plan offloads: it pays the setup. Any other plan that offloads costs at least
        # as much, so the best is it or the best plan that offloads nothing, which is solved
        # only when it can free enough (an infeasible plan releases all it can: as much) and
        # its cost's lower bound does not already exceed the first.
        plan = replace(plan, exposed_s=plan.exposed_s + offload_setup_s,
                       bound_s=plan.bound_s + offload_setup_s)
        need = int(must_free_bytes) if plan.feasible else plan.freed_bytes
        if _recompute_bound(candidates, need) > plan.exposed_s:
            return plan
        # At the first plan's byte quantum: with no time axes the DP would spend every state on
        # finer bytes (about twice the time), past what the first plan was exact to anyway.
        coarse = Planner(plan.quantum_bytes, max_cells=self._max_cells or None)
        alt = coarse._solve(candidates, must_free_bytes, offload_window_s, reload_window_s, offload=False)
        enough = alt.feasible or (not plan.feasible and alt.freed_bytes >= plan.freed_bytes)
        return alt if enough and alt.exposed_s <= plan.exposed_s else plan

    def _solve(self, candidates: Sequence[Candidate], must_free_bytes: int, offload_window_s: float,
               reload_window_s: float, offload: bool = True) -> Plan:
        must = int(must_free_bytes)
        if must <= 0:
            choices = {c.key: Choice.KEEP for c in candidates}
            if len(choices) != len(candidates):
                seen: set = set()
                dup = next(c.key for c in candidates if c.key in seen or seen.add(c.key))
                raise ValueError(f"duplicate candidate key {dup!r}")
            return Plan(choices=choices)
        keys = [c.key for c in candidates]
        solved = (
            self._impl.solve_columns(
                keys,
                [c.nbytes for c in candidates],
                [c.recompute_s for c in candidates],
                [c.offload_s for c in candidates],
                [c.reload_s for c in candidates],
                [c.can_offload for c in candidates] if offload else [False] * len(candidates),
                [c.can_recompute for c in candidates],
                must,
                float(offload_window_s),
                float(reload_window_s),
            )
        )
        return Plan(
            choices={k: _CHOICES[c] for k, c in zip(keys, solved.choices)},
            feasible=solved.feasible,
            freed_bytes=solved.freed_bytes,
            shortfall_bytes=solved.shortfall_bytes,
            exposed_s=solved.exposed_s,
            bound_s=solved.bound_s,
            quantum_bytes=solved.quantum_bytes,
            offload_quantum_s=solved.offload_quantum_s,
            reload_quantum_s=solved.reload_quantum_s,
        )

    @staticmethod
    def exposed_time(
        candidates: Sequence[Candidate],
        choices: Mapping[str, Choice],
        offload_window_s: float,
        reload_window_s: float,
        offload_setup_s: float = 0.0,
    ) -> float:
        """Exact exposed time of any assignment (the objective the planner minimizes)."""
        rec = off = rel = 0.0
        offloads = False
        for c in candidates:
            ch = choices.get(c.key, Choice.KEEP)
            if ch == Choice.RECOMPUTE:
                rec += c.recompute_s
            elif ch == Choice.OFFLOAD:
                offloads = True
                off += c.offload_s
                rel += c.reload_s
        return (rec + max(0.0, off - offload_window_s) + max(0.0, rel - reload_window_s)
                + (offload_setup_s if offloads else 0.0))


def _recompute_bound(candidates: Sequence[Candidate], need: int) -> float:
    """A lower bound on the exposed time of freeing ``need`` bytes by recomputing alone: the
    cheapest seconds per byte first, the last one in part (inf when they cannot free it)."""
    if need <= 0:
        return 0.0
    items = sorted((c.recompute_s / c.nbytes, c.nbytes) for c in candidates if c.can_recompute and c.nbytes > 0)
    bound = 0.0
    for per_byte, nbytes in items:
        take = min(nbytes, need)
        bound += per_byte * take
        need -= take
        if need <= 0:
            return bound
    return math.inf
