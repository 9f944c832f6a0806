"""CopyEngine invariants (csrc/offload/copy_engine.h), tested through the raw _C interface.

Buffers are torch tensors used only for their memory (data_ptr); streams are the test hooks'
Stream objects (tests/test_hooks.cpp), so a test can hold a producer or consumer "in flight"
with a HostFence, deterministically.
"""
from __future__ import annotations

import os
import random
import sys
import threading

import pytest
import torch

import bagualu2_test_hooks as hooks  # tests/test_hooks.cpp: test-only Stream and HostFence
from bagualu2 import _C

MiB = 1 << 20


def rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def host_view(ticket, n: int) -> bytes:
    """Read an arena block through ctypes (test-side inspection of the host copy)."""
    import ctypes
    return ctypes.string_at(ticket.host_ptr, n)


@pytest.fixture
def engine() -> _C.CopyEngine:
    # The raw-pointer tests use host buffers, which only the cpu backend reads; GPU backends
    # are covered through the facade tests with device tensors.
    arena = _C.HostArena(64 * MiB, "cpu")
    return _C.CopyEngine(arena, "cpu", -1, 1 * MiB)  # 1 MiB chunks: chunking is exercised


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 255, 256, 257, 4097, MiB - 1, MiB + 13, 5 * MiB + 7])
def test_round_trip_is_bit_exact_for_any_size_including_chunked(engine, n):
    src = rand_bytes(n, seed=n)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    assert host_view(t, n) == src.numpy().tobytes()
    dst = torch.zeros(n, dtype=torch.uint8)
    engine.reload(t, dst.data_ptr(), n, 0, True).wait()
    assert torch.equal(dst, src)
    t.release()
    assert engine.arena.stats()["in_use"] == 0


def test_zero_byte_copies_complete_at_once_without_a_block(engine):
    t = engine.offload(0, 0, 0)
    assert t.done() and t.nbytes == 0 and t.host_ptr == 0
    r = engine.reload(t, 0, 0, 0, True)
    assert r.done()
    t.release()
    assert engine.arena.stats()["num_allocs"] == 0


def test_reload_into_a_larger_buffer_writes_only_the_payload(engine):
    src = rand_bytes(1000)
    t = engine.offload(src.data_ptr(), 1000, 0)
    dst = torch.full((4096,), 7, dtype=torch.uint8)
    engine.reload(t, dst.data_ptr(), 4096, 0, True).wait()
    assert torch.equal(dst[:1000], src) and bool((dst[1000:] == 7).all())


# -- invariant 1: ordering ---------------------------------------------------------------------
def test_offload_waits_for_the_producer_stream_and_sees_its_final_data(engine):
    n = 3 * MiB
    final = rand_bytes(n, seed=1)
    buf = torch.zeros(n, dtype=torch.uint8)
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)  # the producer is "still running"...
    producer.copy(buf.data_ptr(), final.data_ptr(), n)  # ...and will write the final data
    t = engine.offload(buf.data_ptr(), n, producer.handle)
    assert not t.done(), "the offload completed before its producer finished"
    gate.signal()
    t.wait()
    assert host_view(t, n) == final.numpy().tobytes()


def test_reload_waits_for_the_consumer_stream_before_writing(engine):
    n = 2 * MiB
    src = rand_bytes(n, seed=2)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    dst = torch.zeros(n, dtype=torch.uint8)
    consumer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    consumer.wait_fence(gate)  # the consumer still uses dst's memory for something else
    r = engine.reload(t, dst.data_ptr(), n, consumer.handle, True)
    assert not r.done(), "the reload overwrote memory its consumer stream had not released"
    assert int(dst.count_nonzero()) == 0
    gate.signal()
    r.wait()
    consumer.synchronize()
    assert torch.equal(dst, src)


def test_offload_and_reload_directions_run_at_once(engine):
    # A reload must not queue behind a stalled offload: they use different streams.
    src = rand_bytes(MiB)
    t = engine.offload(src.data_ptr(), MiB, 0)
    t.wait()
    held = hooks.Stream("cpu")
    gate = hooks.HostFence()
    held.wait_fence(gate)
    stalled = engine.offload(src.data_ptr(), MiB, held.handle)
    dst = torch.zeros(MiB, dtype=torch.uint8)
    engine.reload(t, dst.data_ptr(), MiB, 0, True).wait()  # would hang if directions shared a queue
    assert torch.equal(dst, src) and not stalled.done()
    gate.signal()
    stalled.wait()


