"""The cuda backend's scenarios against the stand-in driver, run in a fresh process.

tests/test_fake_driver.py starts this file with BAGUALU2_CUDA_LIBRARY naming the stand-in
(tests/fake_driver/fake_cuda.cpp), so bagualu2._C loads it as its libcuda and the shipped
backend code runs on it. Each scenario returns what it observed; the process prints one JSON
object (scenario -> observations) as its last line and the test asserts on it. Every scenario
works on devices 1 and 2 only, so anything that touches device 0 shows in the driver's counters.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import time
from typing import Callable, Dict

import torch

import bagualu2_test_hooks as hooks  # tests/test_hooks.cpp: Stream, HostFence
from bagualu2 import _C

DRIVER = ctypes.CDLL(os.environ["BAGUALU2_CUDA_LIBRARY"])  # the instance _C loaded
DRIVER.fake_cuda_stream_destroyed.argtypes = [ctypes.c_void_p]
DRIVER.fake_cuda_stream_device.argtypes = [ctypes.c_void_p]
DRIVER.fake_cuda_live.argtypes = [ctypes.c_char_p, ctypes.c_int]
DRIVER.fake_cuda_live.restype = ctypes.c_long
DRIVER.fake_cuda_created.argtypes = [ctypes.c_char_p]
DRIVER.fake_cuda_created.restype = ctypes.c_long
DRIVER.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_long]
DRIVER.fake_cuda_device_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
DRIVER.fake_cuda_device_alloc.restype = ctypes.c_ulonglong
DRIVER.fake_cuda_device_free.argtypes = [ctypes.c_ulonglong]
DRIVER.fake_cuda_calls_in_child.restype = ctypes.c_long
DRIVER.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
DRIVER.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
DRIVER.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
DRIVER.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
DRIVER.cuEventDestroy.argtypes = [ctypes.c_void_p]
DEVICE = 2
N = 1 << 16
DEINITIALIZED, ILLEGAL_ADDRESS, INVALID_VALUE = 4, 700, 1


def driver_state() -> dict:
    buf = ctypes.create_string_buffer(1 << 16)
    count = DRIVER.fake_cuda_violations(buf, len(buf))
    return {
        "retains": [DRIVER.fake_cuda_retains(d) for d in range(3)],
        "ever_current": [DRIVER.fake_cuda_ever_current(d) for d in range(3)],
        "default_stream_uses": [DRIVER.fake_cuda_default_stream_uses(d) for d in range(3)],
        "violations": count,
        "violation_text": buf.value.decode(),
    }


def live() -> dict:
    """What the driver holds now: retained primary contexts, live events, pinned and device
    allocations, and streams per device (default streams apart)."""
    return {"contexts": DRIVER.fake_cuda_live(b"contexts", -1),
            "events": DRIVER.fake_cuda_live(b"events", -1), "host": DRIVER.fake_cuda_live(b"host", -1),
            "device": DRIVER.fake_cuda_live(b"device", -1),
            "streams": [DRIVER.fake_cuda_live(b"streams", d) for d in range(3)]}


def fail(call: str, code: int, count: int = -1) -> None:
    """Errors from inside the driver: the next `count` calls of `call` ("*": every entry point)
    return `code`; count 0 clears."""
    DRIVER.fake_cuda_fail(call.encode(), code, count)


class DevBuf:
    """Device memory of the stand-in (host addresses underneath), filled and read directly."""

    def __init__(self, device: int, content: bytes) -> None:
        self.nbytes = len(content)
        self.ptr = DRIVER.fake_cuda_device_alloc(device, self.nbytes)
        assert self.ptr, "fake_cuda_device_alloc failed"
        ctypes.memmove(self.ptr, content, self.nbytes)

    def bytes(self) -> bytes:
        return ctypes.string_at(self.ptr, self.nbytes)

    def __del__(self) -> None:
        DRIVER.fake_cuda_device_free(self.ptr)


def in_thread(fn: Callable[[], object], bind: int = -1) -> object:
    """fn() on a fresh thread (bound to device `bind` first, as a torch thread that chose it
    would be); returns its result and the device current on that thread afterwards."""
    out: dict = {}

    def body() -> None:
        if bind >= 0:
            assert DRIVER.fake_cuda_bind(bind) == 0
        try:
            out["result"] = fn()
        except Exception as e:  # reported, not swallowed: the parent asserts on it
            out["result"] = f"{type(e).__name__}: {e}"
        out["device_after"] = DRIVER.fake_cuda_current_device()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def data(seed: int) -> bytes:
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def dev(seed: int, device: int = DEVICE) -> DevBuf:
    return DevBuf(device, data(seed))


def zeros(device: int = DEVICE) -> DevBuf:
    return DevBuf(device, bytes(N))


def error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def host_bytes(ticket) -> bytes:
    return ctypes.string_at(ticket.host_ptr, ticket.nbytes)


def foreign_threads() -> dict:
    """Work and finalizers on threads that have no context, or another device's."""
    obs: dict = {"main_device_before": DRIVER.fake_cuda_current_device()}
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    src, dst = dev(1), zeros()

    def copy_round_trip() -> bool:
        t = engine.offload(src.ptr, N, 0)
        t.wait()
        r = engine.reload(t, dst.ptr, N, 0, True)
        r.wait()
        engine.stats()
        return dst.bytes() == src.bytes()

    obs["no_context_thread"] = in_thread(copy_round_trip)
    before = driver_state()["default_stream_uses"]
    obs["device1_thread"] = in_thread(copy_round_trip, bind=1)
    after = driver_state()["default_stream_uses"]
    obs["default_stream_uses_delta"] = [a - b for a, b in zip(after, before)]

    # Finalizers: the last references die in a cycle collected on a thread with no context.
    left = engine.offload(src.ptr, N, 0)  # an unreleased ticket frees its block on death
    reloaded = engine.reload(left, dst.ptr, N, 0, False)
    holder: list = [arena, engine, left, reloaded]
    holder.append(holder)
    del arena, engine, left, reloaded, holder

    def collect() -> int:
        return gc.collect()

    obs["finalizer_thread"] = in_thread(collect)
    obs["main_device_after"] = DRIVER.fake_cuda_current_device()
    return obs


