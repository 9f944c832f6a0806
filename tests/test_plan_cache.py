"""PlanCache invariants (csrc/sched/plan_cache.h): keyed by the four-part context, bounded LRU,
thread-safe, stats that count every lookup."""
import threading

import pytest

from bagualu2.plan.planner import Candidate, Choice, Plan, PlanCache, Planner, load_bucket


def make_plan(tag: int) -> Plan:
    return Plan(choices={f"op{tag}": Choice.OFFLOAD}, freed_bytes=tag)


def test_lookup_is_keyed_by_all_four_context_fields():
    cache = PlanCache(capacity=16)
    plan = make_plan(1)
    cache.put(3, 7, 1, 2, plan)
    assert cache.get(3, 7, 1, 2) is plan  # the stored object itself, no copy
    for other in [(4, 7, 1, 2), (3, 8, 1, 2), (3, 7, 0, 2), (3, 7, 1, 3)]:
        assert cache.get(*other) is None
    s = cache.stats()
    assert (s["hits"], s["misses"], s["size"]) == (1, 4, 1)
    assert s["hit_rate"] == pytest.approx(0.2)
    assert s["mean_lookup_us"] > 0


def test_capacity_bound_evicts_least_recently_used():
    cache = PlanCache(capacity=3)
    for i in range(3):
        cache.put(i, 0, 0, 0, make_plan(i))
    assert cache.get(0, 0, 0, 0) is not None  # 0 becomes most recent; 1 is now the oldest
    cache.put(3, 0, 0, 0, make_plan(3))
    assert len(cache) == 3 and cache.capacity == 3
    assert not cache.contains(1, 0, 0, 0)
    assert all(cache.contains(i, 0, 0, 0) for i in (0, 2, 3))
    assert cache.stats()["evictions"] == 1


def test_put_replaces_an_existing_entry_without_growing():
    cache = PlanCache(capacity=2)
    cache.put(0, 0, 0, 0, make_plan(1))
    cache.put(0, 0, 0, 0, make_plan(2))
    assert len(cache) == 1 and cache.get(0, 0, 0, 0).freed_bytes == 2


def test_stats_reset_and_clear():
    cache = PlanCache(capacity=4)
    cache.put(0, 0, 0, 0, make_plan(0))
    cache.get(0, 0, 0, 0)
    cache.get(1, 0, 0, 0)
    cache.reset_stats()
    assert cache.stats()["hits"] == 0 and cache.stats()["hit_rate"] == 0.0
    assert cache.contains(0, 0, 0, 0)  # entries survive a stats reset
    cache.clear()
    assert len(cache) == 0 and cache.get(0, 0, 0, 0) is None


def test_concurrent_puts_and_gets_keep_the_bound_and_count_every_lookup():
    cache = PlanCache(capacity=64)
    plans = [make_plan(i) for i in range(256)]
    n_threads, n_ops = 4, 2000

    def worker(tid: int) -> None:
        for i in range(n_ops):
            key = (i * 7 + tid) % 256
            if i % 3 == 0:
                cache.put(key, 0, 0, 0, plans[key])
            else:
                got = cache.get(key, 0, 0, 0)
                assert got is None or got is plans[key]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    lookups = sum(1 for i in range(n_ops) if i % 3 != 0) * n_threads
    assert s["hits"] + s["misses"] == lookups
    assert len(cache) <= 64


def test_cached_plan_round_trip_with_the_planner():
    planner, cache = Planner(), PlanCache()
    cands = [Candidate(f"op{i}", 1000 * (i + 1), 0.01, 0.002, 0.002) for i in range(8)]
    bucket = load_bucket(1.37)
    assert bucket == 14  # rounded up: the plan is solved for the bucket's worst case
    plan = planner.solve(cands, 5000, 0.004, 0.004)
    cache.put(layer=0, load_bucket=bucket, phase=1, budget_bucket=3, plan=plan)
    assert cache.get(0, bucket, 1, 3) is plan


def test_invalid_arguments():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        PlanCache(capacity=0)
    with pytest.raises(TypeError, match="expects a Plan"):
        PlanCache().put(0, 0, 0, 0, {"op": Choice.KEEP})
    with pytest.raises(ValueError, match="imbalance must be finite"):
        load_bucket(float("nan"))
