"""bagualu2.offload: torch tensors through the engine and back (docs/CONTRACTS.md).

Parametrized over compiled backends with a device present (tests/conftest.py): on cpu the
tensors are host tensors; on cuda/hip they are device tensors.
"""
from __future__ import annotations

import gc
import json
import threading

import pytest
import torch

import bagualu2_test_hooks as hooks  # tests/test_hooks.cpp: test-only Stream and HostFence
from bagualu2 import _C
from bagualu2.offload import CopyEngine, HostArena, OffloadHandle

MiB = 1 << 20

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def random_bits(shape, dtype, device, seed=0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, denormals, -0.0 included) of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape).to(device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return torch.equal(ac.view(-1).view(torch.uint8), bc.view(-1).view(torch.uint8)) \
        if ac.numel() else True


@pytest.fixture
def engine(backend) -> CopyEngine:
    return CopyEngine(HostArena(64 * MiB, backend))


# -- exactness: dtypes, sizes, layouts ---------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact_for_every_dtype(engine, device, dtype):
    t = random_bits((37, 11), dtype, device, seed=3)
    h = engine.offload(t)
    out = engine.reload(h)
    assert out.dtype == dtype and out.shape == t.shape and out.stride() == t.stride()
    assert out.device == t.device
    assert same_bits(out, t)


@pytest.mark.parametrize("numel", [0, 1, 3, 63, 257, 4099, 1_000_003])
def test_round_trip_is_bit_exact_for_any_size_including_zero_and_unaligned(engine, device, numel):
    t = random_bits((numel,), torch.int8, device, seed=numel)
    h = engine.offload(t)
    assert h.nbytes == numel
    assert same_bits(engine.reload(h), t)


LAYOUTS = {
    "scalar": lambda x: x[0, 0, 0],
    "transposed": lambda x: x.transpose(0, 2),
    "channels_last": lambda x: x.unsqueeze(0).contiguous(memory_format=torch.channels_last),
    "storage_offset": lambda x: x[3:],
    "strided_gaps": lambda x: x[::4, :, ::3],
    "expanded": lambda x: x[:, :1, :].expand(-1, 9, -1),
    "narrow_last_dim": lambda x: x[..., 1:3],
    "empty_slice": lambda x: x[:, 2:2],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_non_contiguous_layouts_keep_dtype_shape_and_strides(engine, device, layout):
    base = random_bits((16, 9, 12), torch.float32, device, seed=7)
    t = LAYOUTS[layout](base)
    out = engine.reload(engine.offload(t))
    assert out.shape == t.shape and out.stride() == t.stride() and out.dtype == t.dtype
    assert same_bits(out, t)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_host_view_reads_the_offloaded_bytes_in_place(engine, device, layout):
    """A host consumer's view equals the tensor without copying it back, holds the block past
    release(), and a write through it is what later reloads return."""
    t = LAYOUTS[layout](random_bits((16, 9, 12), torch.float32, device, seed=8))
    h = engine.offload(t)
    view = h.host_view()
    assert view.device.type == "cpu" and view.shape == t.shape and view.dtype == t.dtype
    assert same_bits(view, t.cpu())
    first = (0,) * t.dim()
    if t.numel() and layout != "expanded":  # (an expanded tensor's elements share memory)
        view[first] = 1.5
        assert engine.reload(h)[first].item() == 1.5
    h.release()
    in_use = engine.arena.stats()["in_use"]
    assert (in_use > 0) == (h.nbytes > 0)
    del view
    assert engine.arena.stats()["in_use"] == 0


def test_reload_async_prefetch_returns_the_same_bits(engine, device):
    t = random_bits((1000, 300), torch.bfloat16, device, seed=9)
    h = engine.offload(t)
    r = engine.reload_async(h)
    out = r.wait()
    assert same_bits(out, t)
    with pytest.raises(ValueError, match="twice"):
        r.wait()


def test_a_handle_may_be_reloaded_many_times(engine, device):
    # retain_graph / zero-bubble schedules unpack the same activation more than once.
    t = random_bits((5000,), torch.float16, device, seed=11)
    h = engine.offload(t)
    outs = [engine.reload(h) for _ in range(3)] + [engine.reload_async(h).wait()]
    assert all(same_bits(o, t) for o in outs)


def test_reload_into_out_storage_view(engine, device):
    # The activation runtime offloads uint8 views of whole storages and reloads into one.
    t = random_bits((4096,), torch.float32, device, seed=12)
    view = t.view(torch.uint8)
    h = engine.offload(view)
    out = torch.empty(view.numel(), dtype=torch.uint8, device=device)
    assert engine.reload(h, out=out) is out
    assert same_bits(out.view(torch.float32), t)
    with pytest.raises(ValueError, match="too small"):
        engine.reload(h, out=torch.empty(100, dtype=torch.uint8, device=device))


def test_several_hundred_megabytes_round_trip(backend, device):
    n = 320 * MiB
    engine = CopyEngine(HostArena(n, backend))
    t = torch.empty(n, dtype=torch.uint8, device=device)
    t[::4096] = torch.arange(n // 4096, device=device).to(torch.uint8)  # cheap, non-trivial
    t[-1] = 77
    h = engine.offload(t)
    out = engine.reload(h)
    assert torch.equal(out, t)


# -- ordering and lifetime ---------------------------------------------------------------------
def test_source_is_kept_alive_until_its_copy_completed():
    engine = CopyEngine(HostArena(16 * MiB, backend="cpu"))  # a cpu stream holds the copy
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)  # hold the copy in flight
    t = random_bits((2 * MiB,), torch.uint8, "cpu", seed=13)
    expected = t.clone()
    h = engine.offload(t, stream=producer)
    del t
    gc.collect()
    garbage = [torch.full((2 * MiB,), 255, dtype=torch.uint8) for _ in range(8)]  # reuse freed memory
    assert not h.done()
    gate.signal()
    h.wait()
    assert torch.equal(engine.reload(h), expected)
    del garbage


def test_offload_sees_the_producers_final_data():
    engine = CopyEngine(HostArena(16 * MiB, "cpu"))
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    final = random_bits((3 * MiB,), torch.uint8, "cpu", seed=14)
    t = torch.zeros_like(final)
    producer.wait_fence(gate)
    producer.copy(t.data_ptr(), final.data_ptr(), final.numel())  # producer still writing
    h = engine.offload(t, stream=producer)
    gate.signal()
    assert torch.equal(engine.reload(h), final)


@pytest.mark.cuda_only
def test_device_offload_waits_for_the_producer_kernel(gpu_backend):
    engine = CopyEngine(HostArena(64 * MiB, gpu_backend))
    t = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the current stream busy...
    t.fill_(42)  # ...so the final write lands long after offload() returns
    h = engine.offload(t)
    out = engine.reload(h)
    torch.cuda.synchronize()
    assert bool((out == 42).all())


@pytest.mark.cuda_only
def test_device_reload_on_a_side_stream_is_visible_to_that_stream(gpu_backend):
    engine = CopyEngine(HostArena(64 * MiB, gpu_backend))
    t = torch.randn(1 << 20, device="cuda")
    h = engine.offload(t)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = engine.reload(h)
        s = out.sum()
    torch.cuda.synchronize()
    assert torch.equal(s, t.sum())


def test_dropping_a_handle_frees_its_block(engine, device):
    t = random_bits((MiB,), torch.uint8, device)
    h = engine.offload(t)
    assert engine.arena.stats()["in_use"] >= MiB
    h.wait()
    del h
    gc.collect()
    engine.synchronize()
    assert engine.arena.stats()["in_use"] == 0


def test_exhaustion_returns_none(engine, device):
    big = torch.empty(engine.arena.capacity, dtype=torch.uint8, device=device)
    h = engine.offload(big)
    assert h is not None
    assert engine.offload(torch.ones(10, device=device)) is None
    h.release()
    engine.synchronize()
    assert engine.offload(torch.ones(10, device=device)) is not None


def test_a_growing_arena_takes_offloads_past_its_first_segment(backend, device):
    engine = CopyEngine(HostArena(MiB, backend, max_capacity=12 * MiB))
    tensors = [random_bits((3 * MiB // 4,), torch.float32, device, seed=i) for i in range(3)]
    handles = [engine.offload(t) for t in tensors]
    assert all(h is not None for h in handles)
    assert len(engine.arena.segments) > 1
    for t, h in zip(tensors, handles):
        assert same_bits(engine.reload(h), t)
    assert engine.offload(torch.empty(4 * MiB, dtype=torch.uint8, device=device)) is None, \
        "grew past max_capacity"


# -- misuse ------------------------------------------------------------------------------------
def test_misuse_raises_clear_errors(engine, device):
    t = random_bits((1000,), torch.float32, device)
    h = engine.offload(t)
    h.release()
    assert h.released
    with pytest.raises(ValueError, match="release"):
        h.wait()
    with pytest.raises(ValueError, match="release"):
        h.done()
    with pytest.raises(ValueError, match="release"):
        h.release()
    with pytest.raises(ValueError, match="released"):
        engine.reload(h)
    with pytest.raises(TypeError):
        engine.offload(t.tolist())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        engine.reload("not a handle")  # type: ignore[arg-type]
    other = CopyEngine(HostArena(MiB, engine.backend))
    with pytest.raises(ValueError, match="another CopyEngine"):
        other.reload(engine.offload(t))
    with pytest.raises(ValueError, match="contiguous"):
        engine.reload(engine.offload(t), out=torch.empty(4000, 2, dtype=torch.uint8, device=device).t())


def test_backend_selection_errors_name_what_is_compiled():
    with pytest.raises(ValueError, match="compiled backends"):
        HostArena(MiB, backend="tpu")
    if "cuda" not in _C.backends():
        with pytest.raises(ValueError, match=r"compiled backends: \['cpu'"):
            HostArena(MiB, backend="cuda")
    cpu_engine = CopyEngine(HostArena(MiB))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="cpu backend"):
            cpu_engine.offload(torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match="compiled backends"):
        CopyEngine(HostArena(MiB), backend="nope")
    gpu = [b for b in _C.backends() if b != "cpu"]
    if gpu and torch.cuda.is_available():
        with pytest.raises(ValueError, match="differs"):
            CopyEngine(HostArena(MiB), backend=gpu[0])


# -- concurrency -------------------------------------------------------------------------------
def test_many_threads_through_one_engine_stay_bit_exact(engine, device):
    errors = []

    def worker(k: int) -> None:
        try:
            for i in range(25):
                t = random_bits((1 + 997 * i * (k + 1) % 300_000,), torch.float32, device, seed=k * 100 + i)
                h = engine.offload(t)
                if h is None:
                    continue
                out = engine.reload_async(h).wait() if i % 2 else engine.reload(h)
                if device.type != "cpu":
                    torch.cuda.current_stream().synchronize()
                assert same_bits(out, t), f"thread {k} iteration {i}"
                h.release()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    engine.synchronize()
    s = engine.stats()
    assert s["d2h_bytes"] == s["h2d_bytes"] > 0
    assert isinstance(engine.arena.stats()["peak_in_use"], int)


def test_handle_reports_metadata(engine, device):
    t = random_bits((3, 5), torch.int16, device)
    h = engine.offload(t)
    assert isinstance(h, OffloadHandle)
    assert (h.nbytes, h.dtype, tuple(h.shape), h.stride) == (30, torch.int16, (3, 5), (5, 1))
    h.wait()
    assert h.done() and "done" in repr(h)


def test_bench_offload_command_measures_every_size_against_the_baselines(tmp_path) -> None:
    from bagualu2.cli import main

    out = tmp_path / "bench"
    rc = main(["bench", "offload", "--min-size", "64K", "--max-size", "256K", "--min-time", "0.001",
               "--min-iters", "1", "--max-iters", "2", "--passes", "1", "--no-plot", "--quiet", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["bytes"] for r in result["results"]] == [64 << 10, 256 << 10]
    for row in result["results"]:
        for direction in ("d2h", "h2d"):
            measured = row[direction]
            assert measured["engine"]["GBps"] > 0 and measured["memcpy"]["GBps"] > 0
            best = measured["best_baseline"]
            assert measured["ratio"] == pytest.approx(measured["engine"]["GBps"] / measured[best]["GBps"])


@pytest.mark.parametrize("argv, match", [
    (["--min-size", "0"], "--min-size 0 must be at least 1"),  # a size that never grows
    (["--step", "1"], "--step 1 must be at least 2"),
    (["--passes", "0"], "--passes 0 must be at least 1"),
    (["--min-iters", "5", "--max-iters", "2"], "--max-iters 2 must be at least 5"),
    (["--min-time", "-1"], "--min-time -1.0 must be >= 0"),
    (["--backend", "tpu"], "--backend: backend 'tpu' is not compiled"),
])
def test_bench_offload_command_refuses_bad_arguments_by_name(tmp_path, argv, match) -> None:
    from bagualu2.cli import main

    with pytest.raises(SystemExit, match=match):
        main(["bench", "offload", "--out", str(tmp_path / "bench"), "--no-plot", "--quiet", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_bench_offload_command_names_a_gpu_backend_it_cannot_use(tmp_path) -> None:
    from bagualu2.cli import main

    gpu = next((b for b in _C.backends() if b != "cpu"), "cuda")
    match = "compiled in but not usable" if gpu in _C.backends() else "is not compiled"
    with pytest.raises(SystemExit, match=match):
        main(["bench", "offload", "--backend", gpu, "--out", str(tmp_path / "bench"), "--no-plot", "--quiet"])


# -- which stream the facade's own work runs on (issue #58, 1-3) -----------------------------------
# On a machine without a GPU: torch.cuda's stream calls, the device allocations and the _C
# engine are stand-ins that record which stream was current when the facade allocated or
# compacted, and which stream handle it handed the engine to order the copy after.
class _Stream:
    def __init__(self, name: str, handle: int) -> None:
        self.name, self.cuda_stream = name, handle


class _OnDevice(torch.Tensor):
    """A host tensor the facade takes for one on cuda:0; records the stream it compacts on."""

    log: list = []
    current: list = []

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def contiguous(self, *args, **kwargs):
        _OnDevice.log.append(("contiguous", _OnDevice.current[-1].name))
        return super().contiguous(*args, **kwargs)

    def record_stream(self, stream) -> None:
        _OnDevice.log.append(("record_stream", stream.name))


class _Ticket:
    released = False
    finished = True
    nbytes = 0


class _Impl:
    def __init__(self) -> None:
        self.calls: list = []

    def offload(self, ptr, nbytes, producer):
        self.calls.append(("offload", producer))
        ticket = _Ticket()
        ticket.nbytes = nbytes
        return ticket

    def reload(self, ticket, dst, cap, consumer, waits):
        self.calls.append(("reload", consumer, waits))
        return _Ticket()

    def synchronize(self) -> None:
        pass


@pytest.fixture
def stream_world(monkeypatch):
    """A gpu CopyEngine of cuda:0 over stand-ins; yields (engine, its _Impl, the compute
    stream, a side stream)."""
    import contextlib

    compute, side = _Stream("compute", 0x100), _Stream("side", 0x200)
    d2h, h2d = _Stream("d2h", 0x300), _Stream("h2d", 0x400)
    by_handle = {s.cuda_stream: s for s in (compute, side, d2h, h2d)}
    _OnDevice.log, _OnDevice.current = [], [compute]

    @contextlib.contextmanager
    def stream(s):
        if s is not None:
            _OnDevice.current.append(s)
        try:
            yield
        finally:
            if s is not None:
                _OnDevice.current.pop()

    def empty(*shape_and_stride, dtype=None, device=None, **_):
        _OnDevice.log.append(("allocate", _OnDevice.current[-1].name))
        return torch.zeros(shape_and_stride[0], dtype=dtype).as_subclass(_OnDevice)

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _OnDevice.current[-1])
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device=None: by_handle[handle])
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_strided", empty)
    engine = CopyEngine.__new__(CopyEngine)
    impl = _Impl()
    engine.backend, engine._gpu, engine.device = "cuda", True, torch.device("cuda", 0)
    engine._impl, engine._inflight, engine._d2h, engine._h2d = impl, __import__("collections").deque(), d2h, h2d
    yield engine, impl, compute, side


def test_a_strided_offload_compacts_on_the_producer_stream_it_names(stream_world):
    """Issue #58, 2: with stream= the copy waits only for that stream, so the compaction of a
    non-contiguous tensor must run there, not on the current stream."""
    engine, impl, compute, side = stream_world
    t = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64).as_subclass(_OnDevice)[:, ::4]
    h = engine.offload(t, stream=side.cuda_stream)
    assert h is not None and h._mode == 1  # compacted
    assert ("contiguous", "side") in _OnDevice.log, _OnDevice.log
    assert impl.calls == [("offload", side.cuda_stream)]


def test_a_prefetch_allocates_on_the_reload_stream_and_waits_for_no_compute(stream_world):
    """Issue #58, 3: reload_async's destination belongs to the reload stream, so the engine is
    not asked to wait for the compute stream (the copy starts at once); the consumer waits at
    wait() and records the tensor. A reload the consumer waits for at once stays on it."""
    engine, impl, compute, side = stream_world
    t = torch.arange(64, dtype=torch.float32).as_subclass(_OnDevice)
    h = engine.offload(t)
    _OnDevice.log.clear()
    prefetch = engine.reload_async(h)
    assert _OnDevice.log[0] == ("allocate", "h2d"), _OnDevice.log
    assert impl.calls[-1] == ("reload", engine._h2d.cuda_stream, False)
    assert prefetch._allocated_on is engine._h2d
    _OnDevice.log.clear()
    engine.reload(h)
    assert _OnDevice.log[0] == ("allocate", "compute") and impl.calls[-1] == ("reload", compute.cuda_stream, True)


def test_the_provisioners_arena_is_on_the_models_device(monkeypatch):
    """Issue #58, 1: make_engine puts the arena (which pins, grows and frees with its device's
    context bound) on the model's device, not torch's current one (GPU 0 for every torchrun
    rank that never called set_device)."""
    import bagualu2.offload as offload
    from bagualu2.provision.copy_engine import make_engine

    made: dict = {}

    class Arena:
        def __init__(self, capacity, backend, max_capacity=None, device=None):
            made["arena_device"] = device

    class Engine:
        def __init__(self, arena, backend, device):
            made["engine_device"] = device

    monkeypatch.setattr(offload, "HostArena", Arena)
    monkeypatch.setattr(offload, "CopyEngine", Engine)
    monkeypatch.setattr(offload, "backend_for_device", lambda device: "cuda")
    model_device = torch.device("cuda", 3)
    make_engine(model_device, 1 << 20, 1 << 21)
    assert made == {"arena_device": model_device, "engine_device": model_device}
