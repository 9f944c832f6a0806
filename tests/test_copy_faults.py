"""Copies that fail inside the C++ runtime (copy_engine.h invariant 7; docs/CONTRACTS.md invariant 7).

Failures are injected by the test-only copy fault switch of the backends (gpu/copy_faults.h),
which only the test module reaches (``bagualu2_test_hooks.set_copy_faults``): a copy fails at
submission (the engine's offload/reload raises) or at execution (the call returned; the copy
never happens and its ticket fails at ``done()``/``wait()``). The engine leaks no block and
hangs no waiter; the activation runtime keeps an offload's source when its copy fails (a
recorded fallback, training stays bit-exact) and names the activation when a reload fails.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import threading
import time
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch

import bagualu2_test_hooks as hooks  # tests/test_hooks.cpp: the switch, Stream, HostFence
import bagualu2
from bagualu2 import _C
from test_faults import assert_exact, assert_nothing_held, enabled, make_model, step, tokens_for

KiB = 1 << 10
CHUNK = 64 * KiB


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    """Every test starts and ends with the switch off, whatever it left armed."""
    hooks.set_copy_faults("off")
    yield
    hooks.set_copy_faults("off")


@pytest.fixture
def engine() -> Any:
    arena = _C.HostArena(4 << 20, "cpu")
    return _C.CopyEngine(arena, "cpu", -1, CHUNK)  # small chunks: a copy of 256 KiB is 4 memcpys


def rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def assert_round_trip(engine: Any, n: int, seed: int) -> None:
    """A copy after the faults is exact and gives its block back."""
    src = rand_bytes(n, seed)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    dst = torch.zeros(n, dtype=torch.uint8)
    engine.reload(t, dst.data_ptr(), n, 0, True).wait()
    assert torch.equal(dst, src)
    t.release()
    assert engine.arena.stats()["in_use"] == 0


# -- the switch ---------------------------------------------------------------------------------
def test_the_switch_is_reachable_only_from_the_test_module() -> None:
    assert not [name for name in dir(_C) if "fault" in name.lower()]
    with pytest.raises(ValueError, match="mode must be"):
        hooks.set_copy_faults("sometimes")
    with pytest.raises(ValueError, match=">= 0"):
        hooks.set_copy_faults("submit", count=-1)


def test_the_switch_lets_after_copies_through_then_fails_count_and_disarms(engine: Any) -> None:
    src = rand_bytes(1000)
    hooks.set_copy_faults("submit", count=2, after=1)
    assert hooks.copy_faults_left() == 2
    engine.offload(src.data_ptr(), 1000, 0).wait()  # let through
    for _ in range(2):
        with pytest.raises(RuntimeError, match="at submission: injected fault"):
            engine.offload(src.data_ptr(), 1000, 0)
    assert hooks.copy_faults_left() == 0
    assert_round_trip(engine, 1000, seed=1)  # disarmed by itself


# -- failure at submission ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1000, 4 * CHUNK])
def test_an_offload_failed_at_submission_raises_and_leaks_nothing(engine: Any, n: int) -> None:
    src = rand_bytes(n)
    hooks.set_copy_faults("submit", count=1, after=(n - 1) // CHUNK)  # the copy's last chunk
    with pytest.raises(RuntimeError, match=f"memcpy_async of {min(n, CHUNK)} bytes failed at submission"):
        engine.offload(src.data_ptr(), n, 0)
    assert hooks.copy_faults_left() == 0
    stats = engine.arena.stats()
    assert stats["in_use"] == 0 and stats["pending"] == 0
    assert_round_trip(engine, n, seed=2)


@pytest.mark.parametrize("direction", ["offload", "reload"])
def test_a_copy_failed_at_submission_half_way_drains_its_chunks_before_giving_memory_back(
        engine: Any, direction: str) -> None:
    """The chunks enqueued before the failing one still write the offload's block (or the
    reload's destination, which the caller frees when the call raises): the call returns only
    once they ran. They wait behind a stream a gate holds, opened by a timer."""
    n = 4 * CHUNK
    src = rand_bytes(n, seed=3)
    dst = torch.zeros(n, dtype=torch.uint8)
    ticket = None
    if direction == "reload":
        ticket = engine.offload(src.data_ptr(), n, 0)
        ticket.wait()
    held = hooks.Stream("cpu")
    gate = hooks.HostFence()
    held.wait_fence(gate)
    opened: List[bool] = []

    def open_gate() -> None:
        opened.append(True)
        gate.signal()

    timer = threading.Timer(0.3, open_gate)
    hooks.set_copy_faults("submit", count=1, after=2)  # chunks 1 and 2 enqueued, 3 fails
    timer.start()
    try:
        with pytest.raises(RuntimeError, match="at submission"):
            if direction == "offload":
                engine.offload(src.data_ptr(), n, held.handle)
            else:
                engine.reload(ticket, dst.data_ptr(), n, held.handle, True)
        assert opened, "the call returned while chunks it had enqueued could still run"
    finally:
        timer.join()
    if direction == "reload":
        assert torch.equal(dst[:2 * CHUNK], src[:2 * CHUNK])  # what the drained chunks wrote
        ticket.release()
    assert engine.arena.stats()["in_use"] == 0
    assert_round_trip(engine, n, seed=4)


# -- failure at execution ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1000, 4 * CHUNK])
def test_an_offload_failed_at_execution_raises_at_done_and_wait_and_frees_its_block(engine: Any, n: int) -> None:
    src = rand_bytes(n, seed=5)
    hooks.set_copy_faults("execute", count=1, after=n // CHUNK // 2)  # a middle chunk when chunked
    t = engine.offload(src.data_ptr(), n, 0)  # submitted: the failure shows when the copy ends
    assert hooks.copy_faults_left() == 0
    t_failure = f"offload copy \\(device to host\\) of {n} bytes failed: .*at execution: injected fault"
    assert t.finished  # ended (failed): nothing is in flight
    assert t.failure is not None and "device to host" in t.failure
    with pytest.raises(RuntimeError, match=t_failure):
        t.done()
    with pytest.raises(RuntimeError, match=t_failure):
        t.wait()
    with pytest.raises(RuntimeError, match="host_view|failed"):
        t.host_view()
    dst = torch.zeros(n, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"reload of {n} bytes from an offload whose copy failed"):
        engine.reload(t, dst.data_ptr(), n, 0, True)
    stats = engine.stats()
    assert stats["d2h_failed"] == 1 and stats["d2h_copies"] == 0 and stats["d2h_bytes"] == 0
    assert engine.arena.stats()["in_use"] > 0
    t.release()
    arena = engine.arena.stats()
    assert arena["in_use"] == 0 and arena["pending"] == 0  # complete, failed: reusable at once
    assert_round_trip(engine, n, seed=6)
    assert engine.stats()["d2h_copies"] == 1


def test_a_failed_ticket_never_released_frees_its_block_when_it_dies(engine: Any) -> None:
    src = rand_bytes(1000)
    hooks.set_copy_faults("execute", count=1)
    t = engine.offload(src.data_ptr(), 1000, 0)
    assert t.failure is not None
    del t
    assert engine.arena.stats()["in_use"] == 0
    assert_round_trip(engine, 1000, seed=7)


def test_a_failure_shows_when_the_copy_ends_and_wakes_every_waiter(engine: Any) -> None:
    """While the producer holds the copy back, done() is False; a thread blocked in wait() and a
    reload issued meanwhile both learn of the failure when it ends; nothing hangs."""
    n = 2 * CHUNK
    src = rand_bytes(n, seed=8)
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)
    hooks.set_copy_faults("execute", count=1)
    t = engine.offload(src.data_ptr(), n, producer.handle)
    assert not t.done() and t.failure is None and not t.finished
    dst = torch.zeros(n, dtype=torch.uint8)
    r = engine.reload(t, dst.data_ptr(), n, 0, False)  # behind the offload, on the other stream
    errors: List[str] = []

    def waiter() -> None:
        try:
            t.wait()
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    assert thread.is_alive()  # blocked in wait(), GIL released
    gate.signal()
    thread.join(timeout=10)
    assert not thread.is_alive(), "a waiter on a failed copy hung"
    assert errors and "device to host" in errors[0]
    with pytest.raises(RuntimeError, match=f"reload copy \\(host to device\\) of {n} bytes failed: the offload it reads failed"):
        r.wait()
    with pytest.raises(RuntimeError, match="the offload it reads failed"):
        engine.wait_on(r, 0)
    del r
    t.release()
    assert engine.arena.stats()["in_use"] == 0
    assert_round_trip(engine, n, seed=9)


def test_a_reload_failed_at_execution_raises_and_the_next_reload_is_exact(engine: Any) -> None:
    n = 3 * CHUNK
    src = rand_bytes(n, seed=10)
    t = engine.offload(src.data_ptr(), n, 0)
    t.wait()
    dst = torch.zeros(n, dtype=torch.uint8)
    hooks.set_copy_faults("execute", count=1, after=1)
    r = engine.reload(t, dst.data_ptr(), n, 0, True)
    with pytest.raises(RuntimeError, match=f"reload copy \\(host to device\\) of {n} bytes failed: .*at execution"):
        r.done()
    with pytest.raises(RuntimeError, match="host to device"):
        r.wait()
    assert engine.stats()["h2d_failed"] == 1
    t.wait()  # the offload itself is fine
    engine.reload(t, dst.data_ptr(), n, 0, True).wait()
    assert torch.equal(dst, src)
    t.release()
    assert engine.arena.stats()["in_use"] == 0


def test_the_facade_raises_for_a_failed_copy_and_keeps_nothing() -> None:
    from bagualu2.offload import CopyEngine, HostArena

    engine = CopyEngine(HostArena(1 << 20))
    x = torch.randn(100)
    hooks.set_copy_faults("execute", count=1)
    h = engine.offload(x)
    with pytest.raises(RuntimeError, match="device to host"):
        h.wait()
    with pytest.raises(RuntimeError, match="offload whose copy failed"):
        engine.reload(h)
    assert engine.stats()["in_flight"] == 0  # the failed copy's host source was let go
    del h
    assert engine.arena.stats()["in_use"] == 0
    h = engine.offload(x)
    hooks.set_copy_faults("execute", count=1)
    r = engine.reload_async(h)
    with pytest.raises(RuntimeError, match="host to device"):
        r.wait()
    assert torch.equal(engine.reload(h), x)
    del h, r
    engine.prune()
    assert engine.arena.stats()["in_use"] == 0


# -- the activation runtime ----------------------------------------------------------------------
@contextlib.contextmanager
def recorded_frames(prov: Any) -> Iterator[List[Any]]:
    """The frames the provisioner runs meanwhile (their stats hold the fallbacks' reasons)."""
    runtime = prov.runtime
    frames: List[Any] = []
    original = runtime.frame

    def recording(frame: Any) -> Any:
        frames.append(frame)
        return original(frame)

    runtime.frame = recording
    try:
        yield frames
    finally:
        del runtime.frame


class Injected:
    """How many faults a ``faulty_step`` injected."""

    def __init__(self) -> None:
        self.count = 0

    def arm(self, how: Optional[Tuple[str, int, int]]) -> None:
        if how is not None:
            hooks.set_copy_faults(how[0], count=how[1], after=how[2])

    def disarm(self, how: Optional[Tuple[str, int, int]]) -> None:
        if how is not None:
            self.count += how[1] - hooks.copy_faults_left()
        hooks.set_copy_faults("off")


class NotingOffloads(Injected):
    """An ``Injected`` that notes, as backward's faults are armed, the keys of the host copies
    the forward's ``frames`` hold."""

    def __init__(self, frames: List[Any]) -> None:
        super().__init__()
        self.frames = frames
        self.offloaded: List[str] = []

    def arm(self, how: Optional[Tuple[str, int, int]]) -> None:
        if how is not None:
            self.offloaded = [store.key for frame in self.frames for store in frame.offload_stores()]
        super().arm(how)


def faulty_step(model: Any, i: int, spike: float, injected: Injected,
                forward: Optional[Tuple[str, int, int]] = None,
                backward: Optional[Tuple[str, int, int]] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """test_faults.step with the switch armed as ``(mode, count, after)`` for the forward (its
    offloads) or the backward (its reloads) only; disarmed after each."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(i)
    spiked = model.routing_spike(spike, experts=(0,)) if spike else contextlib.nullcontext()
    with spiked:
        injected.arm(forward)
        try:
            loss = model(tokens_for(model, i))
        finally:
            injected.disarm(forward)
        injected.arm(backward)
        try:
            loss.backward()
        finally:
            injected.disarm(backward)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def offloading(fraction: float, reload_in_place: bool) -> Tuple[Any, Any, Any]:
    """``enabled``, with its planner offered offloads only: whether a spike's plan offloads or
    recomputes otherwise depends on costs timed on this machine, and these tests need copies
    for their faults to land on."""
    model, plain, prov = enabled(fraction=fraction, reload_in_place=reload_in_place)
    priced = prov.cost.candidates

    def offloads_only(*args: Any, **kwargs: Any) -> Tuple[List[Any], int]:
        candidates, floor = priced(*args, **kwargs)
        return [dataclasses.replace(c, can_recompute=False) for c in candidates], floor

    prov.cost.candidates = offloads_only
    return model, plain, prov


def fallbacks(frames: List[Any], what: str) -> List[str]:
    return [f for frame in frames for f in frame.stats.fallbacks if what in f]


@pytest.mark.parametrize("reload_in_place", [False, True])
@pytest.mark.parametrize("mode", ["submit", "execute"])
def test_offloads_that_fail_fall_back_are_recorded_and_training_stays_exact(mode: str, reload_in_place: bool) -> None:
    model, plain, prov = offloading(fraction=0.6, reload_in_place=reload_in_place)
    step(model, 0)  # profiled
    step(plain, 0)
    before = prov.report()["fallbacks"]
    injected = Injected()
    ref = step(plain, 1, spike=2.6)
    with recorded_frames(prov) as frames:  # the spike makes it offload (steps 2+: planned away)
        got = faulty_step(model, 1, 2.6, injected, forward=(mode, 3, 0))
    assert torch.equal(ref[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert_nothing_held(prov)
    # The first failure changes what the forward holds, and so what it releases next.
    assert injected.count >= 1, "the forward offloaded nothing for the faults to land on"
    recorded = fallbacks(frames, "injected fault")
    assert len(recorded) == injected.count, recorded
    # At the budget a copy runs synchronously (a failure there becomes a recompute or a keep,
    # "offload failed"); beside its pinned source it is found failed later and the source kept
    # ("offload copy failed ... kept"): offload_all below makes the latter certain.
    assert prov.report()["fallbacks"] - before >= injected.count
    for i in range(2, 4):  # and later steps copy normally
        assert_exact(model, plain, i, spike=2.6)
        assert_nothing_held(prov)


@pytest.mark.parametrize("mode,prefetch", [("submit", False), ("execute", False), ("execute", True)])
def test_a_reload_that_fails_raises_naming_the_activation_and_leaves_nothing_held(mode: str, prefetch: bool) -> None:
    """Backward's first reload fails (a prefetch's, with prefetching): the use raises, naming
    the activation, and once the graph is gone nothing is held. (Whether backward's first
    reload is a prefetch depends on the plan: a prefetch that cannot be submitted is survived,
    see the next test.)"""
    model, plain, prov = offloading(fraction=0.6, reload_in_place=False)
    step(model, 0)
    step(plain, 0)
    if not prefetch:
        prov.runtime.residency.prefetch_bytes = 0
    message = ""
    with recorded_frames(prov) as frames:
        injected = NotingOffloads(frames)
        try:
            faulty_step(model, 1, 2.6, injected, backward=(mode, 1, 0))
        except RuntimeError as e:
            message = str(e)
    stores = injected.offloaded
    assert injected.count == 1 and stores
    prefetches = fallbacks(frames, "prefetch failed")
    assert not prefetches
    assert message.startswith("reloading offloaded activation "), message
    assert any(f"activation {key} (" in message for key in stores), message
    direction = "at submission" if mode == "submit" else "reload copy (host to device)"
    assert direction in message and "injected fault" in message, message
    assert_nothing_held(prov)
    for i in range(2, 4):
        assert_exact(model, plain, i, spike=2.6)
        assert_nothing_held(prov)


@pytest.mark.parametrize("reload_in_place", [False, True])
@pytest.mark.parametrize("mode", ["submit", "execute"])
def test_offload_all_with_failing_copies_keeps_their_sources_and_stays_exact(mode: str, reload_in_place: bool) -> None:
    """Every saved storage offloaded and none over a budget: each copy runs beside its pinned
    source, so a copy failed at execution is found by ``settle`` and its source kept."""
    model = make_model()
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy="offload_all", min_bytes=0)
    prov.runtime.residency.reload_in_place = reload_in_place
    injected = Injected()
    ref = step(plain, 1)
    with recorded_frames(prov) as frames:
        # The forward's first copies: its offloads (a later one may be a recipe's reload).
        got = faulty_step(model, 1, 0.0, injected, forward=(mode, 3, 0))
    assert torch.equal(ref[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert_nothing_held(prov)
    assert injected.count == 3
    recorded = fallbacks(frames, "injected fault")
    assert len(recorded) == 3, recorded
    kept = [f for f in recorded if "offload copy failed" in f and "kept on cpu" in f]
    assert len(kept) == (3 if mode == "execute" else 0), recorded
    assert prov.report()["fallbacks"] >= 3
    for i in range(2, 4):
        assert_exact(model, plain, i)
        assert_nothing_held(prov)


def _tiny_offloaded(reload_in_place: bool = False) -> Tuple[Any, Any, Any, torch.Tensor]:
    from test_activations import Harness
    from bagualu2.offload import CopyEngine, HostArena

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
    engine = CopyEngine(HostArena(4 << 20))
    return model, engine, Harness(model, engine, reload_in_place=reload_in_place), torch.randn(32, 64)


def test_a_copy_still_running_when_backward_needs_it_is_found_failed_then_and_its_source_used() -> None:
    """The forward's copies wait behind a producer a gate holds until backward has started: the
    unpack's reload (or the prefetch) is issued behind the failing copy, fails with it, and the
    store falls back to the source it kept."""
    from test_activations import assert_bitwise, loss_and_grads
    from bagualu2.plan.planner import Choice
    from bagualu2.runtime import Frame

    model, engine, h, x = _tiny_offloaded()
    reference = loss_and_grads(model, h.forward(x, None).sum())
    producer = hooks.Stream("cpu")
    gate = hooks.HostFence()
    producer.wait_fence(gate)
    offload = engine.offload
    engine.offload = lambda t, stream=None: offload(t, stream=producer.handle)  # type: ignore[method-assign]
    frame = Frame(default=Choice.OFFLOAD)
    hooks.set_copy_faults("execute", count=1, after=1)
    loss = h.forward(x, frame).sum()
    engine.offload = offload  # type: ignore[method-assign]
    assert hooks.copy_faults_left() == 0
    stores = frame.offload_stores()
    assert len(stores) >= 2 and all(s.pin is not None and not s.failed for s in stores)  # all in flight
    timer = threading.Timer(0.2, gate.signal)
    timer.start()
    try:
        result = loss_and_grads(model, loss)
    finally:
        timer.join()
    assert_bitwise(reference, result)
    failed = [s for s in stores if s.failed]
    assert len(failed) == 1 and failed[0].handle.released
    assert [f for f in frame.stats.fallbacks if "offload copy failed" in f and "kept on cpu" in f]
    del loss, stores, failed
    h.close()
    gc.collect()
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0



def test_a_prefetch_that_cannot_be_submitted_is_recorded_and_its_use_reloads() -> None:
    from test_activations import assert_bitwise, loss_and_grads
    from bagualu2.plan.planner import Choice
    from bagualu2.runtime import Frame

    model, engine, h, x = _tiny_offloaded()
    reference = loss_and_grads(model, h.forward(x, None).sum())
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(x, frame).sum()
    stores = frame.offload_stores()
    assert stores
    hooks.set_copy_faults("submit", count=1)
    assert not h.runtime.residency.prefetch(stores[-1])
    assert hooks.copy_faults_left() == 0
    assert stores[-1].prefetched is None and frame.prefetch_pending_bytes == 0
    assert [f for f in frame.stats.fallbacks if "prefetch failed" in f and "injected fault" in f]
    assert_bitwise(reference, loss_and_grads(model, loss))
    del loss, stores
    h.close()
    gc.collect()
    assert h.runtime.ledger.resident == 0 and engine.arena.stats()["in_use"] == 0
