"""The device rows of ``bagualu2 selftest`` (bagualu2/cli/selftest.py): what only a GPU can show,
each measured so that it can only pass for the reason it names.

  bandwidth     per-copy GPU event time (no Python or launch overhead in it) of the engine's
                copies (its own start/end events, CopyEngine.stats) against torch's pinned copy
                (Tensor.copy_(non_blocking=True), bracketed by events on one stream), 64 MiB and
                up; target 95% in both directions at every size
  overlap       copies and matmuls sized to take about the same GPU time; from event times,
                the copies' and the matmuls' intervals must overlap by half the shorter phase,
                and the step with both must save half the shorter phase against the two alone.
                The matmuls are queued first: a copy that waited for the compute stream's
                queued work (a prefetch ordered after it) could not overlap them
  oom-allocator the caching allocator's limit (set_per_process_memory_fraction) between what
                recompute_all and keep_all's forward need: the safety net reruns, exact
  oom-driver    the same limit made real: the rest of the device is taken by one tensor, so the
                step's cudaMalloc fails in the driver; safety net, exact
  device>0      a fresh process (the caller's CUDA_VISIBLE_DEVICES kept) that sets the last device
                first, runs offload_all exactly and an engine round trip there, and then asks
                the driver itself whether device 0's primary context is active in that process
                (cuDevicePrimaryCtxGetState: exact, where NVML's process list matched against
                os.getpid() reports host pids or nothing in a container): it must not be;
                NVML's list is recorded beside it, for information
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

MiB = 1 << 20


def _sizes(max_copy: Optional[str]) -> List[int]:
    top = _parse_size(max_copy) if max_copy else 1 << 30
    sizes, n = [], 64 * MiB
    while n <= top:
        sizes.append(n)
        n *= 4
    return sizes or [64 * MiB]


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _torch_copy_ms(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, reps: int) -> float:
    """Median GPU time of one pinned torch copy, bracketed by events on one stream."""
    times = []
    with torch.cuda.stream(stream):
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_bandwidth(device: torch.device, max_copy: Optional[str], reps: int = 5) -> Dict[str, Any]:
    """Engine and pinned-torch GB/s per size and direction, from GPU event times."""
    from bagualu2.offload import CopyEngine, HostArena

    rows = []
    side = torch.cuda.Stream(device)
    for n in _sizes(max_copy):
        engine = CopyEngine(HostArena(2 * n + MiB, "auto", device=device), device=device)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        engine.offload(src).wait()  # warm-up: streams, first touch
        got: Dict[str, float] = {}
        times = []
        for _ in range(reps):  # one copy at a time: its busy time is its own
            engine.reset_stats()
            h = engine.offload(src)
            h.wait()
            times.append(engine.stats()["d2h_busy_s"])
            h.release()
        got["d2h"] = n / sorted(times)[reps // 2] / 1e9
        h = engine.offload(src)
        h.wait()
        times = []
        for _ in range(reps):
            engine.reset_stats()
            engine.reload(h, out=dst)
            engine.synchronize()
            times.append(engine.stats()["h2d_busy_s"])
        got["h2d"] = n / sorted(times)[reps // 2] / 1e9
        exact = torch.equal(dst, src)
        ref = {"d2h": n / _torch_copy_ms(pinned, src, side, reps) / 1e6,
               "h2d": n / _torch_copy_ms(dst, pinned, side, reps) / 1e6}
        for d in ("d2h", "h2d"):
            rows.append({"bytes": n, "direction": d, "engine_GBps": got[d],
                         "torch_pinned_GBps": ref[d], "ratio": got[d] / ref[d], "exact": exact})
        h.release()
        del engine, src, dst, pinned
        torch.cuda.empty_cache()
    return {"rows": rows, "target_ratio": 0.95, "timing": "GPU events, median of %d" % reps}


def check_overlap(device: torch.device) -> Tuple[bool, str, Dict[str, Any]]:
    """Copies (offloads and reloads, 256 MiB each way) against matmuls sized to the same GPU
    time, queued after the matmuls; verdict from event times on the streams."""
    from bagualu2.offload import CopyEngine, HostArena

    n, count = 64 * MiB, 4
    engine = CopyEngine(HostArena(2 * n * count + 16 * MiB, "auto", device=device), device=device)
    srcs = [torch.full((n,), i, dtype=torch.uint8, device=device) for i in range(2 * count)]
    back = [engine.offload(t) for t in srcs[:count]]
    for h in back:
        h.wait()
    a = torch.randn(4096, 4096, device=device)
    compute = torch.cuda.current_stream(device)
    # The sources are complete (synchronized below) before any offload: their producer is an
    # idle stream, so the offloads wait for nothing the compute stream queued, as a prefetch
    # must not either.
    producer = torch.cuda.Stream(device)

    def event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def copies() -> Tuple[List, Dict[str, torch.cuda.Event]]:
        ev = {"d2h0": event(engine.d2h_stream), "h2d0": event(engine.h2d_stream)}
        keep = [engine.offload(t, stream=producer) for t in srcs[count:]] + [engine.reload_async(h) for h in back]
        ev.update(d2h1=event(engine.d2h_stream), h2d1=event(engine.h2d_stream))
        return keep, ev

    def matmuls(k: int) -> Dict[str, torch.cuda.Event]:
        ev = {"c0": event(compute)}
        x = a
        for _ in range(k):
            x = torch.mm(x, a).div_(64.0)
        ev["c1"] = event(compute)
        return ev

    def copy_window(ev: Dict[str, torch.cuda.Event], ref: torch.cuda.Event) -> Tuple[float, float]:
        starts = [ref.elapsed_time(ev[k]) for k in ("d2h0", "h2d0")]
        ends = [ref.elapsed_time(ev[k]) for k in ("d2h1", "h2d1")]
        return min(starts), max(ends)

    # Phase sizes: the copies' GPU time alone, then matmuls to match it.
    torch.cuda.synchronize(device)
    ref = event(compute)
    keep, ev = copies()
    engine.synchronize()
    x0, x1 = copy_window(ev, ref)
    copy_ms = x1 - x0
    del keep
    one = matmuls(4)
    torch.cuda.synchronize(device)
    per_mm = one["c0"].elapsed_time(one["c1"]) / 4
    k = max(4, round(copy_ms / per_mm))
    one = matmuls(k)
    torch.cuda.synchronize(device)
    compute_ms = one["c0"].elapsed_time(one["c1"])

    torch.cuda.synchronize(device)
    ref = event(compute)
    mm = matmuls(k)  # queued first: the copies after it must not wait for them
    keep, ev = copies()
    engine.synchronize()
    torch.cuda.synchronize(device)
    x0, x1 = copy_window(ev, ref)
    c0, c1 = ref.elapsed_time(mm["c0"]), ref.elapsed_time(mm["c1"])
    both_ms = max(x1, c1) - min(x0, c0)
    overlap_ms = max(0.0, min(x1, c1) - max(x0, c0))
    shorter = min(copy_ms, compute_ms)
    saved = copy_ms + compute_ms - both_ms
    del keep
    for h in back:
        h.release()
    data = {"copy_ms": copy_ms, "compute_ms": compute_ms, "both_ms": both_ms,
            "overlap_ms": overlap_ms, "saved_ms": saved, "matmuls": k,
            "bytes_each_way": n * count, "rule": "overlap >= 0.5 and saved >= 0.5 of the shorter phase"}
    ok = overlap_ms >= 0.5 * shorter and saved >= 0.5 * shorter
    line = (f"copies {copy_ms:.1f} ms, matmuls {compute_ms:.1f} ms alone; together {both_ms:.1f} ms, "
            f"intervals overlap {overlap_ms:.1f} ms ({overlap_ms / shorter:.0%} of the shorter)")
    return ok, line, data


def take_device_memory(device: torch.device, leave: int) -> Optional[torch.Tensor]:
    """One tensor holding all of the device but `leave` bytes beyond what torch reserved now,
    so a later cudaMalloc past that fails in the driver (a real out-of-memory, not the caching
    allocator's limit). None when there is not that much free."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    take = free - leave
    if leave < 0 or take <= 0:
        return None
    return torch.empty(take, dtype=torch.uint8, device=device)


# -- device>0, in a fresh process ------------------------------------------------------------------
def primary_context_active(device: int) -> bool:
    """Whether ``device``'s primary context is active in this process, from the CUDA driver
    (the library bagualu2's cuda backend loads: ``BAGUALU2_CUDA_LIBRARY``, else libcuda.so.1).
    Raises RuntimeError when the driver cannot answer."""
    import ctypes

    name = os.environ.get("BAGUALU2_CUDA_LIBRARY") or "libcuda.so.1"
    driver = ctypes.CDLL(name)
    handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(handle), device)),
                       ("cuDevicePrimaryCtxGetState", (handle, ctypes.byref(flags), ctypes.byref(active)))):
        status = getattr(driver, call)(*args)
        if status != 0:
            raise RuntimeError(f"{call} failed with CUDA error {status} ({name})")
    return bool(active.value)


