"""Faults leave the runtime whole (docs/CONTRACTS.md invariant 7; with 1 and 3).

A KeyboardInterrupt at any point of a step (forward, gating, pack, offload, backward, unpack,
learning, between steps), whether raised by a hook at a chosen point or by a timer signal at a
random one, propagates as itself; once the interrupted graph is dropped the ledger, the pins and
the arena are back to 0, and the next steps are bit-exact against plain PyTorch. Faults inside
the C++ runtime (a copy that fails, an arena that runs out in a spike) become a recorded
fallback or a clear exception.
"""
from __future__ import annotations

import copy
import gc
import random
import signal
import sys
import time
import traceback
from typing import Any, Callable, List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import bagualu2
from bagualu2.runtime.ledger import ResidencyLedger, Pin
from bagualu2.runtime import recipes
from bagualu2.runtime.recipes import StorageNode, is_recomputing
from bagualu2.models import MoEConfig, MoETransformer

BATCH = (2, 32)


def make_model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(dropout=0.1))


def tokens_for(model: MoETransformer, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, model.cfg.vocab_size, BATCH, generator=g)


def step(model: MoETransformer, i: int, spike: float = 0.0) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(i)
    if spike:
        with model.routing_spike(spike, experts=(0,)):
            loss = model(tokens_for(model, i))
            loss.backward()
    else:
        loss = model(tokens_for(model, i))
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def keep_all_peak(model: MoETransformer) -> int:
    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    step(probe, 0)
    return prov.report()["peak_bytes"]


def enabled(fraction: float = 0.7, reload_in_place: bool = True) -> Tuple[MoETransformer, MoETransformer, Any]:
    """A model under a budget its spikes cross (so forwards keep, offload and recompute), and a
    plain copy."""
    model = make_model()
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=int(keep_all_peak(model) * fraction), min_bytes=0)
    prov.runtime.residency.reload_in_place = reload_in_place
    return model, plain, prov


def assert_nothing_held(prov: Any) -> None:
    gc.collect()
    report = prov.report()
    assert report["resident_bytes"] == 0, report["resident_bytes"]
    assert report["arena_in_use_bytes"] == 0, report["arena_in_use_bytes"]
    assert prov.runtime.ledger.pins == 0
    assert prov.runtime.active_frame is None


def assert_no_scope_left() -> None:
    """Nothing an interrupted ``with`` statement's entry pushed is left on the thread."""
    assert torch.is_grad_enabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert not _get_current_dispatch_mode_stack()


def assert_exact(model: MoETransformer, plain: MoETransformer, i: int, spike: float = 0.0) -> None:
    ref, got = step(plain, i, spike), step(model, i, spike)
    assert torch.equal(ref[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))


class Interrupt:
    """Wraps ``fn`` so that its ``at``-th call (1-based) raises KeyboardInterrupt, before or
    after doing its work."""

    def __init__(self, fn: Callable[..., Any], at: int, after: bool = False) -> None:
        self.fn, self.at, self.after, self.calls = fn, at, after, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.at and not self.after:
            raise KeyboardInterrupt(f"injected at call {self.calls}")
        out = self.fn(*args, **kwargs)
        if self.calls == self.at:
            raise KeyboardInterrupt(f"injected after call {self.calls}")
        return out


