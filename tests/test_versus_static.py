"""benchmarks/versus_static.py: the meter every configuration is judged by, the spike trace, and
the head-to-head's short form (slow lane).

The meter must count what a configuration really holds (new storages while alive, views of older
ones never, a storage once however many tensors view it), or the static configurations it keeps
and the violations it counts mean nothing.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

_BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")


@functools.lru_cache(maxsize=None)
def _bench():
    # Imported by name from benchmarks/ (the spawned ranks import it the same way, from the
    # sys.path they inherit).
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module("versus_static")


def test_the_meter_counts_new_storages_while_they_live_and_never_views_of_older_ones() -> None:
    meter_cls = _bench().AllocationMeter
    weight = torch.randn(256, 256)
    with meter_cls() as meter:
        t = weight.t()                      # a view of an older storage: nothing new
        assert meter.bytes == 0
        a = torch.randn(1024)               # 4 KiB
        b = a.view(32, 32)                  # the same storage again
        assert meter.bytes == 4096 and b.numel() == 1024
        c = a * 2                           # 4 KiB more
        assert meter.bytes == 8192
        del a, b
        c = c + 1                           # a's storage died (seen at this op); the old c lives on
        assert meter.bytes == 8192          # until the op after its last reference went
        d = c.sum()                         # the sweep at this op sees the old c gone
        assert meter.bytes == 4096 + d.untyped_storage().nbytes()
    assert meter.peak == 8192 and t.shape == (256, 256)


def test_the_meter_counts_what_a_wrapper_subclass_wraps_not_its_dataless_storage() -> None:
    # A functional collective's result (AsyncCollectiveTensor) and a DTensor are wrapper
    # subclasses: their own storage has a size but no data. Counting it would charge memory that
    # does not exist, to whichever configuration happens to make more of them (a detach of one).
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(1024), torch.randn(1024)
    x = TwoTensor(a, b)
    with _bench().AllocationMeter() as meter:
        y = x * 2                           # two new 4 KiB storages inside one wrapper
        assert meter.bytes == 8192
        z = y.detach()                      # views of the same two: nothing new
        assert meter.bytes == 8192
    assert meter.peak == 8192 and z.shape == (1024,)


def test_the_meters_read_is_an_allocator_view_the_bytes_now_and_the_peak_since_the_last_read() -> None:
    meter = _bench().AllocationMeter()
    with meter:
        a = torch.randn(1024)               # 4 KiB
        b = a * 2                           # 8 KiB
    assert meter.read() == (8192, 8192)
    del b
    assert meter.read() == (4096, 8192)     # b died (swept at the read); held at the last read
    assert meter.read() == (4096, 4096)     # the peak restarts from what is held
    with meter:
        c = a + 1
    assert meter.read() == (8192, 8192) and c.numel() == 1024


def test_the_meter_sees_what_checkpoint_recomputes_in_backward() -> None:
    meter_cls = _bench().AllocationMeter
    w = torch.randn(512, 512, requires_grad=True)
    x = torch.randn(64, 512)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(x @ w) @ w)

    peaks = []
    for use_checkpoint in (False, True):
        w.grad = None
        with meter_cls() as meter:
            y = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
            forward_bytes = meter.bytes
            y.sum().backward()
        peaks.append((forward_bytes, meter.peak))
    (keep_forward, keep_peak), (ckpt_forward, ckpt_peak) = peaks
    assert ckpt_forward < keep_forward        # checkpoint holds less after the forward
    assert ckpt_peak >= 512 * 512 * 4         # and backward's recomputation and w.grad are seen


def test_the_paper_trace_skews_every_micro_batch_after_the_warm_up_and_spikes_a_few() -> None:
    trace = _bench().Trace.make(64, 0.03, 2.6, num_experts=8, warmup=8, paper=True)
    assert all(trace.load(i) == (None, 2.6) for i in range(8))  # the warm-up is balanced
    loads = [trace.load(i) for i in range(8, 64)]
    assert all(e is not None and 1.0 <= m <= 2.6 for e, m in loads)
    assert sum(m > 1.2 for _, m in loads) <= len(trace.spikes) and all(
        1.2 <= trace.load(i)[1] <= 2.6 and trace.load(i)[0] == e for i, e in trace.spikes.items())


def test_the_trace_spikes_on_either_rank_after_the_warm_up() -> None:
    trace = _bench().Trace.make(64, 0.03, 2.6, num_experts=8, warmup=8)
    assert len(trace.spikes) == 2 and min(trace.spikes) >= 8
    assert sorted(trace.spikes.values()) == [0, 7]            # an expert of rank 0, one of the last rank
    calm, *spikes = trace.probes()
    assert calm not in trace.spikes and sorted(spikes) == sorted(trace.spikes)


@pytest.mark.slow
def test_the_short_head_to_head_runs_every_configuration_exactly_and_counts_violations(tmp_path: Path) -> None:
    out = tmp_path / "versus_static.json"
    result = _bench().main(["--quick", "--engines", "pytorch", "--out", str(out)])
    assert out.exists()
    summary = result["engines"]["pytorch"]["summary"]
    ranks = result["engines"]["pytorch"]["ranks"]
    rows = summary["rows"]
    # Every configuration computes the same losses as keeping everything (exactness).
    assert all(row["losses_equal_keep_all"] for row in rows.values()), rows
    assert all(summary["probe_losses_equal"].values()), summary["probe_losses_equal"]
    # The spikes matter: keeping everything crosses the budget at a spike probe on some rank.
    assert rows["keep_all"]["violations"] >= 1 and rows["keep_all"]["probe_peak_over_budget"] > 1.0
    # The survivors held the budget on every rank at every probe, by the same meter.
    for r in ranks:
        for name in r["survivors"]:
            assert max(r["static_peaks"][name].values()) <= r["budget_bytes"], (name, r["static_peaks"][name])
        _check_adaptive_read_its_meter(r)
    assert result["lines"] and result["lines"][0].startswith("pytorch default oracle: ")


def _check_adaptive_read_its_meter(rank: dict) -> None:
    """Adaptive's allocator view was its meter: the highest peak it read covers every micro-batch
    of the trace but the last (whose window no next forward read), it counted a crossing wherever
    the meter did, and it left something outside its activations."""
    report, peaks, budget = rank["adaptive_report"], rank["trace_peaks"]["adaptive"], rank["budget_bytes"]
    assert report["memory_peak_bytes"] >= max(peaks[:-1]), (report, peaks)
    assert report["memory_violations"] >= sum(p > budget for p in peaks[:-1]), (report, peaks, budget)
    assert report["excess_bytes"] > 0


def test_spike_logits_sends_the_asked_share_of_tokens_to_the_expert_and_nothing_without_one() -> None:
    spike = _bench().spike_logits
    logits = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))  # [batch, seq, experts]
    top_k, tokens = 2, 64
    chosen = lambda x, e: int(x.reshape(-1, 8).topk(top_k, dim=-1).indices.eq(e).any(dim=-1).sum())  # noqa: E731
    for expert in (0, 7):
        spiked = spike(logits, expert, 2.6, top_k)
        assert chosen(spiked, expert) == round(2.6 * tokens * top_k / 8)   # 2.6x the mean load
        # Every other token keeps its choice.
        same = spiked.reshape(-1, 8).topk(top_k, dim=-1).indices.eq(expert).any(dim=-1) == \
            logits.reshape(-1, 8).topk(top_k, dim=-1).indices.eq(expert).any(dim=-1)
        assert int((~same).sum()) == chosen(spiked, expert) - chosen(logits, expert)
    assert torch.equal(spike(logits, None, 2.6, top_k), logits)


def _engine_importable(module: str, require: str) -> None:
    with warnings.catch_warnings():
        # The engines warn at import: Megatron-Core that Transformer Engine and Apex are missing,
        # torchtitan's compiler imports that torch.jit.script_method is deprecated.
        warnings.simplefilter("ignore")
        if os.environ.get(require) == "1":
            importlib.import_module(module)  # CI installed it: a failed import fails the run, never skips it
        else:
            pytest.importorskip(module, reason=f"{module} is not installed (docs/engines.md)")


@pytest.mark.slow
@pytest.mark.parametrize("engine, module, require", [
    ("torchtitan", "torchtitan", "BAGUALU2_REQUIRE_TORCHTITAN"),
    ("megatron", "megatron.core", "BAGUALU2_REQUIRE_MEGATRON"),
])
def test_the_short_head_to_head_searches_each_engines_own_options(engine: str, module: str, require: str,
                                                                  tmp_path: Path) -> None:
    _engine_importable(module, require)
    result = _bench().main(["--quick", "--engines", engine, "--out", str(tmp_path / "versus_static.json")])
    summary = result["engines"][engine]["summary"]
    ranks = result["engines"][engine]["ranks"]
    # The engine's grid was searched: every option measured on every rank at every probe.
    assert len(summary["grid"]) >= 4 and summary["survivors"], summary
    for r in ranks:
        assert set(r["static_peaks"]) == set(summary["grid"])
        assert all(len(peaks) == len(r["probes"]) for peaks in r["static_peaks"].values())
        for name in r["survivors"]:  # survivors held the budget under the meter, on every rank
            assert max(r["static_peaks"][name].values()) <= r["budget_bytes"], (name, r["static_peaks"][name])
        _check_adaptive_read_its_meter(r)
    # The engine's recompute options are exact: every static configuration's losses equal
    # keep-all's at the probes, and every run's over the whole trace.
    assert all(summary["probe_losses_equal"].values()), summary["probe_losses_equal"]
    assert all(row["losses_equal_keep_all"] for row in summary["rows"].values()), summary["rows"]
    assert summary["fastest_static"] in summary["survivors"]
    assert len(result["lines"]) == 1 and result["lines"][0].startswith(
        f"{engine} default oracle: adaptive ") and "the fastest static configuration that held the budget" in result["lines"][0]