def _nvml_context_pids(uuid: str) -> Optional[List[int]]:
    """PIDs holding a context on the GPU of `uuid` (NVML's compute processes), or None when
    neither pynvml nor nvidia-smi can tell. Information only: in a container NVML lists host
    pids or nothing, so the device>0 verdict is the driver's (primary_context_active)."""
    want = uuid.lower().removeprefix("gpu-")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                got = pynvml.nvmlDeviceGetUUID(h)
                got = got.decode() if isinstance(got, bytes) else got
                if got.lower().removeprefix("gpu-") == want:
                    return [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, or an NVML it cannot drive: ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run([smi, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return None
    pids = []
    for line in out.stdout.splitlines():
        pid, _, gpu = line.partition(",")
        if gpu.strip().lower().removeprefix("gpu-") == want:
            pids.append(int(pid))
    return pids


def device_probe(seed: int) -> Dict[str, Any]:
    """The fresh process of the device>0 row: last device set first, as a torchrun rank does."""
    import gc

    import bagualu2
    from bagualu2.cli.selftest_model import Bench, same
    from bagualu2.offload import CopyEngine, HostArena

    index = torch.cuda.device_count() - 1
    torch.cuda.set_device(index)
    dev = torch.device("cuda", index)
    bench = Bench(dev, True, seed, (4, 64))
    torch.use_deterministic_algorithms(True)
    ref = bench.step(bench.fresh(), 0, 2.6)
    model = bench.fresh()
    prov = bagualu2.enable(model, budget=None, policy="offload_all", min_bytes=0)
    got = bench.step(model, 0, 2.6)
    prov.disable()
    engine = CopyEngine(HostArena(8 * MiB, "auto"))
    t = torch.arange(1 << 20, device=dev, dtype=torch.int32)
    back = engine.reload(engine.offload(t))
    torch.cuda.synchronize(dev)
    del engine
    gc.collect()  # finalizers of everything above, on whatever thread collects
    torch.cuda.synchronize(dev)
    active = primary_context_active(0)  # the verdict, read before anything below asks about GPU 0
    pids = _nvml_context_pids(str(torch.cuda.get_device_properties(0).uuid))
    return {"device": index, "offload_all_exact": same(ref, got),
            "round_trip_exact": bool(back.device == dev and torch.equal(back, t)),
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "context_on_device0": active, "pid": os.getpid(), "nvml_device0_pids": pids}


def check_other_device(seed: int) -> Tuple[bool, str, Dict[str, Any]]:
    # The environment as the caller has it: the devices it sees are the ones checked.
    code = f"import json; from bagualu2.cli.selftest_device import device_probe; print(json.dumps(device_probe({seed})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    if out.returncode != 0:
        return False, f"probe process failed ({out.returncode}): {out.stderr[-300:]}", {}
    data = json.loads(out.stdout.strip().splitlines()[-1])
    ctx = data["context_on_device0"]
    ok = data["offload_all_exact"] and data["round_trip_exact"] and ctx is False
    line = (f"cuda:{data['device']} set first in a fresh process: offload_all "
            f"{'exact' if data['offload_all_exact'] else 'NOT exact'}, round trip "
            f"{'exact' if data['round_trip_exact'] else 'wrong'}, device 0's primary context "
            f"(cuDevicePrimaryCtxGetState): {'ACTIVE' if ctx else 'inactive'}")
    return ok, line, data