def _inject(point: str, model: MoETransformer, prov: Any, at: int, after: bool) -> Callable[[], None]:
    """Arm an interrupt at ``point``; returns what disarms it."""
    rt = prov.runtime
    if point == "forward":
        handle = model.layers[1].register_forward_pre_hook(Interrupt(lambda m, a: None, at, after))
        return handle.remove
    if point == "gating":  # a hook on each gate beside bagualu2's: before it takes the routing, or after
        interrupt = Interrupt(lambda: None, at, after)

        def gating(module: Any, args: Any, out: Any) -> None:
            if rt.active_frame is not None and not is_recomputing():  # where bagualu2's hook acts
                interrupt()

        handles = [router.register_forward_hook(gating, prepend=not after) for _, router in model.gates()]

        def disarm() -> None:
            for handle in handles:
                handle.remove()

        return disarm
    if point in ("pack", "unpack") and after:  # a saved-tensor hook has run, its result not yet autograd's
        interrupt = Interrupt(lambda: None, at)
        return rt.on_hook.subscribe(lambda hook, record, seconds: interrupt() if hook == point else None).unsubscribe
    if point == "pack":  # inside the pack hook's scopes, after a traced forward's first save of a key
        saved = Interrupt(lambda key: None, at)
        return rt.on_frame_start.subscribe(lambda frame: frame.on_saved.subscribe(saved)).unsubscribe
    if point == "offload":  # an offload started, its host copy not yet handed to the pack hook
        return rt.residency.on_offload.subscribe(Interrupt(lambda key, nbytes: None, at)).unsubscribe
    if point == "unpack":  # inside the unpack hook, before a released activation is reloaded or rebuilt
        return rt.residency.on_released_unpack.subscribe(Interrupt(lambda key: None, at)).unsubscribe
    if point == "learning":  # a subscriber beside the provisioner's learning: before it, or after
        return rt.residency.on_backward_end.subscribe(Interrupt(lambda: None, at), prepend=not after).unsubscribe
    if point == "backward":
        layer = model.layers[0]
        handle = layer.register_full_backward_hook(Interrupt(lambda m, gi, go: None, at, after))
        return handle.remove
    raise AssertionError(point)


POINTS = ["forward", "gating", "pack", "offload", "unpack", "backward", "learning"]


@pytest.mark.parametrize("point", POINTS)
def test_an_interrupt_at_each_point_of_a_step_leaves_nothing_held_and_the_next_steps_exact(point: str) -> None:
    model, plain, prov = enabled(reload_in_place=point != "unpack")
    step(model, 0)  # profiled
    interrupted = 0
    for k, (at, after) in enumerate([(1, False), (3, True), (7, False)]):
        disarm = _inject(point, model, prov, at, after)
        try:
            step(model, 10 + k, spike=2.6)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            disarm()
        assert_nothing_held(prov)
        assert_no_scope_left()
        assert_exact(model, plain, 20 + k, spike=2.6 if k % 2 else 0.0)
        assert_nothing_held(prov)
    assert interrupted >= 1


def _half_entered(what: str, prov: Any) -> Callable[[], None]:
    """What an interrupt inside a ``with`` statement's entry leaves: the entry's state change
    made, no exit to undo it."""
    rt = prov.runtime
    if what == "grad off":  # a gate's torch.no_grad()
        torch._C._set_grad_enabled(False)
    elif what == "replay count":  # a rebuild's ReplayScope, in backward (grad is off there already)
        recipes.ReplayScope().__enter__()
    elif what == "saved-tensor hooks":  # the frame's saved_tensors_hooks, entered again
        torch._C._autograd._push_saved_tensors_default_hooks(*torch._C._autograd._top_saved_tensors_default_hooks(True))
    elif what == "tracing mode":  # the frame's TracingMode
        rt.mode.__enter__()
    raise KeyboardInterrupt(f"{what} left")


@pytest.mark.parametrize("what", ["grad off", "replay count", "saved-tensor hooks", "tracing mode"])
def test_a_with_entry_an_interrupt_stopped_halfway_leaves_no_state_behind(what: str) -> None:
    model, plain, prov = enabled()
    step(model, 0)
    layer = model.layers[1]
    if what == "replay count":
        handle = layer.register_full_backward_hook(lambda m, gi, go: _half_entered(what, prov))
    else:
        handle = layer.register_forward_pre_hook(lambda m, a: _half_entered(what, prov))
    with pytest.raises(KeyboardInterrupt, match="left"):
        step(model, 1, spike=2.6)
    handle.remove()
    if what != "replay count":  # the forward's end repaired it
        assert_no_scope_left()
    assert_nothing_held(prov)
    assert_exact(model, plain, 2, spike=2.6)
    assert not is_recomputing()  # the next forward's start repaired it
    assert_no_scope_left()
    assert_nothing_held(prov)


