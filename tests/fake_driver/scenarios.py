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
DRIVER.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
DRIVER.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
DEVICE = 2
N = 1 << 16


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


def data(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def host_bytes(ticket) -> bytes:
    return ctypes.string_at(ticket.host_ptr, ticket.nbytes)


def foreign_threads() -> dict:
    """Work and finalizers on threads that have no context, or another device's."""
    obs: dict = {"main_device_before": DRIVER.fake_cuda_current_device()}
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    src, dst = data(1), torch.zeros(N, dtype=torch.uint8)

    def copy_round_trip() -> bool:
        t = engine.offload(src.data_ptr(), N, 0)
        t.wait()
        r = engine.reload(t, dst.data_ptr(), N, 0, True)
        r.wait()
        engine.stats()
        return torch.equal(dst, src)

    obs["no_context_thread"] = in_thread(copy_round_trip)
    before = driver_state()["default_stream_uses"]
    obs["device1_thread"] = in_thread(copy_round_trip, bind=1)
    after = driver_state()["default_stream_uses"]
    obs["default_stream_uses_delta"] = [a - b for a, b in zip(after, before)]

    # Finalizers: the last references die in a cycle collected on a thread with no context.
    left = engine.offload(src.data_ptr(), N, 0)  # an unreleased ticket frees its block on death
    reloaded = engine.reload(left, dst.data_ptr(), N, 0, False)
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
    src, final = data(2), data(3)
    producer, gate = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    producer.wait_fence(gate)
    producer.copy(src.data_ptr(), final.data_ptr(), N)
    ticket = engine.offload(src.data_ptr(), N, producer.handle)
    time.sleep(0.05)
    obs["offload_done_while_producer_held"] = ticket.done()
    gate.signal()
    ticket.wait()
    obs["offload_saw_producer_data"] = host_bytes(ticket) == bytes(final.numpy())

    # Reload after the consumer's earlier read of dst, and before its later one.
    dst, old = data(4), data(4)
    seen_before, seen_after = torch.zeros(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
    consumer, gate = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    consumer.wait_fence(gate)
    consumer.copy(seen_before.data_ptr(), dst.data_ptr(), N)
    r = engine.reload(ticket, dst.data_ptr(), N, consumer.handle, True)
    consumer.copy(seen_after.data_ptr(), dst.data_ptr(), N)
    time.sleep(0.05)
    obs["reload_done_while_consumer_held"] = r.done()
    gate.signal()
    consumer.synchronize()
    obs["consumer_read_old_before_reload"] = torch.equal(seen_before, old)
    obs["consumer_read_reloaded_after"] = torch.equal(seen_after, final)

    # wait_on: the reload cannot start before its offload, held behind a producer.
    src2, final2 = data(5), data(6)
    producer2, gate2 = hooks.Stream("cuda", DEVICE), hooks.HostFence()
    producer2.wait_fence(gate2)
    producer2.copy(src2.data_ptr(), final2.data_ptr(), N)
    t2 = engine.offload(src2.data_ptr(), N, producer2.handle)
    dst2, seen2 = torch.zeros(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
    consumer2 = hooks.Stream("cuda", DEVICE)
    r2 = engine.reload(t2, dst2.data_ptr(), N, 0, False)
    engine.wait_on(r2, consumer2.handle)
    consumer2.copy(seen2.data_ptr(), dst2.data_ptr(), N)
    time.sleep(0.05)
    gate2.signal()
    consumer2.synchronize()
    obs["wait_on_orders_consumer_after_reload"] = torch.equal(seen2, final2)
    return obs


def wrong_device() -> dict:
    """Streams of another device are refused; a thread with no device cannot create objects
    without naming one."""
    arena = _C.HostArena(4 * N, "cuda", 0, DEVICE)
    engine = _C.CopyEngine(arena, "cuda", DEVICE)
    other = hooks.Stream("cuda", 1)
    src = data(7)
    obs: dict = {}

    def error(fn: Callable[[], object]) -> str:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return ""

    obs["offload"] = error(lambda: engine.offload(src.data_ptr(), N, other.handle))
    t = engine.offload(src.data_ptr(), N, 0)
    t.wait()
    dst = torch.zeros(N, dtype=torch.uint8)
    obs["reload"] = error(lambda: engine.reload(t, dst.data_ptr(), N, other.handle, True))
    obs["wait_on"] = error(lambda: engine.wait_on(t, other.handle))
    obs["unknown_handle"] = error(lambda: engine.offload(src.data_ptr(), N, 0x12345))
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


SCENARIOS: Dict[str, Callable[[], dict]] = {
    "foreign_threads": foreign_threads,
    "stream_lifetime": stream_lifetime,
    "ordering": ordering,
    "wrong_device": wrong_device,
}


def main() -> None:
    out: dict = {"status": _C.backend_status()["cuda"]}
    for name, fn in SCENARIOS.items():
        out[name] = fn()
    gc.collect()
    out["driver"] = driver_state()  # before the scenario that breaks the rules on purpose
    out["destroyed_stream_is_caught"] = destroyed_stream_is_caught()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
