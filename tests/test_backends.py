"""Backends: compiled vs usable, runtime libraries loaded at first use, selection that follows
torch (csrc/gpu/gpu.h, csrc/gpu/device_api.h, docs/backends.md); and, on a device, the
copy engine against torch's streams and caching allocator."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

import bagualu2
from bagualu2 import _C
from bagualu2.offload import CopyEngine, HostArena, backend_for_device, resolve_backend

MiB = 1 << 20


def _status_in_child(**env: str) -> dict:
    """backend_status() of a fresh process (libraries are looked for once per process), with
    `env` added, and whether the cpu backend still round-trips a tensor there."""
    code = """
import json, torch, bagualu2
from bagualu2.offload import CopyEngine, HostArena
engine = CopyEngine(HostArena(1 << 20))
t = torch.arange(1000, dtype=torch.float32)
ok = torch.equal(engine.reload(engine.offload(t)), t)
errors = {}
for name in ("cuda", "hip"):
    try:
        bagualu2._C.HostArena(1 << 20, name)
    except Exception as e:
        errors[name] = [type(e).__name__, str(e)]
print(json.dumps({"status": bagualu2.backend_status(), "cpu_ok": ok, "errors": errors}))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_status_tells_compiled_from_usable_with_a_reason() -> None:
    status = bagualu2.backend_status()
    assert set(status) == {"cpu", "cuda", "hip"}
    assert status["cpu"] == {"compiled": True, "usable": True, "reason": "", "library": ""}
    assert [n for n, s in status.items() if s["compiled"]] == bagualu2.backends()
    for name, s in status.items():
        assert s["usable"] or s["reason"], f"{name}: not usable must say why"
        assert s["compiled"] or "not compiled" in s["reason"]


@pytest.mark.skipif("hip" not in _C.backends(), reason="a build without the hip backend")
def test_a_missing_hip_library_leaves_import_and_cpu_working_and_names_the_library() -> None:
    got = _status_in_child(BAGUALU2_HIP_LIBRARY="/nonexistent/libamdhip64.so")
    hip = got["status"]["hip"]
    assert hip["compiled"] and not hip["usable"]
    assert "libamdhip64" in hip["reason"] and "Install ROCm" in hip["reason"]
    assert got["cpu_ok"]
    kind, message = got["errors"]["hip"]
    assert kind == "RuntimeError" and "compiled in but not usable" in message and "libamdhip64" in message


@pytest.mark.skipif("cuda" not in _C.backends(), reason="a build without the cuda backend")
def test_a_missing_cuda_driver_names_libcuda_and_how_to_get_it() -> None:
    got = _status_in_child(BAGUALU2_CUDA_LIBRARY="/nonexistent/libcuda.so.1")
    cuda = got["status"]["cuda"]
    assert cuda["compiled"] and not cuda["usable"]
    assert "libcuda.so.1" in cuda["reason"] and "NVIDIA driver" in cuda["reason"]
    assert got["cpu_ok"] and got["errors"]["cuda"][0] == "RuntimeError"


def test_test_hooks_are_not_in_the_shipped_module() -> None:
    assert not hasattr(_C, "Stream") and not hasattr(_C, "HostFence")


def test_cpu_and_meta_devices_never_get_a_gpu_backend() -> None:
    assert backend_for_device("cpu") == "cpu"
    assert backend_for_device(torch.device("meta")) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_without_a_torch_gpu_auto_is_cpu_and_a_gpu_backend_is_refused_with_the_reason() -> None:
    assert resolve_backend("auto") == "cpu"
    for name in bagualu2.backends()[1:]:
        with pytest.raises(RuntimeError, match="not usable"):
            HostArena(MiB, name)
    with pytest.raises(RuntimeError, match="sees none"):
        backend_for_device("cuda")


def test_unknown_backend_names_the_compiled_ones() -> None:
    with pytest.raises(ValueError, match=r"compiled backends: \['cpu'"):
        resolve_backend("tpu")


def test_disable_releases_the_pinned_arena() -> None:
    """Pinned memory is released at disable (once no graph holds an offload)."""
    from bagualu2.models import MoEConfig, MoETransformer

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = MoETransformer(MoEConfig.tiny()).to(device)
    prov = bagualu2.enable(model, budget=None, policy="offload_all", min_bytes=0)
    model(torch.randint(0, 64, (2, 32), device=device)).backward()
    assert prov.report()["saved_bytes_by_choice"]["offload"] > 0
    engine, arena = weakref.ref(prov.engine), weakref.ref(prov.engine.arena)  # the arena's last holders
    prov.disable()
    gc.collect()
    assert engine() is None and arena() is None