# -- invariant 2: no reuse before the copies end -----------------------------------------------
def test_released_block_is_not_reused_while_its_offload_is_in_flight(engine):
    arena = engine.arena
    n = arena.capacity  # one block is the whole arena: any reuse would be this block
    src = rand_bytes(n)
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)
    t = engine.offload(src.data_ptr(), n, producer.handle)
    t.release()  # cancelled while the copy has not even started
    assert arena.allocate(256) is None, "block re-used too soon"
    gate.signal()
    engine.synchronize()
    assert arena.allocate(n) == t.host_ptr


def test_released_block_is_not_reused_while_a_reload_reads_it(engine):
    arena = engine.arena
    n = arena.capacity
    src = rand_bytes(n, seed=3)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    dst = torch.zeros(n, dtype=torch.uint8)
    consumer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    consumer.wait_fence(gate)
    r = engine.reload(t, dst.data_ptr(), n, consumer.handle, True)
    t.release()
    p = arena.allocate(256)
    assert p is None, "block re-used while a reload still reads it"
    gate.signal()
    r.wait()
    assert torch.equal(dst, src)
    assert arena.allocate(n) == t.host_ptr


def test_a_held_block_outlives_its_release_until_the_last_hold_drops(engine):
    arena = engine.arena
    n = arena.capacity  # one block is the whole arena: any reuse would be this block
    src = rand_bytes(n, seed=4)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    first, second = t.host_view(), t.host_view()
    assert memoryview(first).nbytes == n and bytes(memoryview(first)[:64]) == src[:64].numpy().tobytes()
    t.release()
    assert t.released and arena.allocate(256) is None, "block freed while a host view holds it"
    del first
    assert arena.allocate(256) is None, "block freed while the second host view holds it"
    as_tensor = torch.frombuffer(second, dtype=torch.uint8)  # the tensor keeps the view alive
    del second
    assert arena.allocate(256) is None and torch.equal(as_tensor, src)
    del as_tensor
    assert arena.stats()["in_use"] == 0
    assert arena.allocate(n) == t.host_ptr


def test_a_ticket_dropped_without_release_gives_its_block_back_after_its_copies(engine):
    # What an owner stopped before it could release (an interrupt right after offload()) leaves.
    arena = engine.arena
    n = arena.capacity  # one block is the whole arena: any reuse would be this block
    src = rand_bytes(n, seed=5)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    view = t.host_view()
    del t  # a host view keeps the ticket, so the block, until it drops
    assert arena.allocate(256) is None and bytes(memoryview(view)[:64]) == src[:64].numpy().tobytes()
    del view
    assert arena.stats()["in_use"] == 0
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)
    t = engine.offload(src.data_ptr(), n, producer.handle)
    host_ptr = t.host_ptr
    del t  # the copy has not started: the block is freed, reused only after it ends
    assert arena.allocate(256) is None, "block re-used before its offload copy ended"
    gate.signal()
    engine.synchronize()
    assert arena.stats()["in_use"] == 0
    assert arena.allocate(n) == host_ptr


def test_a_host_view_needs_a_finished_unreleased_offload(engine):
    src = rand_bytes(MiB)
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)
    t = engine.offload(src.data_ptr(), MiB, producer.handle)
    with pytest.raises(ValueError, match="before the offload copy completed"):
        t.host_view()
    gate.signal()
    t.wait()
    dst = torch.zeros(MiB, dtype=torch.uint8)
    r = engine.reload(t, dst.data_ptr(), MiB, 0, True)
    r.wait()
    with pytest.raises(ValueError, match="needs an offload ticket"):
        r.host_view()
    t.release()
    with pytest.raises(ValueError, match="released ticket"):
        t.host_view()
    assert engine.arena.stats()["in_use"] == 0


# -- invariant 4: exhaustion -------------------------------------------------------------------
def test_offload_returns_none_when_the_arena_is_full_and_leaks_nothing(engine):
    arena = engine.arena
    src = rand_bytes(arena.capacity)
    t = engine.offload(src.data_ptr(), arena.capacity, 0)
    assert engine.offload(src.data_ptr(), 1, 0) is None
    t.release()
    engine.synchronize()
    small = engine.offload(src.data_ptr(), 1, 0)
    assert small is not None
    small.wait()  # the source must outlive its copy
    assert arena.stats()["num_failed"] == 1