def test_an_interrupt_between_forward_and_backward_drops_the_graph_and_nothing_stays() -> None:
    model, plain, prov = enabled()
    step(model, 0)
    for i in range(3):
        torch.manual_seed(i)
        with model.routing_spike(2.6, experts=(0,)):
            loss = model(tokens_for(model, i))
        del loss  # the step ends here: its graph is dropped without a backward
        assert_nothing_held(prov)
    assert_exact(model, plain, 5, spike=2.6)


# Whether the storm's timer is armed. A signal that arrives as the timer is stopped has its
# handler run a little later, past the stop: it must not raise there, outside the step it was
# drawn for (it would escape the storm and end the test session).
_ARMED = [False]


def _raise_interrupt(signum: int, frame: Any) -> None:
    if _ARMED[0]:
        raise KeyboardInterrupt("timer")


def interrupt_storm(seed: int, steps: int) -> int:
    """Steps of an enabled model, each with a timer signal armed at a random delay within about
    a step's time (so it lands anywhere: in bagualu2's code, in torch's, in finalizers, between
    steps); after each, a clean step bit-exact against plain PyTorch and nothing held. Returns
    how many steps the interrupt stopped."""
    # What earlier tests left in this process (compiled graphs, a large heap) is no garbage of
    # the storm: frozen, the collection after each step scans only what the storm made, instead
    # of every object the process holds.
    gc.freeze()
    try:
        return _interrupt_storm(seed, steps)
    finally:
        gc.unfreeze()


