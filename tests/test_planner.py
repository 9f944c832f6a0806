"""Planner invariants (csrc/sched/planner.h): exactness in bytes, conservative time estimates,
optimality against brute force of the same objective, instant all-KEEP, clear input errors."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bagualu2.plan.planner import Candidate, Choice, Plan, Planner

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- brute force of the objective
def enumerate_plans(cands):
    """Every allowed assignment (up to 3^n rows), built one op at a time: exact freed bytes,
    released/offloaded counts and the recompute/offload/reload sums of each assignment."""
    t = dict(freed=np.zeros(1, np.int64), k_released=np.zeros(1, np.int64),
             k_offloaded=np.zeros(1, np.int64), rec=np.zeros(1), off=np.zeros(1), rel=np.zeros(1))
    for c in cands:
        branches = [dict(t)]  # KEEP
        if c.can_offload:
            branches.append(dict(t, freed=t["freed"] + c.nbytes, k_released=t["k_released"] + 1,
                                 k_offloaded=t["k_offloaded"] + 1, off=t["off"] + c.offload_s,
                                 rel=t["rel"] + c.reload_s))
        if c.can_recompute:
            branches.append(dict(t, freed=t["freed"] + c.nbytes, k_released=t["k_released"] + 1,
                                 rec=t["rec"] + c.recompute_s))
        t = {k: np.concatenate([b[k] for b in branches]) for k in t}
    return t


def exposure(table, wf, wb):
    return table["rec"] + np.maximum(0.0, table["off"] - wf) + np.maximum(0.0, table["rel"] - wb)


def exposed_of(plan, cands, wf, wb):
    """Independent recomputation of the contract's objective for a plan."""
    rec = sum(c.recompute_s for c in cands if plan[c.key] == Choice.RECOMPUTE)
    off = sum(c.offload_s for c in cands if plan[c.key] == Choice.OFFLOAD)
    rel = sum(c.reload_s for c in cands if plan[c.key] == Choice.OFFLOAD)
    return rec + max(0.0, off - wf) + max(0.0, rel - wb)


def releasable_bytes(cands):
    return sum(c.nbytes for c in cands if c.can_offload or c.can_recompute)


def check_plan_basics(plan, cands, must, wf, wb):
    """Invariants that hold for every plan: exact feasibility, exact accounting, permissions."""
    total = releasable_bytes(cands)
    assert plan.feasible == (total >= must)
    assert plan.shortfall_bytes == max(0, must - total)
    assert plan.freed_bytes == sum(c.nbytes for c in cands if plan[c.key] != Choice.KEEP)
    if plan.feasible:
        assert plan.freed_bytes >= must  # feasible in exact bytes, whatever the rounding
    else:  # best effort: every releasable op with bytes is released
        assert all(plan[c.key] != Choice.KEEP for c in cands
                   if c.nbytes > 0 and (c.can_offload or c.can_recompute))
    for c in cands:
        assert plan[c.key] != Choice.OFFLOAD or c.can_offload
        assert plan[c.key] != Choice.RECOMPUTE or c.can_recompute
    assert plan.exposed_s == pytest.approx(exposed_of(plan, cands, wf, wb), rel=1e-12, abs=1e-12)
    assert plan.bound_s >= plan.exposed_s - 1e-9 * (1 + plan.exposed_s)  # never underestimates


# ---------------------------------------------------------------- strategies
@st.composite
def integer_instances(draw, max_ops=12):
    """Sizes multiples of the byte quantum, times and windows multiples of 1 s."""
    q = draw(st.sampled_from([1, 8, 512]))
    n = draw(st.integers(1, max_ops))
    cands = []
    for i in range(n):
        cands.append(Candidate(
            key=f"op{i}",
            nbytes=q * draw(st.integers(0, 16)),
            recompute_s=float(draw(st.integers(0, 12))),
            offload_s=float(draw(st.integers(0, 8))),
            reload_s=float(draw(st.integers(0, 8))),
            can_offload=draw(st.booleans() | st.just(True)),
            can_recompute=draw(st.booleans() | st.just(True)),
        ))
    total = sum(c.nbytes for c in cands)
    must = draw(st.integers(-q, total + 2 * q))
    wf = float(draw(st.integers(0, 24)))
    wb = float(draw(st.integers(0, 24)))
    return q, cands, must, wf, wb