# -- invariant 3: misuse -----------------------------------------------------------------------
def test_misuse_raises_clear_value_errors(engine):
    src = rand_bytes(4096)
    dst = torch.zeros(4096, dtype=torch.uint8)
    t = engine.offload(src.data_ptr(), 4096, 0)
    with pytest.raises(ValueError, match="too small: 100 bytes available, 4096"):
        engine.reload(t, dst.data_ptr(), 100, 0, True)
    with pytest.raises(ValueError, match="null pointer"):
        engine.reload(t, 0, 4096, 0, True)
    with pytest.raises(ValueError, match="null pointer"):
        engine.offload(0, 10, 0)
    with pytest.raises(ValueError, match=">= 0"):
        engine.offload(src.data_ptr(), -1, 0)
    with pytest.raises(ValueError, match="absurd"):
        engine.offload(src.data_ptr(), 1 << 62, 0)
    with pytest.raises(ValueError, match="not a live stream"):
        engine.offload(src.data_ptr(), 16, 0xDEAD0)
    with pytest.raises(ValueError, match="inside the host arena"):
        engine.offload(t.host_ptr, 16, 0)
    r = engine.reload(t, dst.data_ptr(), 4096, 0, True)
    with pytest.raises(ValueError, match="offload ticket"):
        engine.reload(r, dst.data_ptr(), 4096, 0, True)
    r.wait()  # buffers must outlive their copies (the facade guarantees this; raw users must)
    t.release()
    for call in (t.wait, t.done, t.release):
        with pytest.raises(ValueError, match="release"):
            call()
    with pytest.raises(ValueError, match="released ticket"):
        engine.reload(t, dst.data_ptr(), 4096, 0, True)
    with pytest.raises(ValueError, match="released"):
        engine.wait_on(t, 0)


def test_ticket_of_another_engine_and_backend_mismatch_are_rejected(engine):
    other = _C.CopyEngine(_C.HostArena(MiB, "cpu"), "cpu")
    src = rand_bytes(64)
    t = other.offload(src.data_ptr(), 64, 0)
    t.wait()
    dst = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="another engine"):
        engine.reload(t, dst.data_ptr(), 64, 0, True)
    with pytest.raises(ValueError, match="compiled backends"):
        _C.CopyEngine(_C.HostArena(MiB, "cpu"), "nope")
    with pytest.raises(ValueError, match="chunk_bytes"):
        _C.CopyEngine(_C.HostArena(MiB, "cpu"), "cpu", -1, 0)


# -- invariant 5: stats ------------------------------------------------------------------------
def test_stats_count_bytes_and_copies_per_direction(engine):
    engine.reset_stats()
    sizes = [1000, 3 * MiB, 12345]
    srcs = [rand_bytes(n, seed=n) for n in sizes]
    tickets = [engine.offload(s.data_ptr(), s.numel(), 0) for s in srcs]
    dsts = [torch.empty_like(s) for s in srcs]
    for t, d in zip(tickets, dsts):
        engine.reload(t, d.data_ptr(), d.numel(), 0, True)
    engine.synchronize()
    s = engine.stats()
    assert s["d2h_bytes"] == s["h2d_bytes"] == sum(sizes)
    assert s["d2h_copies"] == s["h2d_copies"] == 3
    assert s["d2h_busy_s"] > 0 and s["h2d_busy_s"] > 0
    assert s["d2h_GBps"] == pytest.approx(s["d2h_bytes"] / s["d2h_busy_s"] / 1e9)
    engine.reset_stats()
    assert engine.stats()["d2h_bytes"] == 0


# -- cpu backend: copy threads ---------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and SCHED_IDLE are Linux's")
def test_cpu_copy_threads_run_at_idle_priority(engine):
    """The cpu backend's copy threads take only cycles compute leaves (csrc/gpu/cpu_backend.cpp):
    what copies cost then lands on the thread that waits for them, where it is measured."""
    src = rand_bytes(3 * MiB)  # a pooled copy: the pool's threads have started
    engine.offload(src.data_ptr(), src.numel(), 0).wait()
    copy_threads = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == "bagualu2-copy":
                    copy_threads.append(int(task))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    assert len(copy_threads) >= 2  # the engine's two streams, and the pool's on more than one core
    assert {os.sched_getscheduler(tid) for tid in copy_threads} == {os.SCHED_IDLE}
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the calling thread keeps its priority


def test_a_copy_to_an_idle_cpu_stream_runs_on_the_calling_thread_and_one_behind_work_queues(engine):
    """On an idle stream the cpu backend copies before offload() returns (its time lands on the
    caller, where it is measured); behind work still queued on the stream it waits its turn."""
    n = 3 * MiB
    src = rand_bytes(n, seed=3)
    t = engine.offload(src.data_ptr(), n, 0)
    assert t.done(), "a copy submitted to an idle stream was left to another thread"
    assert host_view(t, n) == src.numpy().tobytes()
    held = hooks.Stream("cpu")
    gate = hooks.HostFence()
    held.wait_fence(gate)
    stalled = engine.offload(src.data_ptr(), n, held.handle)  # the d2h stream now waits for `held`
    behind = engine.offload(src.data_ptr(), n, 0)
    assert not stalled.done() and not behind.done(), "a copy overtook the work queued before it"
    gate.signal()
    behind.wait()
    assert stalled.done() and host_view(behind, n) == src.numpy().tobytes()