# -- on a device ---------------------------------------------------------------------------------
@pytest.mark.cuda_only
def test_offload_waits_for_torchs_current_stream() -> None:
    """Invariant 4: the copy starts after the producer (torch's current stream) wrote the
    tensor, even when that is a side stream held back by a long kernel."""
    engine = CopyEngine(HostArena(64 * MiB, "auto"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.zeros(8 * MiB // 4, device="cuda")
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write
        t.fill_(7.0)
        h = engine.offload(t)  # producer: the current stream, i.e. `side`
    h.wait()
    assert torch.equal(h.host_view(), torch.full_like(t, 7.0, device="cpu"))


@pytest.mark.cuda_only
def test_a_freed_source_is_not_reused_before_its_offload_copy_ends() -> None:
    """record_stream on the engine's D2H stream: the caching allocator does not hand the
    source's block out while the copy may still read it."""
    engine = CopyEngine(HostArena(64 * MiB, "auto"))
    d2h = engine.d2h_stream
    with torch.cuda.stream(d2h):
        torch.cuda._sleep(50_000_000)  # the copy queues behind this
    t = torch.full((8 * MiB // 4,), 3.0, device="cuda")
    h = engine.offload(t)
    del t
    clobber = torch.empty(8 * MiB // 4, device="cuda")
    clobber.fill_(-1.0)  # the source's block, if the allocator reused it too soon
    h.wait()
    assert torch.equal(h.host_view(), torch.full((8 * MiB // 4,), 3.0))


@pytest.mark.cuda_only
def test_a_reload_consumed_on_another_stream_is_complete_there() -> None:
    engine = CopyEngine(HostArena(64 * MiB, "auto"))
    t = torch.arange(4 * MiB, device="cuda", dtype=torch.int32)
    h = engine.offload(t)
    h2d = engine.h2d_stream
    with torch.cuda.stream(h2d):
        torch.cuda._sleep(50_000_000)  # the reload queues behind this
    pending = engine.reload_async(h)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        back = pending.wait(stream=consumer)  # the consumer stream waits for the copy
        doubled = back * 2
    consumer.synchronize()
    assert torch.equal(doubled, t * 2)


@pytest.mark.cuda_only
def test_engine_streams_follow_torchs_device() -> None:
    dev = torch.cuda.current_device()
    engine = CopyEngine(HostArena(MiB, "auto"))
    assert engine.device == torch.device("cuda", dev)
    with pytest.raises(ValueError, match="out of range"):
        _C.CopyEngine(_C.HostArena(MiB, engine.backend), engine.backend, torch.cuda.device_count())


@pytest.mark.cuda_only
def test_a_tensor_recorded_on_a_dead_engines_stream_is_freed_safely() -> None:
    """The copy streams outlive the engine: torch's allocator records an event on them when a
    tensor recorded there is freed, inside a storage deleter, where an error aborts the process
    (a fresh process, so an abort fails this test instead of the run)."""
    code = """
import gc, torch
from bagualu2.offload import CopyEngine, HostArena
engine = CopyEngine(HostArena(64 << 20, "auto"))
t = torch.ones(8 << 20, device="cuda")
back = engine.reload_async(engine.offload(t))
del engine
gc.collect()
del t, back
torch.cuda.synchronize()
x = torch.ones(8 << 20, device="cuda")
print("freed", float(x.sum()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "freed" in out.stdout, out.stderr[-3000:]


@pytest.mark.cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_tensor_on_another_device_is_refused_naming_the_engine_to_use() -> None:
    engine = CopyEngine(HostArena(MiB, "auto", device=0), device=0)
    other = torch.ones(1024, device="cuda:1")
    with pytest.raises(ValueError, match="device=1"):
        engine.offload(other)
    h = engine.offload(torch.ones(1024, device="cuda:0"))
    with pytest.raises(ValueError, match="device=1"):
        engine.reload(h, device="cuda:1")
    with pytest.raises(ValueError, match="belongs to device 1"):
        engine.offload(torch.ones(1024, device="cuda:0"), stream=torch.cuda.current_stream(1))


# -- the prototype check (csrc/gpu/check_abi.cpp) ------------------------------------------------
_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
_CUDA_INCLUDE = os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include")


def _check_abi_with(tmp_path, table: str) -> subprocess.CompletedProcess:
    """Compiles check_abi.cpp against <cuda.h> with `table` as gpu/cuda_abi.h (a copy found
    before csrc/ on the include path)."""
    (tmp_path / "gpu").mkdir(exist_ok=True)
    (tmp_path / "gpu" / "cuda_abi.h").write_text(table)
    cxx = os.environ.get("CXX", "c++")
    return subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-DBAGUALU2_CHECK_CUDA_ABI=1",
                           f"-I{tmp_path}", f"-I{_CSRC}", "-isystem", _CUDA_INCLUDE,
                           os.path.join(_CSRC, "gpu", "check_abi.cpp")],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not os.path.exists(os.path.join(_CUDA_INCLUDE, "cuda.h")) or
                    not os.path.isdir(_CSRC), reason="needs the CUDA toolkit's cuda.h and the sources")
def test_the_abi_check_wants_the_name_cuda_h_maps_to_first(tmp_path):
    """Issue #58, 9: a real libcuda exports cuStreamDestroy and cuStreamDestroy_v2 and the
    loader takes the first name it finds, so a table listing the plain name first must not
    compile; the shipped table does."""
    with open(os.path.join(_CSRC, "gpu", "cuda_abi.h")) as f:
        table = f.read()
    shipped = _check_abi_with(tmp_path, table)
    assert shipped.returncode == 0, shipped.stderr[-3000:]
    entry = '"cuStreamDestroy_v2")'
    assert entry in table
    swapped = _check_abi_with(tmp_path, table.replace(entry, '"cuStreamDestroy", "cuStreamDestroy_v2")'))
    assert swapped.returncode != 0
    assert "not the first symbol cuda_api.cpp looks up" in swapped.stderr, swapped.stderr[-3000:]