@st.composite
def real_instances(draw, max_ops=12, max_bytes=10**7):
    """Arbitrary byte counts and real-valued times: quantization is inexact here."""
    n = draw(st.integers(1, max_ops))
    time = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)
    cands = [
        Candidate(
            key=f"op{i}",
            nbytes=draw(st.integers(0, max_bytes)),
            recompute_s=draw(time),
            offload_s=draw(time),
            reload_s=draw(time),
            can_offload=draw(st.booleans() | st.just(True)),
            can_recompute=draw(st.booleans() | st.just(True)),
        )
        for i in range(n)
    ]
    total = sum(c.nbytes for c in cands)
    must = draw(st.integers(1, max(1, total + 1000)))
    off_total = sum(c.offload_s for c in cands)
    rel_total = sum(c.reload_s for c in cands)
    wf = draw(st.floats(0.0, 1.2)) * off_total
    wb = draw(st.floats(0.0, 1.2)) * rel_total
    return cands, must, wf, wb


# ---------------------------------------------------------------- optimality
@SETTINGS
@given(integer_instances())
def test_dp_is_exactly_optimal_when_sizes_and_times_are_multiples_of_the_quanta(inst):
    q, cands, must, wf, wb = inst
    plan = Planner(q, time_quantum_s=1.0, max_cells=1 << 17).solve(cands, must, wf, wb)
    check_plan_basics(plan, cands, must, wf, wb)
    if must <= 0:
        assert all(c == Choice.KEEP for c in plan.choices.values())
        return
    # the requested quanta were really used, so this test cannot pass vacuously
    if plan.feasible:
        assert plan.quantum_bytes == q
    assert plan.offload_quantum_s in (0.0, 1.0) and plan.reload_quantum_s in (0.0, 1.0)
    table = enumerate_plans(cands)
    exp = exposure(table, wf, wb)
    need = must if plan.feasible else releasable_bytes(cands)
    best = exp[table["freed"] >= need].min()
    assert plan.exposed_s == pytest.approx(best, abs=1e-9)
    assert plan.bound_s == pytest.approx(best, abs=1e-9)  # no quantization loss at all


def test_a_window_too_small_to_cut_into_quanta_counts_as_none() -> None:
    """A reload window so small that a quantum of it would be subnormal made the DP find no
    feasible state: all-keep, called feasible, freeing nothing (hypothesis found it)."""
    plan = Planner(None).solve([Candidate("op0", 1, 0.0, 1.0, 1.1125e-308, True, False)], 1, 0.5, 5.56e-309)
    assert plan.feasible and plan.freed_bytes == 1 and plan.choices["op0"] == Choice.OFFLOAD
    assert math.isfinite(plan.bound_s)


@SETTINGS
@given(real_instances(), st.sampled_from([None, 256, 4096]), st.sampled_from([None, 1, 1000]))
def test_dp_gap_is_within_the_proven_quantization_bound(inst, max_cells, quantum_bytes):
    """Invariant 4 of planner.h: for every plan X freeing >= must + k_X * q_b exact bytes,
    exposed(dp) <= exposed(X) + (offloaded_X + 1) * (q_offload + q_reload)."""
    cands, must, wf, wb = inst
    plan = Planner(quantum_bytes, max_cells=max_cells).solve(cands, must, wf, wb)
    check_plan_basics(plan, cands, must, wf, wb)
    table = enumerate_plans(cands)
    exp = exposure(table, wf, wb)
    assert plan.exposed_s >= exp[table["freed"] >= min(must, releasable_bytes(cands))].min() - 1e-9
    qt = plan.offload_quantum_s + plan.reload_quantum_s
    slack = (table["k_offloaded"] + 1) * qt + 1e-9
    if plan.feasible:
        covered = table["freed"] >= must + table["k_released"] * plan.quantum_bytes
    else:  # best effort: compared against every plan that releases all releasable bytes
        covered = table["freed"] == releasable_bytes(cands)
    if covered.any():
        assert plan.exposed_s <= (exp + slack)[covered].min()


@SETTINGS
@given(real_instances(), st.floats(0.25, 4.0), st.sampled_from([None, 256]))
def test_proportional_copy_times_fold_both_windows_and_keep_the_bound(inst, rho, max_cells):
    """reload_s = rho * offload_s for every op: one time axis, reload quantum = rho * offload
    quantum, and the invariant-4 bound still holds with the reported quanta."""
    cands, must, _, _ = inst
    cands = [Candidate(c.key, c.nbytes, c.recompute_s, c.offload_s + 0.01,
                       rho * (c.offload_s + 0.01), c.can_offload, c.can_recompute)
             for c in cands]
    wf = 0.3 * sum(c.offload_s for c in cands if c.can_offload)
    wb = 0.5 * sum(c.reload_s for c in cands if c.can_offload)
    plan = Planner(max_cells=max_cells).solve(cands, must, wf, wb)
    check_plan_basics(plan, cands, must, wf, wb)
    if plan.offload_quantum_s > 0 and plan.reload_quantum_s > 0:
        assert plan.reload_quantum_s == pytest.approx(rho * plan.offload_quantum_s, rel=1e-9)
    table = enumerate_plans(cands)
    exp = exposure(table, wf, wb)
    slack = (table["k_offloaded"] + 1) * (plan.offload_quantum_s + plan.reload_quantum_s) + 1e-9
    if plan.feasible:
        covered = table["freed"] >= must + table["k_released"] * plan.quantum_bytes
    else:
        covered = table["freed"] == releasable_bytes(cands)
    if covered.any():
        assert plan.exposed_s <= (exp + slack)[covered].min()


