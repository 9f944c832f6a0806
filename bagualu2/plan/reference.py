"""The planner's dynamic program in pure Python: the reference the C++ planner is held to.

Objective (docs/planner.md): one :class:`Choice` per candidate, KEEP, OFFLOAD or RECOMPUTE,
minimizing the *exposed time*

    sum(recompute_s of RECOMPUTE)
    + max(0, sum(offload_s of OFFLOAD) - offload_window_s)
    + max(0, sum(reload_s of OFFLOAD) - reload_window_s)
    + offload_setup_s if anything is offloaded

subject to freeing at least ``must_free_bytes`` (the bytes of the candidates not kept). When
even releasing every releasable candidate frees too little, the plan is infeasible and releases
every one of them at the least exposed time (the best effort), as the C++ planner does.

The DP walks the candidates in order. Its state is the bytes still to free (0 once the target is
met: from then on every candidate is kept, as releasing more only adds time); its value is the
set of partial plans that reach that state, each with its sums of recompute, offload and reload
seconds. A partial plan is dropped when another in the same state is no worse on all three sums
and comes first in the order below: no completion of it could win. This is exact, with no
rounding of bytes or times, and small instances only (the number of partial plans may grow as
3^n); the C++ planner (``bagualu2.plan.planner``, csrc/sched/planner.cpp) rounds bytes and copy
times to bound its tables and is held to this one by tests/test_planner_reference.py.

Ties: among plans of least exposed time the reference returns the first in candidate order
with KEEP before OFFLOAD before RECOMPUTE (compared at the first candidate where two plans
differ), the same preference the C++ DP's cells have. Where the C++ planner rounds, or where a
setup cost makes an offloading plan tie with one that offloads nothing, it may return another
plan of the same exposed time; the test then compares exposed times and feasibility.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Sequence, Tuple

from bagualu2.plan.planner import Candidate
from bagualu2.shared import Choice

__all__ = ["ReferencePlan", "exposed_time", "solve"]


@dataclass(frozen=True)
class ReferencePlan:
    """The reference's answer, in the fields :class:`bagualu2.plan.planner.Plan` has.

    Attributes:
        choices: key -> choice, in candidate order.
        feasible: whether releasing every releasable candidate frees ``must_free_bytes``.
        freed_bytes: bytes of the candidates not kept.
        shortfall_bytes: ``max(0, must_free_bytes - bytes of all releasable candidates)``.
        exposed_s: the objective (module note) of ``choices``.
    """

    choices: Dict[str, Choice]
    feasible: bool
    freed_bytes: int
    shortfall_bytes: int
    exposed_s: float


class _Partial(NamedTuple):
    """A plan of the candidates seen so far: its three sums, whether it offloads anything (it
    then pays the setup), and its choices (Choice values, in candidate order)."""

    rec: float
    off: float
    rel: float
    offloads: bool
    picks: Tuple[int, ...]


def exposed_time(rec: float, off: float, rel: float, offload_window_s: float,
                 reload_window_s: float, offload_setup_s: float = 0.0, offloads: bool = False) -> float:
    """The objective from a plan's sums of recompute, offload and reload seconds."""
    return (rec + max(0.0, off - offload_window_s) + max(0.0, rel - reload_window_s)
            + (offload_setup_s if offloads else 0.0))


def _releasable(c: Candidate) -> bool:
    """A candidate frees bytes only if it has some and may leave the device one way or the other."""
    return c.nbytes > 0 and (c.can_offload or c.can_recompute)


def _moves(c: Candidate) -> List[Tuple[Choice, float, float, float]]:
    """The choices open to ``c``, KEEP first, with what each adds to (rec, off, rel)."""
    moves = [(Choice.KEEP, 0.0, 0.0, 0.0)]
    if _releasable(c) and c.can_offload:
        moves.append((Choice.OFFLOAD, 0.0, c.offload_s, c.reload_s))
    if _releasable(c) and c.can_recompute:
        moves.append((Choice.RECOMPUTE, c.recompute_s, 0.0, 0.0))
    return moves


def _add(front: List[_Partial], new: _Partial) -> None:
    """Put ``new`` into one state's partial plans, dropping those it makes useless.

    ``a`` makes ``b`` useless when ``a`` is no worse on every sum, offloads only if ``b`` does
    (the setup), and comes first (``a.picks < b.picks``): any completion then costs ``a`` at most
    what it costs ``b``, and ``a`` wins ties. Partial plans of one state have equal length, so
    the tuples compare at the first candidate where they differ."""
    def useless(b: _Partial, a: _Partial) -> bool:
        return (a.rec <= b.rec and a.off <= b.off and a.rel <= b.rel
                and (b.offloads or not a.offloads) and a.picks < b.picks)

    if any(useless(new, a) for a in front):
        return
    front[:] = [b for b in front if not useless(b, new)]
    front.append(new)


def solve(candidates: Sequence[Candidate], must_free_bytes: int, offload_window_s: float,
          reload_window_s: float, offload_setup_s: float = 0.0) -> ReferencePlan:
    """The plan of least exposed time that frees ``must_free_bytes`` (module note).

    Raises:
        ValueError: duplicate candidate keys.
    """
    keys = [c.key for c in candidates]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate candidate keys")
    releasable = sum(c.nbytes for c in candidates if _releasable(c))
    shortfall = max(0, int(must_free_bytes) - releasable)
    if must_free_bytes <= 0:
        return ReferencePlan({k: Choice.KEEP for k in keys}, True, 0, 0, 0.0)
    target = min(int(must_free_bytes), releasable)  # infeasible: release everything releasable

    # state (bytes still to free) -> partial plans reaching it
    states: Dict[int, List[_Partial]] = {target: [_Partial(0.0, 0.0, 0.0, False, ())]}
    for c in candidates:
        after: Dict[int, List[_Partial]] = {}
        for need, front in states.items():
            for p in front:
                for choice, rec, off, rel in (_moves(c) if need > 0 else _moves(c)[:1]):
                    left = need if choice == Choice.KEEP else max(0, need - c.nbytes)
                    _add(after.setdefault(left, []),
                         _Partial(p.rec + rec, p.off + off, p.rel + rel,
                                  p.offloads or choice == Choice.OFFLOAD, p.picks + (int(choice),)))
        states = after

    def cost(p: _Partial) -> float:
        return exposed_time(p.rec, p.off, p.rel, offload_window_s, reload_window_s,
                            offload_setup_s, p.offloads)

    best = min(states[0], key=lambda p: (cost(p), p.picks))  # state 0 is reached: target <= releasable
    choices = {k: Choice(x) for k, x in zip(keys, best.picks)}
    freed = sum(c.nbytes for c in candidates if choices[c.key] != Choice.KEEP)
    return ReferencePlan(choices, shortfall == 0, freed, shortfall, cost(best))
