"""The C++ planner held to the pure-Python reference DP (bagualu2/plan/reference.py, docs/planner.md)
on random instances.

Where the C++ planner rounds nothing (every byte size a multiple of the byte quantum it picked,
each copy window zero, infinite or wide enough for all its copies) and no setup cost is paid, it
returns the reference's plan choice for choice: times here are multiples of 1/16 s, so every sum
is exact in floating point and ties are ties in both. Elsewhere it may return another plan; then
both are feasible alike, free enough, and the C++ plan's exposed time lies between the
reference's optimum and that optimum plus the rounding bound of csrc/sched/planner.h
(invariant 4): (offloads of the reference's plan + 1) x (offload quantum + reload quantum).
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bagualu2.plan import reference
from bagualu2.plan.planner import Candidate, Choice, Planner

TIMES = st.integers(0, 64).map(lambda i: i / 16)  # 0 to 4 s in sixteenths: sums are exact


@st.composite
def instances(draw, max_ops: int = 6):
    unit = draw(st.sampled_from([1, 3, 4096]))
    cands = [
        Candidate(key=f"op{i}", nbytes=draw(st.integers(0, 7)) * unit, recompute_s=draw(TIMES),
                  offload_s=draw(TIMES), reload_s=draw(TIMES), can_offload=draw(st.booleans()),
                  can_recompute=draw(st.booleans()))
        for i in range(draw(st.integers(0, max_ops)))
    ]
    total = sum(c.nbytes for c in cands)
    must = draw(st.integers(-1, total + 2 * unit))
    windows = st.one_of(st.just(0.0), st.just(math.inf), TIMES, TIMES.map(lambda t: 4 * t))
    setup = draw(st.one_of(st.just(0.0), TIMES))
    return cands, must, draw(windows), draw(windows), setup


def releasable(cands):
    return [c for c in cands if c.nbytes > 0 and (c.can_offload or c.can_recompute)]


def check_against_reference(cands, must, wf, wb, setup):
    plan = Planner().solve(cands, must, wf, wb, setup)
    ref = reference.solve(cands, must, wf, wb, setup)
    tol = 1e-9 * (1.0 + ref.exposed_s)

    assert (plan.feasible, plan.shortfall_bytes) == (ref.feasible, ref.shortfall_bytes)
    assert ref.exposed_s == pytest.approx(Planner.exposed_time(cands, ref.choices, wf, wb, setup))
    target = min(must, sum(c.nbytes for c in releasable(cands)))
    assert plan.freed_bytes >= target and ref.freed_bytes >= target
    # The reference is optimal, so no plan that frees enough is cheaper.
    assert plan.exposed_s >= ref.exposed_s - tol

    sizes = [c.nbytes for c in releasable(cands)]
    bytes_exact = not plan.feasible or all(n % plan.quantum_bytes == 0 for n in sizes)
    if not bytes_exact or must <= 0:
        return
    quanta = plan.offload_quantum_s + plan.reload_quantum_s
    offloads = sum(1 for x in ref.choices.values() if x == Choice.OFFLOAD)
    assert plan.exposed_s <= ref.exposed_s + (offloads + 1) * quanta + tol
    if quanta == 0.0 and setup == 0.0:
        assert plan.choices == ref.choices
        assert plan.exposed_s == ref.exposed_s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_the_cpp_planner_meets_the_reference_on_random_instances(inst):
    check_against_reference(*inst)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_ops=8))
def test_the_cpp_planner_meets_the_reference_on_many_random_instances(inst):
    check_against_reference(*inst)


def test_the_reference_reads_as_the_objective_on_a_small_case():
    # 10 bytes: offloading a hides in both windows. 20: both offloaded, their reloads 2 s over the
    # backward window, beat recomputing a (1 s) beside b's reload (1.5 s over).
    cands = [Candidate("a", 10, 1.0, 0.5, 0.5), Candidate("b", 10, 3.0, 0.5, 2.5)]
    ref = reference.solve(cands, 10, offload_window_s=1.0, reload_window_s=1.0)
    assert ref.choices == {"a": Choice.OFFLOAD, "b": Choice.KEEP} and ref.exposed_s == 0.0
    ref = reference.solve(cands, 20, offload_window_s=1.0, reload_window_s=1.0)
    assert ref.choices == {"a": Choice.OFFLOAD, "b": Choice.OFFLOAD} and ref.exposed_s == 2.0
    assert Planner().solve(cands, 20, 1.0, 1.0).choices == ref.choices
    short = reference.solve(cands, 30, 1.0, 1.0)
    assert not short.feasible and short.shortfall_bytes == 10 and short.freed_bytes == 20
    with pytest.raises(ValueError, match="duplicate"):
        reference.solve([cands[0], cands[0]], 10, 1.0, 1.0)