# -- concurrency -------------------------------------------------------------------------------
def test_many_threads_offloading_and_reloading_at_once_stay_bit_exact():
    arena = _C.HostArena(32 * MiB, "cpu")
    engine = _C.CopyEngine(arena, "cpu", -1, 256 * 1024)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        try:
            live = []
            for i in range(40):
                n = rng.choice([1, 777, 4096, 100_000, 1_500_000])
                src = rand_bytes(n, seed=k * 1000 + i)
                t = engine.offload(src.data_ptr(), n, 0)
                if t is None:  # arena full: a normal outcome under contention
                    continue
                live.append((t, src))
                if len(live) > 3 or rng.random() < 0.3:
                    t0, s0 = live.pop(0)
                    dst = torch.empty_like(s0)
                    engine.reload(t0, dst.data_ptr(), dst.numel(), 0, True).wait()
                    assert torch.equal(dst, s0), f"thread {k}: corrupted round trip"
                    t0.release()
            for t0, s0 in live:
                dst = torch.empty_like(s0)
                engine.reload(t0, dst.data_ptr(), dst.numel(), 0, True).wait()
                assert torch.equal(dst, s0)
                t0.release()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    engine.synchronize()
    arena.allocate(1)  # reclaim completed pending blocks
    s = arena.stats()
    assert s["in_use"] == 256 and s["pending"] == 0


def test_trace_records_submissions_in_order_with_their_blocks(engine):
    n = 3 * MiB + 5  # chunked: still one trace entry per copy
    srcs = [rand_bytes(n, seed=i) for i in range(3)]
    engine.offload(srcs[0].data_ptr(), n, 0).wait()  # before start_trace: not recorded
    engine.start_trace(16)
    tickets = [engine.offload(s.data_ptr(), n, 0) for s in srcs]
    dst = torch.empty(n, dtype=torch.uint8)
    reloads = [engine.reload(tickets[i], dst.data_ptr(), n, 0, True) for i in (2, 0)]
    for r in reloads:
        r.wait()
    engine.stop_trace()
    engine.offload(srcs[1].data_ptr(), n, 0).wait()  # after stop_trace: not recorded
    trace = engine.trace()
    assert [e["seq"] for e in trace] == list(range(5))
    assert [(e["direction"], e["host_ptr"], e["nbytes"]) for e in trace] == (
        [("d2h", t.host_ptr, n) for t in tickets] + [("h2d", tickets[i].host_ptr, n) for i in (2, 0)])
    times = [e["submit_s"] for e in trace]
    assert times == sorted(times) and times[0] >= 0
    assert engine.trace_dropped == 0


def test_trace_keeps_its_capacity_and_counts_the_rest(engine):
    src = rand_bytes(4096)
    engine.start_trace(2)
    for _ in range(5):
        engine.offload(src.data_ptr(), 4096, 0).wait()
    assert [e["seq"] for e in engine.trace()] == [0, 1]
    assert engine.trace_dropped == 3
    engine.start_trace(8)  # a new trace starts empty
    assert engine.trace() == [] and engine.trace_dropped == 0


# -- fork --------------------------------------------------------------------------------------
def _in_forked_child(fn) -> str:
    """fn() in a child forked now; what it raised there ("" for nothing). The child leaves with
    os._exit, running no finalizer."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                fn()
                got = ""
            except Exception as e:  # reported to the parent, which asserts on it
                got = f"{type(e).__name__}: {e}"
            os.write(write, got.encode() or b"-")
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    got = b"".join(chunks).decode()
    return "" if got == "-" else got


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_after_the_runtime_refuses_to_use_it(engine):
    """Issue #58, 10: a forked child (a DataLoader worker) has none of the runtime's worker
    threads: the parent's engine and a new one refuse there, saying why, and the parent goes on."""
    src = rand_bytes(MiB)
    producer = hooks.Stream("cpu")
    engine.offload(src.data_ptr(), MiB, producer.handle).wait()
    offload = _in_forked_child(lambda: engine.offload(src.data_ptr(), MiB, producer.handle))
    new_engine = _in_forked_child(lambda: _C.CopyEngine(engine.arena, "cpu", -1))
    for got in (offload, new_engine):
        assert "forked" in got and "spawn" in got, got
    t = engine.offload(src.data_ptr(), MiB, producer.handle)
    t.wait()
    assert host_view(t, MiB) == src.numpy().tobytes()
