"""``enable(allocator=...)``: a budget on the whole memory an allocator counts, held by learning
what lies outside the activations at each micro-batch's peak (bagualu2/provision/excess.py).

The meter is benchmarks/versus_static.py's ``AllocationMeter`` (every CPU storage allocated while
it is on, while it lives: activations, temporaries, gradients), the CPU's stand-in for
``torch.cuda.memory_allocated`` / ``max_memory_allocated``, read as an allocator view.
"""
from __future__ import annotations

import contextlib
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.provision.excess import PRIOR_SLOPE, Excess, WholeMemory
from test_versus_static import _bench

_CFG = MoEConfig.tiny(ep_size=2)  # a spike on a local expert grows this rank's activations
_BATCH, _SEQ, _IMBALANCE = 2, 32, 4.0
_SPIKES = (5, 7)  # after the profiled (2) and calibrating (3) micro-batches


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(_CFG)


def _step(model: MoETransformer, i: int) -> None:
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, _CFG.vocab_size, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(i))
    spike = model.routing_spike(_IMBALANCE, experts=[0]) if i in _SPIKES else contextlib.nullcontext()
    with spike:
        model(tokens).backward()


def _peak(model: MoETransformer, meter: Any, i: int) -> int:
    """The meter's peak of micro-batch ``i``, forward and backward."""
    meter.start()
    with meter:
        _step(model, i)
    return meter.peak


@dataclass
class _Run:
    peaks: List[int]        # the meter's peak of each micro-batch
    excess: List[int]       # what the provisioner left outside the activations, each micro-batch
    limits: List[int]       # what backward was held to (the runtime's budget_bytes)
    prov: Any


@pytest.fixture(scope="module")
def runs() -> Tuple[int, List[int], Dict[bool, _Run]]:
    """The budget (5% above the largest calm micro-batch's whole-memory peak keeping everything),
    keeping everything's peaks, and a run under the ledger-only budget and one with the meter as
    the allocator view (``True``)."""
    steps = max(_SPIKES) + 1
    model, meter = _model(), _bench().AllocationMeter()
    keep = [_peak(model, meter, i) for i in range(steps)]
    budget = int(max(p for i, p in enumerate(keep) if i not in _SPIKES) * 1.05)
    out = {}
    for view in (False, True):
        model, meter = _model(), _bench().AllocationMeter()
        prov = bagualu2.enable(model, budget=budget, min_bytes=0, allocator=meter.read if view else None)
        run = out[view] = _Run([], [], [], prov)
        for i in range(steps):
            run.peaks.append(_peak(model, meter, i))
            run.excess.append(prov.report()["excess_bytes"])
            run.limits.append(prov.runtime.residency.budget_bytes)
    return budget, keep, out


@pytest.mark.slow  # the shared run takes tens of seconds on a shared CPU
def test_the_learned_excess_holds_a_whole_memory_budget_through_spikes_the_ledger_budget_crosses(runs: Any) -> None:
    budget, keep, by_view = runs
    assert all(keep[i] > budget for i in _SPIKES), (keep, budget)  # keeping everything crosses at the spikes
    ledger_only, whole = by_view[False], by_view[True]
    # The ledger-only budget holds the activations it counts, and the whole memory crosses.
    ledger_report = ledger_only.prov.report()
    assert ledger_report["violations"] == 0 and ledger_report["memory_violations"] is None
    assert any(p > budget for p in ledger_only.peaks), (ledger_only.peaks, budget)
    # With the allocator view every micro-batch's whole-memory peak held, and the provisioner saw so.
    report = whole.prov.report()
    assert max(whole.peaks) <= budget, (whole.peaks, budget)
    assert report["memory_violations"] == 0 and report["violations"] == 0
    assert report["memory_peak_bytes"] == max(whole.peaks[:-1])  # the last window is read by no next forward


@pytest.mark.slow  # the shared run takes tens of seconds on a shared CPU
def test_the_excess_follows_the_routing_at_the_gate(runs: Any) -> None:
    """The first spike's excess is predicted from its routing before its experts run: more than
    the calm micro-batch's before it, though no window at its load was seen; and the activations
    (backward too) are held to the budget less each micro-batch's excess.

    Later spikes are left what the first spike's window measured, which on this model lies within
    the run-to-run spread of the calm windows' excess (a few KiB: when the meter sees a storage
    freed), so only the first spike is compared with the calm one before it."""
    budget, _, by_view = runs
    whole = by_view[True]
    first = _SPIKES[0]
    assert whole.excess[first] > whole.excess[first - 1], whole.excess
    assert whole.limits == [budget - e for e in whole.excess]
    assert by_view[False].limits == [budget] * len(whole.limits) and set(by_view[False].excess) == {None}


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
    assert prov.runtime.residency.budget_bytes == 1 << 30


