"""HostArena invariants (csrc/offload/host_arena.h): each test names the one it defends."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import bagualu2_test_hooks as hooks  # tests/test_hooks.cpp: test-only Stream and HostFence
from bagualu2 import _C
from bagualu2.offload import HostArena

ALIGN = 256


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@pytest.fixture
def arena(backend: str) -> _C.HostArena:
    return _C.HostArena(1 << 20, backend)


# -- invariant 1: alignment, exact rounding, inside the reservation ----------------------------
def test_blocks_are_256_aligned_and_rounded_to_256_not_powers_of_two(arena):
    sizes = [1, 255, 256, 257, 1000, 3000, 4097, 65537]
    ptrs = [arena.allocate(n) for n in sizes]
    for n, p in zip(sizes, ptrs):
        assert p is not None and p % ALIGN == 0
        assert arena.block_size(p) == round_up(n), f"{n=} rounded to {arena.block_size(p)}"
    assert arena.stats()["in_use"] == sum(round_up(n) for n in sizes)


def test_blocks_never_overlap_and_stay_inside_the_reservation(arena):
    rng = random.Random(0)
    live = {}
    for _ in range(500):
        if live and rng.random() < 0.45:
            p = rng.choice(list(live))
            arena.free(p)
            del live[p]
        else:
            n = rng.randint(1, 20000)
            p = arena.allocate(n)
            if p is not None:
                live[p] = round_up(n)
        spans = sorted(live.items())
        for (a, na), (b, _) in zip(spans, spans[1:]):
            assert a + na <= b, "overlapping blocks"
        for p, n in spans:
            assert arena.base <= p and p + n <= arena.base + arena.capacity


# -- invariant 2: best fit ---------------------------------------------------------------------
def test_best_fit_takes_the_smallest_gap_that_fits(arena):
    # Layout: [A 4K][g1 8K][B 4K][g2 2K][C 4K][rest]
    a = arena.allocate(4096)
    g1 = arena.allocate(8192)
    b = arena.allocate(4096)
    g2 = arena.allocate(2048)
    c = arena.allocate(4096)
    assert None not in (a, b, c, g1, g2)
    arena.free(g1)
    arena.free(g2)
    assert arena.allocate(1500) == g2, "1.5K must go to the 2K gap, not the 8K one"
    assert arena.allocate(5000) == g1, "5K must go to the 8K gap, not the large tail"


# -- invariant 3: coalescing, exhaustion -------------------------------------------------------
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1)])
def test_free_neighbours_coalesce_into_one_block(arena, order):
    third = arena.capacity // 3 // ALIGN * ALIGN
    ptrs = [arena.allocate(third) for _ in range(3)]
    for i in order:
        arena.free(ptrs[i])
    s = arena.stats()
    assert s["largest_free_block"] == arena.capacity
    assert s["fragmentation"] == 0.0 and s["in_use"] == 0
    assert arena.allocate(arena.capacity) == arena.base


def test_exhaustion_returns_none_counts_it_and_leaves_the_arena_usable(arena):
    p = arena.allocate(arena.capacity - 1000)
    assert p is not None
    assert arena.allocate(4096) is None
    assert arena.allocate(arena.capacity + 1) is None
    assert arena.allocate(1 << 60) is None
    s = arena.stats()
    assert s["num_failed"] == 3 and s["in_use"] == round_up(arena.capacity - 1000)
    assert arena.allocate(512) is not None  # the tail still serves small requests
    arena.free(p)
    assert arena.stats()["largest_free_block"] >= arena.capacity - 1024


def test_fragmentation_reports_scattered_free_space(arena):
    ptrs = [arena.allocate(4096) for _ in range(arena.capacity // 4096)]
    for p in ptrs[::2]:
        arena.free(p)
    s = arena.stats()
    assert s["largest_free_block"] == 4096
    assert s["fragmentation"] > 0.99
    assert arena.allocate(8192) is None, "no contiguous 8K although half the arena is free"


# -- invariant 4: reuse only after the fences are ready ("re-used too soon") -------------------
def test_block_freed_with_pending_fence_is_not_reused_too_soon(arena):
    p = arena.allocate(arena.capacity)  # the whole arena: any reuse would have to be p
    fence = hooks.HostFence()
    arena.free(p, [fence])
    assert arena.stats()["pending"] == arena.capacity
    assert arena.allocate(256) is None, "allocated inside a block whose copy is still in flight"
    fence.signal()
    assert arena.allocate(arena.capacity) == p


def test_block_waits_for_every_fence_not_just_the_first(arena):
    p = arena.allocate(arena.capacity)
    f1, f2 = hooks.HostFence(), hooks.HostFence()
    arena.free(p, [f1, f2])
    f1.signal()
    assert arena.allocate(256) is None
    f2.signal()
    assert arena.allocate(256) == p


def test_free_with_already_ready_fences_is_immediate(arena):
    p = arena.allocate(1000)
    f = hooks.HostFence()
    f.signal()
    arena.free(p, [f])
    assert arena.stats()["pending"] == 0 and arena.stats()["largest_free_block"] == arena.capacity


# -- invariant 6: stats ------------------------------------------------------------------------
def test_stats_track_use_peak_and_counters_and_reset(arena):
    a = arena.allocate(1000)
    b = arena.allocate(3000)
    arena.free(a)
    s = arena.stats()
    assert s["capacity"] == arena.capacity
    assert s["in_use"] == round_up(3000)
    assert s["peak_in_use"] == round_up(1000) + round_up(3000)
    assert (s["num_allocs"], s["num_frees"], s["num_failed"]) == (2, 1, 0)
    assert s["num_blocks"] == 1
    assert s["free"] == arena.capacity - round_up(3000)
    arena.reset_stats()
    s = arena.stats()
    assert s["peak_in_use"] == round_up(3000)
    assert (s["num_allocs"], s["num_frees"], s["num_failed"]) == (0, 0, 0)
    arena.free(b)


# -- invariant 3 (errors are clear, state unchanged) -------------------------------------------
def test_bad_input_raises_clear_errors_and_changes_nothing(arena):
    p = arena.allocate(1000)
    before = arena.stats()
    with pytest.raises(ValueError, match="positive"):
        arena.allocate(0)
    with pytest.raises(ValueError, match="positive"):
        arena.allocate(-5)
    with pytest.raises(ValueError, match="foreign"):
        arena.free(arena.base + arena.capacity + 4096)
    with pytest.raises(ValueError, match="foreign"):
        arena.free(12345)
    with pytest.raises(ValueError, match="not the start"):
        arena.free(p + ALIGN)
    arena.free(p)
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(p)
    after = arena.stats()
    assert after["num_failed"] == before["num_failed"]
    assert after["in_use"] == 0


def test_construction_errors_name_the_problem():
    with pytest.raises(ValueError, match="positive"):
        _C.HostArena(0, "cpu")
    with pytest.raises(ValueError, match="compiled backends"):
        _C.HostArena(4096, "no-such-backend")
    with pytest.raises(ValueError, match="positive"):
        HostArena(-1)
    with pytest.raises(TypeError):
        HostArena(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_capacity=4096 is below capacity_bytes=8192"):
        HostArena(8192, max_capacity=4096)
    with pytest.raises(ValueError, match="at least capacity"):
        _C.HostArena(8192, "cpu", 4096)
    with pytest.raises(ValueError, match="max_capacity must be >= 0"):
        _C.HostArena(8192, "cpu", -1)


# -- invariant 7: growth by segments -----------------------------------------------------------
def test_growth_adds_a_segment_only_when_no_gap_fits_and_stops_at_max_capacity(backend):
    arena = HostArena(1 << 20, backend, max_capacity=(3 << 20) + 4096)
    a = arena.allocate(600 << 10)
    b = arena.allocate(300 << 10)
    assert len(arena.segments) == 1, "grew although the first segment had room"
    c = arena.allocate(600 << 10)  # fits nowhere: a segment as large as the arena so far
    assert [size for _, size in arena.segments] == [1 << 20, 1 << 20]
    assert arena.segments[1][0] <= c < arena.segments[1][0] + (1 << 20)
    d = arena.allocate(1 << 20)  # no gap; what max_capacity leaves is less than the arena so far
    assert d is not None and [size for _, size in arena.segments] == [1 << 20, 1 << 20, (1 << 20) + 4096]
    assert arena.allocate(1 << 20) is None, "grew past max_capacity"
    s = arena.stats()
    assert (s["capacity"], s["max_capacity"], s["segments"], s["num_failed"]) == ((3 << 20) + 4096, (3 << 20) + 4096, 3, 1)
    for p in (a, b, c, d):
        arena.free(p)
    assert arena.stats()["in_use"] == 0 and len(arena.segments) == 3, "segments are kept until the arena dies"
    assert arena.allocate(1 << 20) is not None, "a freed segment serves again"


def test_reserve_adds_one_segment_of_what_is_missing_up_to_max_capacity(backend):
    arena = HostArena(1 << 20, backend, max_capacity=4 << 20)
    assert arena.reserve(1 << 20) and arena.reserve(4096) and len(arena.segments) == 1, "large enough already"
    assert arena.reserve((2 << 20) + 1)  # rounded up to the alignment
    assert [size for _, size in arena.segments] == [1 << 20, (1 << 20) + 256]
    a = arena.allocate((1 << 20) + 1)  # served by the reserved segment, no growth
    assert len(arena.segments) == 2 and arena.segments[1][0] == a
    assert not arena.reserve(8 << 20), "max_capacity is less than asked"
    assert [size for _, size in arena.segments] == [1 << 20, (1 << 20) + 256, (2 << 20) - 256]
    assert arena.capacity == arena.max_capacity == 4 << 20
    arena.free(a)
    fixed = HostArena(1 << 20, backend)
    assert not fixed.reserve(2 << 20) and len(fixed.segments) == 1, "an arena without max_capacity does not grow"
    with pytest.raises(ValueError, match="nbytes must be positive"):
        arena.reserve(0)
    with pytest.raises(TypeError):
        arena.reserve(1.5)  # type: ignore[arg-type]


def _host_refuses_huge_allocations() -> bool:
    """Linux's heuristic overcommit (mode 0) refuses one allocation far beyond RAM + swap."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "0"
    except OSError:
        return False