@SETTINGS
@given(real_instances(max_ops=8, max_bytes=10**4))
def test_dp_is_exact_when_no_window_needs_quantizing(inst):
    """Windows of 0 (everything exposed) or covering all copies are handled without a time
    axis, and sizes with a common divisor without byte rounding: then the DP is exact."""
    cands, must, wf, wb = inst
    for wf_, wb_ in [(0.0, 0.0), (math.inf, 0.0), (0.0, math.inf), (math.inf, math.inf)]:
        plan = Planner(max_cells=1 << 17).solve(cands, must, wf_, wb_)
        check_plan_basics(plan, cands, must, wf_, wb_)
        assert plan.offload_quantum_s == 0.0 and plan.reload_quantum_s == 0.0
        table = enumerate_plans(cands)
        exp = exposure(table, wf_, wb_)
        need = must if plan.feasible else releasable_bytes(cands)
        assert plan.exposed_s == pytest.approx(exp[table["freed"] >= need].min(), abs=1e-9)


@SETTINGS
@given(integer_instances(), st.integers(0, 12))
def test_a_setup_paid_once_for_any_offload_is_optimal_against_brute_force(inst, setup):
    """With ``offload_setup_s``, the objective gains the setup for every plan that offloads
    anything: the planner's plan is still the best of all plans, and its exposed time counts
    the setup exactly when it offloads."""
    q, cands, must, wf, wb = inst
    plan = Planner(q, time_quantum_s=1.0, max_cells=1 << 17).solve(cands, must, wf, wb, float(setup))
    offloads = any(plan[c.key] == Choice.OFFLOAD for c in cands)
    assert plan.exposed_s == pytest.approx(exposed_of(plan, cands, wf, wb) + (setup if offloads else 0.0))
    assert plan.exposed_s == pytest.approx(Planner.exposed_time(cands, plan.choices, wf, wb, float(setup)))
    if must <= 0:
        return
    table = enumerate_plans(cands)
    exp = exposure(table, wf, wb) + np.where(table["k_offloaded"] > 0, float(setup), 0.0)
    need = must if plan.feasible else releasable_bytes(cands)
    assert plan.exposed_s == pytest.approx(exp[table["freed"] >= need].min(), abs=1e-9)


def test_a_setup_cost_turns_a_single_cheap_offload_into_a_recompute():
    cands = [Candidate("a", 100, recompute_s=2.0, offload_s=0.25, reload_s=0.5),
             Candidate("b", 100, recompute_s=3.0, offload_s=0.5, reload_s=0.5)]
    assert Planner().solve(cands, 100, 0.0, 0.0)["a"] == Choice.OFFLOAD
    plan = Planner().solve(cands, 100, 0.0, 0.0, offload_setup_s=1.5)
    assert plan.choices == {"a": Choice.RECOMPUTE, "b": Choice.KEEP} and plan.exposed_s == 2.0
    both = Planner().solve(cands, 200, 0.0, 0.0, offload_setup_s=1.5)  # 1.5 + 0.75 + 1 < 2 + 3
    assert both.choices == {"a": Choice.OFFLOAD, "b": Choice.OFFLOAD} and both.exposed_s == 3.25
    with pytest.raises(ValueError, match="offload_setup_s=-1"):
        Planner().solve(cands, 100, 0.0, 0.0, offload_setup_s=-1.0)


# ---------------------------------------------------------------- behaviour
def test_nothing_to_free_returns_all_keep_without_solving():
    cands = [Candidate(f"op{i}", 100, 1.0, 1.0, 1.0) for i in range(64)]
    for must in (0, -5):
        plan = Planner().solve(cands, must, 0.0, 0.0)
        assert plan.feasible and plan.freed_bytes == 0 and plan.exposed_s == 0.0
        assert plan.mix() == {Choice.KEEP: 64, Choice.OFFLOAD: 0, Choice.RECOMPUTE: 0}


def test_infeasible_plan_names_the_shortfall_and_releases_everything():
    cands = [Candidate("a", 100, 1.0, 0.1, 0.1), Candidate("b", 50, 0.2, 1.0, 1.0),
             Candidate("c", 70, 1.0, 1.0, 1.0, can_offload=False, can_recompute=False)]
    plan = Planner().solve(cands, 1000, 0.5, 0.5)
    assert not plan.feasible and plan.shortfall_bytes == 850 and plan.freed_bytes == 150
    assert plan["a"] == Choice.OFFLOAD and plan["b"] == Choice.RECOMPUTE and plan["c"] == Choice.KEEP