def stream_lifetime() -> dict:
    """Copy streams outlive their engine (torch may record on them later); engines of one
    device share them."""
    arena = _C.HostArena(N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    handles = [engine.d2h_stream, engine.h2d_stream]
    del engine
    gc.collect()
    obs: dict = {"destroyed_after_engine": [DRIVER.fake_cuda_stream_destroyed(h) for h in handles]}

    def record_like_torch_allocator() -> list:
        # What the caching allocator does when a tensor recorded on the stream is freed.
        codes = []
        for h in handles:
            event = ctypes.c_void_p()
            codes.append(DRIVER.cuEventCreate(ctypes.byref(event), 2))
            codes.append(DRIVER.cuEventRecord(event, h))
            DRIVER.cuEventDestroy_v2(event)  # as the allocator does once the record completed
        return codes

    obs["record_after_engine"] = in_thread(record_like_torch_allocator, bind=DEVICE)
    again = _C.CopyEngine(arena, "cuda", DEVICE)
    obs["same_streams"] = [again.d2h_stream, again.h2d_stream] == handles
    obs["stream_devices"] = [DRIVER.fake_cuda_stream_device(h) for h in handles]
    return obs


def ordering() -> dict:
    """Every wait in the right order: offload after its producer, reload after its consumer's
    earlier work, the consumer after the reload (reload(wait) and wait_on)."""
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    obs: dict = {}
    # Offload after the producer: the producer writes the final data behind a held fence.
    src, final = dev(2), dev(3)
    producer, gate = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    producer.wait_fence(gate)
    producer.copy(src.ptr, final.ptr, N)
    ticket = engine.offload(src.ptr, N, producer.handle)
    time.sleep(0.05)
    obs["offload_done_while_producer_held"] = ticket.done()
    gate.signal()
    ticket.wait()
    obs["offload_saw_producer_data"] = host_bytes(ticket) == final.bytes()

    # Reload after the consumer's earlier read of dst, and before its later one.
    dst, old = dev(4), data(4)
    seen_before, seen_after = zeros(), zeros()
    consumer, gate = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    consumer.wait_fence(gate)
    consumer.copy(seen_before.ptr, dst.ptr, N)
    r = engine.reload(ticket, dst.ptr, N, consumer.handle, True)
    consumer.copy(seen_after.ptr, dst.ptr, N)
    time.sleep(0.05)
    obs["reload_done_while_consumer_held"] = r.done()
    gate.signal()
    consumer.synchronize()
    obs["consumer_read_old_before_reload"] = seen_before.bytes() == old
    obs["consumer_read_reloaded_after"] = seen_after.bytes() == final.bytes()

    # wait_on: the reload cannot start before its offload, held behind a producer.
    src2, final2 = dev(5), dev(6)
    producer2, gate2 = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    producer2.wait_fence(gate2)
    producer2.copy(src2.ptr, final2.ptr, N)
    t2 = engine.offload(src2.ptr, N, producer2.handle)
    dst2, seen2 = zeros(), zeros()
    consumer2 = hooks.Stream("cuda", DEVICE)
    r2 = engine.reload(t2, dst2.ptr, N, 0, False)
    engine.wait_on(r2, consumer2.handle)
    consumer2.copy(seen2.ptr, dst2.ptr, N)
    time.sleep(0.05)
    gate2.signal()
    consumer2.synchronize()
    obs["wait_on_orders_consumer_after_reload"] = seen2.bytes() == final2.bytes()

    # A prefetch whose destination belongs to the reload stream itself starts at once, while
    # the compute stream is held (the facade allocates a prefetch's destination there).
    compute, gate3 = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    compute.wait_fence(gate3)
    dst3 = zeros()
    r3 = engine.reload(ticket, dst3.ptr, N, engine.h2d_stream, False)
    r3.wait()
    obs["prefetch_on_copy_stream_done_while_compute_held"] = dst3.bytes() == final.bytes()
    gate3.signal()
    compute.synchronize()
    return obs


def wrong_device() -> dict:
    """Streams of another device are refused; a thread with no device cannot create objects
    without naming one."""
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    other = hooks.Stream("cuda", 1)
    src = dev(7)
    obs: dict = {}
    obs["offload"] = error(lambda: engine.offload(src.ptr, N, other.handle))
    t = engine.offload(src.ptr, N, 0)
    t.wait()
    dst = zeros()
    obs["reload"] = error(lambda: engine.reload(t, dst.ptr, N, other.handle, True))
    obs["wait_on"] = error(lambda: engine.wait_on(t, other.handle))
    obs["unknown_handle"] = error(lambda: engine.offload(src.ptr, N, 0x12345))
    obs["engine_without_device"] = in_thread(lambda: error(lambda: _C.CopyEngine(arena, "cuda", -1)))
    obs["arena_without_device"] = in_thread(lambda: error(lambda: _C.HostArena(N, "cuda", 0, -1)))
    obs["engine_current_device"] = in_thread(lambda: _C.CopyEngine(arena, "cuda", -1).device, bind=1)
    return obs


def destroyed_stream_is_caught() -> dict:
    """The stand-in itself: using a destroyed stream is a violation (what a UniqueStream-owned
    copy stream would have met in torch's allocator)."""
    before = driver_state()["violations"]
    stream = hooks.Stream("cuda", DEVICE)
    handle = stream.handle
    del stream
    gc.collect()

    def record() -> int:
        event = ctypes.c_void_p()
        DRIVER.cuEventCreate(ctypes.byref(event), 2)
        return DRIVER.cuEventRecord(event, handle)

    got = in_thread(record, bind=DEVICE)
    return {"destroyed": DRIVER.fake_cuda_stream_destroyed(handle), "record": got,
            "new_violations": driver_state()["violations"] - before}


def fence_errors() -> dict:
    """Errors from inside the driver while a copy is held in flight: only a failure of the work
    itself lets the arena reuse the block; a deinitialised driver (one entry point or all of
    them, a bind included) leaves it pending until the copy is known to have ended."""
    arena = _C.HostArena(N, "cuda", 0, DEVICE)  # one block: any reuse is that block
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    src = dev(8)
    obs: dict = {}
    cases = (("query_deinitialized", "cuEventQuery", DEINITIALIZED),
             ("driver_deinitialized", "*", DEINITIALIZED),
             ("query_illegal_address", "cuEventQuery", ILLEGAL_ADDRESS))
    for name, call, code in cases:
        producer, gate = hooks.Stream("cuda", DEVICE), hooks.HostFence()
        producer.wait_fence(gate)
        try:
            ticket = engine.offload(src.ptr, N, producer.handle)
            fail(call, code)
            o = {"done": error(ticket.done)}
            ticket.release()
            block = arena.allocate(N)
            o["handed_out_while_copy_held"] = block is not None
        finally:
            fail("*", 0, 0)
            gate.signal()  # never left held: the stream's destructor would wait for it
        if block is not None:
            arena.free(block)
        # The copy behind the producer ends (a real driver aborts the work of a context that
        # reported ILLEGAL_ADDRESS; the stand-in, which only reported it, runs it to the end).
        assert in_thread(lambda: DRIVER.cuStreamSynchronize(engine.d2h_stream), bind=DEVICE)["result"] == 0
        block = arena.allocate(N)
        o["handed_out_after_copy_ended"] = block is not None
        if block is not None:
            arena.free(block)
        obs[name] = o
    engine.synchronize()
    return obs


def timing_failure() -> dict:
    """An elapsed-time query that fails inside the driver costs one copy's time, nothing more."""
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    src = dev(9)
    fail("cuEventElapsedTime", INVALID_VALUE, 1)
    obs: dict = {}

    def offload_and_wait() -> None:
        t = engine.offload(src.ptr, N, 0)
        t.wait()
        t.release()

    obs["first_copy"] = error(offload_and_wait)
    obs["stats_after"] = error(engine.stats)
    obs["second_copy"] = error(offload_and_wait)
    stats: dict = {}
    obs["stats_again"] = error(lambda: stats.update(engine.stats()))
    obs["d2h"] = {k: stats.get("d2h_" + k) for k in ("copies", "untimed", "bytes", "failed")}
    return obs


def shared_streams() -> dict:
    """Two engines of one device share its copy streams: one's synchronize and destructor wait
    for its own copies, not for the other's held ones."""
    src = dev(10)
    a = _C.CopyEngine(_C.HostArena(4 * N, "cuda", 0, DEVICE), "cuda", DEVICE)
    b = _C.CopyEngine(_C.HostArena(4 * N, "cuda", 0, DEVICE), "cuda", DEVICE)
    obs: dict = {"same_streams": [a.d2h_stream, a.h2d_stream] == [b.d2h_stream, b.h2d_stream]}
    t = a.offload(src.ptr, N, 0)
    t.wait()
    t.release()
    producer, gate = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    producer.wait_fence(gate)
    held = b.offload(src.ptr, N, producer.handle)  # queued on the shared stream behind the gate

    def returns_while_held(fn: Callable[[], object]) -> bool:
        worker = threading.Thread(target=fn)
        worker.start()
        worker.join(60)  # a deadlock guard, not a timing: the gate opens only below
        return not worker.is_alive()

    try:
        obs["a_synchronize_returned_while_b_held"] = returns_while_held(a.synchronize)
        holder = [a]
        del a

        def destroy() -> None:
            holder.clear()
            gc.collect()

        obs["a_destroyed_while_b_held"] = returns_while_held(destroy)
        obs["b_done_while_held"] = held.done()
    finally:
        gate.signal()
    held.wait()
    b.synchronize()
    return obs


def event_pool() -> dict:
    """Round trips after a warm-up create no events: the copies' timing events are reused."""
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    src, dst = dev(11), zeros()

    def round_trips(count: int) -> int:
        before = DRIVER.fake_cuda_created(b"events")
        for _ in range(count):
            t = engine.offload(src.ptr, N, 0)
            t.wait()
            r = engine.reload(t, dst.ptr, N, 0, True)
            r.wait()
            t.release()
        return DRIVER.fake_cuda_created(b"events") - before

    return {"warm_up_created": round_trips(4), "created_in_20_round_trips": round_trips(20),
            "exact": dst.bytes() == src.bytes()}


def misaligned_reservation() -> dict:
    """A reservation the arena refuses (off its alignment) is given back, not leaked."""
    before = live()["host"]
    DRIVER.fake_cuda_misalign_host_allocs(1)
    obs: dict = {"construct": error(lambda: _C.HostArena(N, "cuda", 0, DEVICE))}
    obs["left_by_construct"] = live()["host"] - before
    arena = _C.HostArena(N, "cuda", 4 * N, DEVICE)
    first = arena.allocate(N)  # the first segment is full: the next request grows the arena
    DRIVER.fake_cuda_misalign_host_allocs(1)
    obs["grow"] = error(lambda: arena.allocate(N))
    obs["left_by_grow"] = live()["host"] - before - len(arena.segments)
    arena.free(first)
    return obs


def fork_child() -> dict:
    """A child forked after the runtime was created refuses every use before reaching the
    driver (CUDA contexts do not survive fork); the parent goes on."""
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    src = dev(12)
    engine.offload(src.ptr, N, 0).wait()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running any finalizer
        try:
            os.close(read)
            got = {"offload": error(lambda: engine.offload(src.ptr, N, 0)),
                   "new_engine": error(lambda: _C.CopyEngine(arena, "cuda", DEVICE)),
                   "new_arena": error(lambda: _C.HostArena(N, "cuda", 0, DEVICE)),
                   "driver_calls": DRIVER.fake_cuda_calls_in_child()}
            os.write(write, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    obs: dict = {"child": json.loads(b"".join(chunks) or b"{}")}
    t = engine.offload(src.ptr, N, 0)
    t.wait()
    obs["parent_after"] = host_bytes(t) == src.bytes()
    return obs


def primary_contexts() -> dict:
    """What the selftest's device>0 probe asks the driver: device 0's primary context was never
    made active by this process, device 2's was."""
    from bagualu2.cli.selftest_device import primary_context_active

    return {"device0": primary_context_active(0), "device2": primary_context_active(2)}


def the_stand_in_is_strict() -> dict:
    """The stand-in refuses, and lists, what the real driver would do wrong silently or later:
    an async copy from pageable memory or another device's memory, a CUDA call inside a host
    function, a call of a plain (pre-_v2) entry point."""
    before = driver_state()["violations"]
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    pageable = torch.zeros(N, dtype=torch.uint8)
    other = dev(13, device=1)
    obs: dict = {"pageable": error(lambda: engine.offload(pageable.data_ptr(), N, 0)),
                 "other_device": error(lambda: engine.offload(other.ptr, N, 0))}
    stream = hooks.Stream("cuda", DEVICE)
    seen: list = []
    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    @callback_type
    def call_inside(_: object) -> None:
        ctx = ctypes.c_void_p()
        seen.append(DRIVER.cuCtxGetCurrent(ctypes.byref(ctx)))

    DRIVER.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, callback_type, ctypes.c_void_p]

    def launch() -> int:
        code = DRIVER.cuLaunchHostFunc(stream.handle, call_inside, None)
        stream.synchronize()
        return code

    obs["launch"] = in_thread(launch, bind=DEVICE)["result"]
    obs["inside_host_function"] = seen

    def plain_destroy() -> int:
        event = ctypes.c_void_p()
        DRIVER.cuEventCreate(ctypes.byref(event), 2)
        return DRIVER.cuEventDestroy(event)

    obs["plain_destroy"] = in_thread(plain_destroy, bind=DEVICE)["result"]
    obs["new_violations"] = driver_state()["violations"] - before
    return obs


SCENARIOS: Dict[str, Callable[[], dict]] = {
    "foreign_threads": foreign_threads,
    "stream_lifetime": stream_lifetime,
    "ordering": ordering,
    "wrong_device": wrong_device,
    "fence_errors": fence_errors,
    "timing_failure": timing_failure,
    "shared_streams": shared_streams,
    "event_pool": event_pool,
    "misaligned_reservation": misaligned_reservation,
    "fork_child": fork_child,
    "primary_contexts": primary_contexts,
}


def main() -> None:
    out: dict = {"status": _C.backend_status()["cuda"]}
    for name, fn in SCENARIOS.items():
        try:
            out[name] = fn()
        except Exception as e:  # one broken scenario fails its own test, not every test
            out[name] = {"scenario_error": f"{type(e).__name__}: {e}"}
        fail("*", 0, 0)  # an injection a failed scenario left armed
    gc.collect()
    out["driver"] = driver_state()  # before the scenarios that break the rules on purpose
    out["live_after_teardown"] = live()
    out["destroyed_stream_is_caught"] = destroyed_stream_is_caught()
    out["the_stand_in_is_strict"] = the_stand_in_is_strict()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
