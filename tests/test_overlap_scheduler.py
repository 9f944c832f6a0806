"""Overlap scheduler invariants (csrc/sched/overlap_scheduler.h): optimal for its model against
brute force, dependencies respected in the issue order, budget held, merging stays valid,
infeasible budgets reported, schedules cached by key."""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bagualu2.plan.overlap import (OverlapOp, OverlapScheduler, OverlapTask, Schedule, TaskKind,
                              simulate)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def brute_force(ops, tasks, budget):
    """Least exposed time over every schedule of the model (reload issue points non-decreasing
    in consumer order, early recomputes a consumer-order prefix in non-decreasing bubbles)."""
    n = len(ops)
    rel = sorted((j for j, t in enumerate(tasks) if t.kind == TaskKind.RELOAD),
                 key=lambda j: (tasks[j].op, j))
    rec = sorted((j for j, t in enumerate(tasks) if t.kind == TaskKind.RECOMPUTE),
                 key=lambda j: (tasks[j].op, j))
    base_issue = [-1] * len(tasks)
    for j, t in enumerate(tasks):
        if t.kind == TaskKind.OFFLOAD:
            base_issue[j] = t.op
        if t.kind == TaskKind.RECOMPUTE:
            base_issue[j] = t.op - 1
    rel_choices = [range(tasks[j].earliest, tasks[j].op) for j in rel]
    bubbles = [b for b in range(n) if ops[b].bubble]
    rec_choices = [[None] + [b for b in bubbles if tasks[j].earliest <= b - 1 and b < tasks[j].op]
                   for j in rec]
    best = None
    for r_pts in itertools.product(*rel_choices):
        if list(r_pts) != sorted(r_pts):
            continue
        for c_pts in itertools.product(*rec_choices):
            early = [b is not None for b in c_pts]
            if early != sorted(early, reverse=True):
                continue
            placed = [b for b in c_pts if b is not None]
            if placed != sorted(placed):
                continue
            issue, flags = list(base_issue), [False] * len(tasks)
            for j, s in zip(rel, r_pts):
                issue[j] = s
            for j, b in zip(rec, c_pts):
                if b is not None:
                    issue[j], flags[j] = b - 1, True
            fits, exposed, _ = simulate(ops, tasks, Schedule(tuple(issue), tuple(flags), True, 0.0, 0),
                                        budget)
            if fits and (best is None or exposed < best):
                best = exposed
    return best


@st.composite
def instances(draw, max_ops=6, max_tasks=5):
    """Small stage sequences with integer times (exact float sums) and all three task kinds."""
    n = draw(st.integers(2, max_ops))
    ops = [OverlapOp(float(draw(st.integers(0, 4))), draw(st.integers(0, 8)), draw(st.booleans()))
           for _ in range(n)]
    tasks = []
    for _ in range(draw(st.integers(0, max_tasks))):
        kind = draw(st.sampled_from(list(TaskKind)))
        dur = float(draw(st.integers(0, 5)))
        nbytes = draw(st.integers(0, 6))
        if kind == TaskKind.OFFLOAD:
            tasks.append(OverlapTask(kind, draw(st.integers(0, n - 1)), dur, nbytes))
        else:
            consumer = draw(st.integers(1, n - 1))
            earliest = draw(st.integers(-1, consumer - 1))
            tasks.append(OverlapTask(kind, consumer, dur, nbytes, earliest))
    budget = draw(st.integers(0, 24))
    return ops, tasks, budget


def check_dependencies(ops, tasks, sched):
    """Invariant 2: every issue point respects producers, consumers, `earliest` and order."""
    order = sched.issue_order(tasks)
    assert sorted(order) == list(range(len(tasks)))
    points = [sched.issue_after[j] for j in order]
    assert points == sorted(points)  # the runtime walks ops once, issuing as it goes
    for j, t in enumerate(tasks):
        s = sched.issue_after[j]
        if t.kind == TaskKind.OFFLOAD:
            assert s == t.op  # after its producer
        else:
            assert t.earliest <= s < t.op  # before its consumer
    reloads = [j for j in order if tasks[j].kind == TaskKind.RELOAD]
    assert [tasks[j].op for j in reloads] == sorted(tasks[j].op for j in reloads)


@SETTINGS
@given(instances())
def test_dp_matches_brute_force_of_the_model(inst):
    ops, tasks, budget = inst
    sched = OverlapScheduler(merge=False).schedule(ops, tasks, budget)
    best = brute_force(ops, tasks, budget)
    assert sched.feasible == (best is not None)
    fits, exposed, peak = simulate(ops, tasks, sched, budget)
    if best is None:
        assert not fits
        return
    check_dependencies(ops, tasks, sched)
    assert fits and peak == sched.peak_bytes and peak <= budget
    assert sched.exposed_s == pytest.approx(exposed, abs=1e-9)  # prediction = reference model
    assert sched.exposed_s == pytest.approx(best, abs=1e-9)  # and optimal