def test_hidden_copies_are_preferred_and_overflow_goes_to_recompute():
    # both fit in the windows only one at a time: the second is recomputed (cheaper than overflow)
    cands = [Candidate("x", 10, 5.0, 1.0, 1.0), Candidate("y", 10, 0.5, 1.0, 1.0)]
    plan = Planner().solve(cands, 20, 1.0, 1.0)
    assert plan.choices == {"x": Choice.OFFLOAD, "y": Choice.RECOMPUTE}
    assert plan.exposed_s == pytest.approx(0.5)


def test_plan_lookup_api():
    cands = [Candidate("a", 10, 1.0, 0.0, 0.0)]
    plan = Planner().solve(cands, 5, 0.0, 0.0)
    assert plan["a"] == Choice.OFFLOAD and plan.get("a") == Choice.OFFLOAD
    assert plan.get("unknown") == Choice.KEEP and plan.get("unknown", Choice.RECOMPUTE) == 2
    assert "a" in plan and list(plan) == ["a"] and len(plan) == 1
    assert isinstance(plan, Plan) and plan.mix()[Choice.OFFLOAD] == 1
    assert Planner.exposed_time(cands, plan.choices, 0.0, 0.0) == plan.exposed_s


def test_byte_rounding_never_makes_a_plan_short():
    # sizes just below the quantum: rounding down makes them worth nothing in the DP, and the
    # fallback still returns a plan freeing enough exact bytes
    cands = [Candidate(f"op{i}", 999, 1.0, 1.0, 1.0) for i in range(4)]
    plan = Planner(quantum_bytes=1000).solve(cands, 2000, 0.0, 0.0)
    assert plan.feasible and plan.freed_bytes >= 2000


def test_sixty_four_candidates_with_large_sizes_solve():
    rng = np.random.default_rng(0)
    cands = [Candidate(f"op{i}", int(rng.integers(1 << 20, 1 << 26)), float(rng.random()),
                       float(rng.random()) * 0.3, float(rng.random()) * 0.3) for i in range(64)]
    total = sum(c.nbytes for c in cands)
    plan = Planner().solve(cands, total // 2, 2.0, 2.0)
    assert plan.feasible and plan.freed_bytes >= total // 2
    assert plan.bound_s >= plan.exposed_s * (1 - 1e-12)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("nbytes", -1, r"nbytes must be >= 0, got -1"),
        ("recompute_s", float("nan"), r"recompute_s must be finite and >= 0, got nan"),
        ("offload_s", -0.5, r"offload_s must be finite and >= 0, got -0.5"),
        ("reload_s", float("inf"), r"reload_s must be finite and >= 0, got inf"),
    ],
)
def test_invalid_candidate_values_are_named(field, value, match):
    args = dict(key="bad_op", nbytes=10, recompute_s=1.0, offload_s=1.0, reload_s=1.0)
    args[field] = value
    with pytest.raises(ValueError, match="candidate 'bad_op': " + match):
        Planner().solve([Candidate(**args)], 5, 1.0, 1.0)


def test_duplicate_keys_and_bad_windows_are_rejected():
    dup = [Candidate("same", 1, 0.0, 0.0, 0.0), Candidate("same", 2, 0.0, 0.0, 0.0)]
    with pytest.raises(ValueError, match="duplicate candidate key 'same'"):
        Planner().solve(dup, 1, 0.0, 0.0)
    with pytest.raises(ValueError, match="duplicate candidate key 'same'"):
        Planner().solve(dup, 0, 0.0, 0.0)
    ok = [Candidate("a", 1, 0.0, 0.0, 0.0)]
    with pytest.raises(ValueError, match="offload_window_s must be >= 0, got -1"):
        Planner().solve(ok, 1, -1.0, 0.0)
    with pytest.raises(ValueError, match="reload_window_s must be >= 0, got nan"):
        Planner().solve(ok, 1, 0.0, float("nan"))
    with pytest.raises(ValueError, match="quantum_bytes must be >= 0"):
        Planner(-3)


def test_proportional_copy_times_use_one_folded_time_axis():
    cands = [Candidate(f"op{i}", 1000 + 37 * i, 0.01 * (i % 5 + 1), 0.001 * (i + 1),
                       0.002 * (i + 1)) for i in range(32)]
    plan = Planner().solve(cands, sum(c.nbytes for c in cands) // 2, 0.05, 0.08)
    assert plan.offload_quantum_s > 0
    assert plan.reload_quantum_s == pytest.approx(2 * plan.offload_quantum_s)
    assert plan.bound_s >= plan.exposed_s * (1 - 1e-12)