def _interrupt_storm(seed: int, steps: int) -> int:
    rng = random.Random(seed)
    model, plain, prov = enabled(reload_in_place=rng.random() < 0.5)
    start = time.perf_counter()
    step(model, 0)
    step(model, 1, spike=2.6)
    seconds = (time.perf_counter() - start) / 2
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    previous_hook = sys.unraisablehook
    # An interrupt in a finalizer is "unraisable". Python's default hook prints it and drops it;
    # pytest's keeps it, and with its traceback the half-finalized object and what it holds,
    # until the test ends: that would count as held here.
    sys.unraisablehook = _drop_unraisable
    interrupted = 0
    try:
        for i in range(2, steps + 2):
            spike = rng.choice([0.0, 0.0, 2.6])
            try:
                _ARMED[0] = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, 1.5 * seconds))
                step(model, i, spike)
                time.sleep(0.5 * seconds)  # between steps
            except KeyboardInterrupt as e:
                interrupted += 1
                # The test's own state: the interrupt may have cut short routing_spike's exit.
                for _, router in model.gates():
                    router.spike = None
                landed = [f"{f.filename.rpartition('/')[2]}:{f.lineno} {f.name}"
                          for f in traceback.extract_tb(e.__traceback__)[-6:-1]]
            else:
                landed = ["between steps or not at all"]
            finally:
                _ARMED[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            try:
                assert_nothing_held(prov)
                assert_no_scope_left()
            except AssertionError as e:
                raise AssertionError(f"after an interrupt at {landed}: {e}") from None
            assert_exact(model, plain, 1000 + i, spike=rng.choice([0.0, 2.6]))
            assert_nothing_held(prov)
            assert not is_recomputing()
    finally:
        _ARMED[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook
    return interrupted


def _drop_unraisable(unraisable: Any) -> None:
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


# How many steps a timer interrupts depends on how steady the machine's step time is (a loaded
# machine stretches steps past the window the timers were drawn for): the floor only checks
# that the storm does interrupt; what each interrupt leaves is checked inside the storm.
def test_timer_interrupts_at_random_points_leave_the_runtime_whole() -> None:
    assert interrupt_storm(seed=7, steps=12) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_timer_interrupts_over_many_steps_leave_the_runtime_whole(seed: int) -> None:
    assert interrupt_storm(seed=seed, steps=80) >= 20


def test_a_frame_an_interrupt_left_open_is_closed_by_the_next_forward() -> None:
    """An interrupt in the frame's cleanup (or in the ``with`` statement's exit, before the
    cleanup began) left the runtime marked as inside a forward, and every later forward raised
    "a provisioned forward started inside another one"."""
    model, plain, prov = enabled()
    step(model, 0)
    rt = prov.runtime
    with rt.on_frame_end.subscribe(Interrupt(lambda frame: None, 1)), pytest.raises(KeyboardInterrupt):
        step(model, 1, spike=2.6)
    assert rt.active_frame is not None  # left open
    assert_exact(model, plain, 2, spike=2.6)
    assert_nothing_held(prov)
    # A frame really running is still told apart: the model called again inside its forward.
    inner = tokens_for(model, 3)
    handle = model.layers[1].register_forward_pre_hook(lambda m, a: model(inner))
    with pytest.raises(RuntimeError, match="inside another one"):
        model(tokens_for(model, 4))
    handle.remove()
    assert_nothing_held(prov)
    assert_exact(model, plain, 5)


def test_a_pin_counts_until_its_death_even_when_no_finalizer_runs() -> None:
    """A pin's count is given back when it dies, without a finalizer an interrupt could stop
    at its first line; release after death, or twice, gives back nothing more."""
    ledger = ResidencyLedger()
    storage = torch.empty(1000, dtype=torch.uint8).untyped_storage()
    pins = [Pin(ledger, storage) for _ in range(3)]
    assert ledger.resident == 1000 and ledger.peak == 1000
    pins[0].drop()
    pins[0].drop()
    assert ledger.resident == 1000
    ref = pins[1]._ref
    del pins[1]
    ledger.release(ref)  # a late release of a dead pin: no KeyError
    assert ledger.resident == 1000
    pins.clear()
    assert ledger.resident == 0 and ledger.pins == 0 and ledger.count(storage._cdata) is None


def test_finalizers_of_half_built_objects_do_not_raise() -> None:
    """An interrupt inside a constructor leaves an object without some of its fields; its
    finalizer then raised AttributeError ('StorageNode' object has no attribute '_weak')."""
    unraisable: List[Any] = []
    import sys

    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        StorageNode.__new__(StorageNode).__del__()
        node = StorageNode.__new__(StorageNode)
        del node
        from bagualu2.runtime.stores import OffloadStore

        store = OffloadStore.__new__(OffloadStore)
        del store
        pin = Pin.__new__(Pin)
        pin.drop() if hasattr(pin, "_ref") else None
        del pin
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not unraisable, [u.exc_value for u in unraisable]


def test_a_copy_that_fails_falls_back_and_is_recorded() -> None:
    """An offload the copy engine cannot submit raised out of the pack hook and killed the
    forward; it is recorded and the storage recomputed (or kept) instead."""
    model, plain, prov = enabled(fraction=0.6, reload_in_place=False)
    step(model, 0)
    offload, calls = prov.engine.offload, [0]

    def failing(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] % 2:
            raise RuntimeError("injected: copy engine failure")
        return offload(t, *args, **kwargs)

    prov.engine.offload = failing
    for i in range(1, 5):
        assert_exact(model, plain, i, spike=2.6)
        assert_nothing_held(prov)
    assert calls[0] > 0
    assert prov.report()["fallbacks"] > 0 and prov.report()["violations"] == 0


def test_an_arena_that_runs_out_in_a_spike_falls_back_without_leaking_a_block() -> None:
    model = make_model()
    plain = copy.deepcopy(model)
    budget = int(keep_all_peak(model) * 0.6)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, arena_bytes=16 << 10, arena_max_bytes=16 << 10)
    prov.runtime.residency.reload_in_place = False
    for i, spike in enumerate([0.0, 0.0, 2.6, 2.6, 0.0, 2.6]):
        assert_exact(model, plain, i, spike)
        assert_nothing_held(prov)
    report = prov.report()
    assert report["violations"] == 0 and report["peak_bytes"] <= budget
    assert report["arena_capacity_bytes"] == 16 << 10
    assert report["saved_bytes_by_choice"]["recompute"] > 0