class _Name(str):
    """A reference to another piece in a saved state, read as its name."""


class _Names(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        return _Name(pid)


class _Renamed(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return str(obj) if isinstance(obj, _Name) else None


@pytest.mark.slow  # the shared run takes tens of seconds on a shared CPU
def test_the_learned_excess_is_saved_and_resumed_and_a_version_2_state_reads_as_nothing_learned(runs: Any) -> None:
    budget, _, by_view = runs
    prov = by_view[True].prov
    assert prov.excess.windows > 0
    entry = prov.state_dict()
    fresh = bagualu2.enable(_model(), budget=budget, min_bytes=0, allocator=_reads((0, 0)))
    fresh.load_state_dict(entry)
    loads = (0, 1 << 12, 1 << 20)
    assert [fresh.excess.predict(t, m) for t in (False, True) for m in loads] == \
        [prov.excess.predict(t, m) for t in (False, True) for m in loads]
    assert (fresh.excess.windows, fresh.excess.over, fresh.excess.peak) == \
        (prov.excess.windows, prov.excess.over, prov.excess.peak)
    # Version 2 had no excess piece: its state loads, with the excess learned afresh.
    (key, saved), = entry.items()
    learned = _Names(io.BytesIO(saved["learned"])).load()
    del learned["pieces"]["excess"]
    out = io.BytesIO()
    _Renamed(out).dump(learned)
    old = bagualu2.enable(_model(), budget=budget, min_bytes=0, allocator=_reads((0, 0)))
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


def test_a_spike_that_held_before_is_left_what_it_found_enough_not_a_calm_window_plus_the_slope() -> None:
    """The windows of a versus_static rank that crossed (abridged): a spike held once with 83,268
    bytes outside its activations; a lighter calm window's 39,916 plus the slope's share of the
    load between them is 67,052, less than the spike needed when it came again."""
    excess = Excess()
    budget = 495_440
    excess.observe(43_008, 457_080, 373_812, budget)  # the spike, held: 83,268 outside
    excess.observe(18_944, 473_248, 424_052, budget)  # calm: 49,196
    excess.observe(15_872, 427_888, 387_972, budget)  # a light one: 39,916
    assert excess.predict(43_008) == 83_268
    assert excess.predict(18_944) == 49_196 and excess.predict(15_872) == 39_916  # calm loads keep theirs
    assert excess.predict(50_000) == 83_268 + int(PRIOR_SLOPE * (50_000 - 43_008))  # above it: the slope


def test_a_cold_start_leaves_room_for_the_gradients_backward_will_allocate() -> None:
    model = _model()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    readings = iter([(7, 7)] + [(0, 0)] * 10)
    prov = bagualu2.enable(model, budget=1 << 30, allocator=lambda: next(readings))
    _step(model, 0)
    assert prov.report()["excess_bytes"] == grads + 7


def test_an_untraced_spike_heavier_than_any_untraced_forward_is_left_what_traced_ones_say() -> None:
    """Traced forwards hold more beyond the ledger than untraced ones; a spike's load arriving
    after calm, untraced forwards, heavier than any of them, is left at least what traced forwards
    say there, not the untraced calm excess extrapolated. Calm loads keep their own."""
    memory = WholeMemory()
    budget = 10_000
    for _ in range(3):
        memory.observe(False, 100, 9_000, 8_950, budget)   # calm, untraced: 50 outside
    memory.observe(True, 100, 9_100, 8_950, budget)        # calm, traced: 150 outside
    memory.observe(True, 300, 9_900, 8_900, budget)        # a spike, traced, held: 1000 outside
    assert memory.predict(False, 100) == 50                # calm untraced: its own
    assert memory.predict(True, 100) == 150
    # The spike's load in an untraced forward: what traced ones found enough there (1000), not
    # the untraced calm 50 + the slope's 200, nor the traced calm 150 + 200: a window at the
    # spike's own load shows what it needs, a lighter one's plus the slope only guesses.
    assert memory.predict(True, 300) == 1000
    assert memory.predict(False, 300) == 1000
    assert memory.predict(False, 100) == 50                # and calm untraced forwards keep theirs
