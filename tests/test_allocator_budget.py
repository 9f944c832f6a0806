"""``enable(allocator=...)``: a budget on the whole memory an allocator counts, held by learning
what lies outside the activations at each micro-batch's peak (bagualu2/provision/excess.py).

The meter is benchmarks/versus_static.py's ``AllocationMeter`` (every storage an aten op creates,
while it lives: activations, temporaries, gradients), the CPU's stand-in for
``torch.cuda.memory_allocated`` / ``max_memory_allocated``, read as an allocator view.
"""
from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any, Callable, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.provision.excess import PRIOR_SLOPE, Excess
from test_versus_static import _bench

_CFG = MoEConfig.tiny(ep_size=2)  # a spike on a local expert grows this rank's activations
_BATCH, _SEQ, _IMBALANCE = 2, 32, 4.0
_SPIKES = (8, 12)


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(_CFG)


def _step(model: MoETransformer, i: int) -> None:
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, _CFG.vocab_size, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(i))
    spike = model.routing_spike(_IMBALANCE, experts=[0]) if i in _SPIKES else contextlib.nullcontext()
    with spike:
        model(tokens).backward()


def _peaks(model: MoETransformer, meter: Any, steps: int) -> List[int]:
    """The meter's peak of each micro-batch, forward and backward."""
    out = []
    for i in range(steps):
        meter.peak = meter.bytes
        with meter:
            _step(model, i)
        out.append(meter.peak)
    return out


@pytest.fixture(scope="module")
def budget() -> int:
    """5% above the largest calm micro-batch's whole-memory peak keeping everything (the spikes
    cross it: checked below)."""
    peaks = _peaks(_model(), _bench().AllocationMeter(), 4)
    return int(max(peaks) * 1.05)


def test_the_learned_excess_holds_a_whole_memory_budget_through_spikes_the_ledger_budget_crosses(budget: int) -> None:
    keep = _peaks(_model(), _bench().AllocationMeter(), max(_SPIKES) + 2)
    assert all(keep[i] > budget for i in _SPIKES), (keep, budget)  # keeping everything crosses at the spikes
    runs = {}
    for view in (False, True):
        model, meter = _model(), _bench().AllocationMeter()
        prov = bagualu2.enable(model, budget=budget, min_bytes=0, allocator=meter.read if view else None)
        runs[view] = (_peaks(model, meter, max(_SPIKES) + 2), prov.report())
    (ledger_only, ledger_report), (whole, report) = runs[False], runs[True]
    # The ledger-only budget holds the activations it counts, and the whole memory crosses.
    assert ledger_report["violations"] == 0 and ledger_report["memory_violations"] is None
    assert any(p > budget for p in ledger_only), (ledger_only, budget)
    # With the allocator view every micro-batch's whole-memory peak held, and the provisioner saw so.
    assert max(whole) <= budget, (whole, budget)
    assert report["memory_violations"] == 0 and report["violations"] == 0
    assert report["memory_peak_bytes"] == max(whole[:-1])  # the last window is read by no next forward
    assert 0 < report["excess_bytes"] < budget


def test_the_excess_follows_the_routing_at_the_gate(budget: int) -> None:
    """A spike's excess is predicted from its routing before its experts run: higher than a calm
    micro-batch's, and the activations are held to the budget less it."""
    model, meter = _model(), _bench().AllocationMeter()
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, allocator=meter.read)
    excess = {}
    for i in range(max(_SPIKES) + 1):
        with meter:
            _step(model, i)
        excess[i] = prov.report()["excess_bytes"]
        assert prov.runtime.budget_bytes == budget - excess[i]  # what backward is held to
    assert excess[_SPIKES[0]] > excess[_SPIKES[0] - 1]


def _reads(value: Any) -> Callable[[], Any]:
    return lambda: value


@pytest.mark.parametrize("returned, error, message", [
    ("garbage", TypeError, "returned 'garbage'"),
    ((1, 2, 3), TypeError, r"returned \(1, 2, 3\)"),
    ((1.5, 2), TypeError, r"returned \(1.5, 2\), not two ints"),
    ((True, 2), TypeError, r"returned \(True, 2\), not two ints"),
    ((-1, 5), ValueError, r"negative bytes \(-1, 5\)"),
    ((10, 5), ValueError, "a peak 5 below the bytes allocated now 10"),
])
def test_an_allocator_view_returning_garbage_is_named_with_the_fix(returned: Any, error: type, message: str) -> None:
    model = _model()
    bagualu2.enable(model, budget=1 << 30, allocator=_reads(returned))
    with pytest.raises(error, match=message) as info:
        _step(model, 0)
    assert "(bytes allocated now, peak bytes since its last call)" in str(info.value)