@pytest.mark.skipif(not _host_refuses_huge_allocations(), reason="needs heuristic overcommit (mode 0)")
def test_a_segment_the_host_refuses_is_exhaustion_not_an_error():
    arena = HostArena(1 << 20, "cpu", max_capacity=1 << 46)
    assert arena.allocate(1 << 45) is None  # 32 TiB: the reservation fails
    s = arena.stats()
    assert (s["segments"], s["capacity"], s["num_failed"]) == (1, 1 << 20, 1)
    assert not arena.reserve(1 << 45) and arena.stats()["segments"] == 1, "a refused reserve changes nothing"
    assert arena.allocate(4 << 20) is not None, "growth still works after a refused reservation"


def test_blocks_of_different_segments_never_merge(backend):
    arena = HostArena(64 << 10, backend, max_capacity=128 << 10)
    first = arena.allocate(64 << 10)
    second = arena.allocate(64 << 10)
    arena.free(first)
    arena.free(second)
    s = arena.stats()
    assert s["largest_free_block"] == 64 << 10 and s["free"] == 128 << 10, s
    assert arena.allocate((64 << 10) + 1) is None, "a block spanning two segments was handed out"


# -- invariant 5: thread safety ----------------------------------------------------------------
@pytest.mark.parametrize("max_capacity", [0, 16 << 20], ids=["fixed", "growing"])
def test_concurrent_allocate_free_from_many_threads_keeps_blocks_disjoint(backend, max_capacity):
    arena = _C.HostArena(4 << 20 if not max_capacity else 256 << 10, backend, max_capacity)
    owned: list[list[tuple[int, int]]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        mine = []
        try:
            for _ in range(400):
                if mine and rng.random() < 0.5:
                    arena.free(mine.pop(rng.randrange(len(mine)))[0])
                else:
                    n = rng.randint(1, 16384)
                    fence = None
                    p = arena.allocate(n)
                    if p is not None:
                        mine.append((p, round_up(n)))
                    if mine and rng.random() < 0.1:
                        q, _ = mine.pop()
                        fence = hooks.HostFence()
                        arena.free(q, [fence])
                        fence.signal()
            owned[k] = mine
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    spans = sorted(s for mine in owned for s in mine)
    for (a, na), (b, _) in zip(spans, spans[1:]):
        assert a + na <= b, "two threads were given overlapping blocks"
    assert arena.stats()["in_use"] == sum(n for _, n in spans)
    for p, _ in spans:
        arena.free(p)
    arena.allocate(1)  # reclaims pending blocks whose fences are signalled
    assert arena.stats()["pending"] == 0


# -- invariants 1-4 and 7 against a reference model (hypothesis state machine) -----------------
CAPACITY = 64 * 1024


class ArenaModel(RuleBasedStateMachine):
    """Random allocate / reserve / free / free-with-fence / complete sequences against a gap model.

    The model keeps, per segment, the occupied intervals (allocated, or pending with an
    unsignalled fence); free space is the set of maximal gaps between them inside each segment.
    The arena must answer every request with the best-fitting gap's start (smallest gap that
    fits, lowest address on ties); when none fits, it must add a segment exactly when
    ``MAX_CAPACITY`` allows one (sized as invariant 7 says) and serve the request from it, and
    return None otherwise.
    """

    MAX_CAPACITY = 0  # no growth

    def __init__(self) -> None:
        super().__init__()
        self.arena = _C.HostArena(CAPACITY, "cpu", self.MAX_CAPACITY)
        self.max_capacity = self.MAX_CAPACITY or CAPACITY
        self.segments = list(self.arena.segments)  # (base, size)
        self.allocated: dict[int, int] = {}  # address -> size
        self.pending: dict[int, tuple[int, hooks.HostFence]] = {}  # address -> (size, fence)

    def gaps(self) -> list[tuple[int, int]]:
        occupied = sorted(list(self.allocated.items()) +
                          [(a, s) for a, (s, f) in self.pending.items() if not f.ready()])
        gaps = []
        for base, size in self.segments:
            cursor, end = base, base + size
            for addr, n in occupied:
                if base <= addr < end:
                    if addr > cursor:
                        gaps.append((cursor, addr - cursor))
                    cursor = addr + n
            if cursor < end:
                gaps.append((cursor, end - cursor))
        return gaps

    def in_reservation_order(self, addresses) -> list[int]:
        """Addresses sorted by (segment, offset): independent of where the segments landed, so
        hypothesis draws the same block when it replays a case."""
        def key(addr: int) -> tuple[int, int]:
            for i, (base, size) in enumerate(self.segments):
                if base <= addr < base + size:
                    return i, addr - base
            raise AssertionError(f"block {addr:#x} outside every segment")
        return sorted(addresses, key=key)

    @rule(n=st.integers(min_value=1, max_value=100000))
    def allocate(self, n: int) -> None:
        size = round_up(n)
        fitting = [g for g in self.gaps() if g[1] >= size]
        p = self.arena.allocate(n)
        # Reclaim in the model what the arena reclaimed: pending blocks whose fence is ready.
        self.pending = {a: v for a, v in self.pending.items() if not v[1].ready()}
        total = sum(size for _, size in self.segments)
        if not fitting and size <= self.max_capacity - total:
            segments = list(self.arena.segments)
            assert len(segments) == len(self.segments) + 1, "no segment added for a request that fits none"
            assert segments[:-1] == self.segments
            assert segments[-1][1] == max(size, min(total, self.max_capacity - total)), "segment size"
            self.segments = segments
            fitting = [segments[-1]]
        else:
            assert list(self.arena.segments) == self.segments, "a segment added though a gap fits or none may be"
        if not fitting:
            assert p is None, f"allocated {n} bytes with no fitting gap"
            return
        best = min(fitting, key=lambda g: (g[1], g[0]))
        assert p is not None, f"no block for {n} bytes though gap {best} fits"
        assert p == best[0], f"not best fit: got {p}, want {best}"
        self.allocated[p] = size

    @rule(n=st.integers(min_value=1, max_value=8 * CAPACITY))
    def reserve(self, n: int) -> None:
        want = round_up(n)
        total = sum(size for _, size in self.segments)
        target = min(want, self.max_capacity)
        held = self.arena.reserve(n)
        segments = list(self.arena.segments)
        if total < target:
            assert segments[:-1] == self.segments and segments[-1][1] == target - total, "reserved segment"
            self.segments = segments
        else:
            assert segments == self.segments, "a segment added though the arena was large enough"
        assert held == (max(total, target) >= want)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), with_fence=st.booleans())
    def free(self, data, with_fence: bool) -> None:
        addr = data.draw(st.sampled_from(self.in_reservation_order(self.allocated)))
        size = self.allocated.pop(addr)
        if with_fence:
            fence = hooks.HostFence()
            self.arena.free(addr, [fence])
            self.pending[addr] = (size, fence)
        else:
            self.arena.free(addr)

    @precondition(lambda self: any(not f.ready() for _, f in self.pending.values()))
    @rule(data=st.data())
    def complete(self, data) -> None:
        open_ = self.in_reservation_order(a for a, (_, f) in self.pending.items() if not f.ready())
        self.pending[data.draw(st.sampled_from(open_))][1].signal()

    @invariant()
    def accounting_matches(self) -> None:
        s = self.arena.stats()
        capacity = sum(size for _, size in self.segments)
        assert s["in_use"] == sum(self.allocated.values())
        assert s["num_blocks"] == len(self.allocated)
        assert s["in_use"] + s["pending"] + s["free"] == capacity == s["capacity"] <= self.max_capacity
        assert s["segments"] == len(self.segments)


class GrowingArenaModel(ArenaModel):
    MAX_CAPACITY = 5 * CAPACITY + 3 * ALIGN  # not a multiple of the first segment: the last is cut short


for machine in (ArenaModel, GrowingArenaModel):
    machine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
test_arena_matches_reference_model = ArenaModel.TestCase
test_growing_arena_matches_reference_model = GrowingArenaModel.TestCase