@SETTINGS
@given(instances(max_ops=7))
def test_merged_schedule_is_valid_and_predicted_exactly(inst):
    ops, tasks, budget = inst
    merged = OverlapScheduler(merge=True).schedule(ops, tasks, budget)
    full = OverlapScheduler(merge=False).schedule(ops, tasks, budget)
    assert merged.merged_ops <= len(ops)
    if not merged.feasible:
        return
    check_dependencies(ops, tasks, merged)
    fits, exposed, peak = simulate(ops, tasks, merged, budget)
    assert fits and peak <= merged.peak_bytes  # merged memory is conservative
    assert merged.exposed_s == pytest.approx(exposed, abs=1e-9)
    assert full.feasible and merged.exposed_s >= full.exposed_s - 1e-9


def steady_state():
    """1F1B steady state: forward of micro-batch A (ops 0-3) then backward of micro-batch B
    (ops 4-7), with a bubble before the backward."""
    ops = [OverlapOp(1.0, 10), OverlapOp(1.0, 10), OverlapOp(1.0, 10), OverlapOp(1.0, 10),
           OverlapOp(2.0, 0, bubble=True),
           OverlapOp(2.0, 10), OverlapOp(2.0, 10), OverlapOp(2.0, 10)]
    tasks = [OverlapTask(TaskKind.OFFLOAD, 0, 1.5, 4),   # A's activation, produced by op 0
             OverlapTask(TaskKind.OFFLOAD, 2, 1.5, 4),
             OverlapTask(TaskKind.RELOAD, 5, 3.0, 4),    # B's activations for its backward
             OverlapTask(TaskKind.RELOAD, 7, 3.0, 4),
             OverlapTask(TaskKind.RECOMPUTE, 6, 1.5, 4)]
    return ops, tasks


def test_prefetch_and_bubble_recompute_hide_everything_with_room():
    ops, tasks = steady_state()
    sched = OverlapScheduler().schedule(ops, tasks, budget_bytes=30)
    assert sched.feasible and sched.exposed_s == 0.0
    assert sched.early[4] and ops[sched.issue_after[4] + 1].bubble
    check_dependencies(ops, tasks, sched)
    assert sched.at(0, tasks) == [0]  # the first offload right after its producer


def test_tight_budget_trades_prefetch_distance_for_stalls():
    ops, tasks = steady_state()
    roomy = OverlapScheduler().schedule(ops, tasks, 30)
    tight = OverlapScheduler().schedule(ops, tasks, 14)
    assert tight.feasible and tight.peak_bytes <= 14
    assert tight.exposed_s > roomy.exposed_s
    assert simulate(ops, tasks, tight, 14)[:2] == (True, pytest.approx(tight.exposed_s))


def test_impossible_budget_is_reported_with_the_lazy_schedule():
    ops, tasks = steady_state()
    sched = OverlapScheduler().schedule(ops, tasks, budget_bytes=5)
    assert not sched.feasible and sched.peak_bytes > 5
    assert [sched.issue_after[j] for j in (2, 3)] == [4, 6]  # right before each consumer


def test_schedules_are_cached_by_budget_state():
    ops, tasks = steady_state()
    sch = OverlapScheduler(cache_capacity=4)
    first = sch.schedule(ops, tasks, 30, cache_key=(0, 1, 1, 30))
    again = sch.schedule(ops, tasks, 30, cache_key=(0, 1, 1, 30))
    other = sch.schedule(ops, tasks, 14, cache_key=(0, 1, 1, 14))
    assert not first.cache_hit and again.cache_hit and not other.cache_hit
    assert again.issue_after == first.issue_after
    assert sch.cache_stats()["hits"] == 1 and sch.cache_stats()["misses"] == 2


def test_invalid_inputs_name_the_value():
    ops = [OverlapOp(1.0), OverlapOp(1.0)]
    with pytest.raises(ValueError, match="op 1: duration_s must be finite and >= 0, got -1"):
        OverlapScheduler().schedule([OverlapOp(1.0), OverlapOp(-1.0)], [], 10)
    with pytest.raises(ValueError, match="task 0: op 5 out of range"):
        OverlapScheduler().schedule(ops, [OverlapTask(TaskKind.RELOAD, 5, 1.0)], 10)
    with pytest.raises(ValueError, match="task 0: earliest 1 must be in \\[-1, consumer 1\\)"):
        OverlapScheduler().schedule(ops, [OverlapTask(TaskKind.RELOAD, 1, 1.0, 0, 1)], 10)
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        OverlapScheduler().schedule(ops, [], -1)