@pytest.mark.parametrize("allocator, error, message", [
    (5, TypeError, r"allocator=5 \(int\) is not callable: pass 'cuda', a callable"),
    ("gpu", ValueError, r"allocator='gpu': pass 'cuda', a callable"),
    ("cuda", ValueError, r"allocator='cuda' needs the model on a CUDA device, it is on cpu"),
])
def test_enable_names_a_wrong_allocator_and_what_to_pass(allocator: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        bagualu2.enable(_model(), budget=1 << 30, allocator=allocator)


def test_without_an_allocator_view_the_report_says_none_and_the_budget_is_the_activations() -> None:
    model = _model()
    prov = bagualu2.enable(model, budget=1 << 30)
    _step(model, 0)
    report = prov.report()
    assert (report["memory_peak_bytes"], report["memory_violations"], report["excess_bytes"]) == (None, None, None)
    assert prov.runtime.budget_bytes == 1 << 30


class _Name(str):
    """A reference to another piece in a saved state, read as its name."""


class _Names(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        return _Name(pid)


class _Renamed(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return str(obj) if isinstance(obj, _Name) else None


def test_the_learned_excess_is_saved_and_resumed_and_a_version_2_state_reads_as_nothing_learned(budget: int) -> None:
    model, meter = _model(), _bench().AllocationMeter()
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, allocator=meter.read)
    for i in range(max(_SPIKES) + 2):
        with meter:
            _step(model, i)
    assert prov.excess.windows > 0
    entry = prov.state_dict()
    fresh = bagualu2.enable(_model(), budget=budget, min_bytes=0, allocator=meter.read)
    fresh.load_state_dict(entry)
    assert vars(fresh.excess) == vars(prov.excess)
    assert [fresh.excess.predict(m) for m in (0, 1 << 12, 1 << 20)] == [prov.excess.predict(m) for m in (0, 1 << 12, 1 << 20)]
    # Version 2 had no excess piece: its state loads, with the excess learned afresh.
    (key, saved), = entry.items()
    learned = _Names(io.BytesIO(saved["learned"])).load()
    del learned["pieces"]["excess"]
    out = io.BytesIO()
    _Renamed(out).dump(learned)
    old = bagualu2.enable(_model(), budget=budget, min_bytes=0, allocator=meter.read)
    old.load_state_dict({key: {**saved, "version": 2, "learned": out.getvalue()}})
    assert old.excess.windows == 0 and old.cost.order == prov.cost.order


# -- the predictor ----------------------------------------------------------------------------

_windows = st.lists(st.tuples(st.integers(0, 1 << 20),        # load
                              st.integers(0, 1 << 20),        # whole-memory peak
                              st.integers(0, 1 << 20)),       # activations' peak
                    min_size=1, max_size=80)


def _needed(excess: Excess, load: int) -> float:
    return max((x - excess.slope * max(0, m - load) for m, x in excess.missed), default=0.0)


@settings(max_examples=200, deadline=None)
@given(_windows, st.integers(1, 1 << 20), st.lists(st.integers(0, 1 << 21), min_size=1, max_size=8))
def test_the_excess_never_uses_a_known_too_low_estimate_twice(windows: List[Tuple[int, int, int]], budget: int,
                                                              loads: List[int]) -> None:
    excess = Excess()
    misses: List[Tuple[int, int]] = []
    for load, peak, activations in windows:
        excess.observe(load, peak, activations, budget)
        if peak > budget:
            misses.append((load, max(0, peak - activations)))
        else:  # a held window: the estimate at its load is no more than it found enough, unless a miss needs more
            assert excess.predict(load) <= max(peak - activations, _needed(excess, load), 0) + 1
        # Every miss so far stays needed from its load up, whatever came after it.
        for m, x in misses:
            for load_then in (m, m + 1, m + (1 << 20)):
                assert excess.predict(load_then) >= x
        assert excess.slope >= PRIOR_SLOPE
        assert len(excess.held) <= 32 and len(excess.missed) <= 32
    predictions = [excess.predict(m) for m in sorted(loads)]
    assert all(p >= 0 for p in predictions)
    assert predictions == sorted(predictions)  # a heavier load is never left less
    assert excess.windows == len(windows) and excess.over == len(misses)
    assert excess.peak == max(p for _, p, _ in windows)


def test_a_miss_at_a_heavier_load_steepens_the_slope_so_lighter_loads_keep_their_estimate() -> None:
    excess = Excess()
    budget = 1000
    excess.observe(100, 900, 850, budget)         # calm: 50 outside, held
    assert excess.predict(100) == 50
    assert excess.predict(200) == 50 + int(PRIOR_SLOPE * 100)  # a spike, predicted by the prior slope
    excess.observe(200, 1100, 800, budget)        # the spike needed 300: missed
    assert excess.predict(200) == 300 and excess.slope == pytest.approx(2.5)
    assert excess.predict(100) == 50              # the calm load keeps what it found enough
    excess.observe(200, 990, 700, budget)         # held at the spike's load with 290: not below the miss
    assert excess.predict(200) == 300


def test_a_cold_start_leaves_room_for_the_gradients_backward_will_allocate() -> None:
    model = _model()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    readings = iter([(7, 7)] + [(0, 0)] * 10)
    prov = bagualu2.enable(model, budget=1 << 30, allocator=lambda: next(readings))
    _step(model, 0)
    assert prov.report()["excess_bytes"] == grads + 7
