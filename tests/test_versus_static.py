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
from argparse import Namespace
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


def _about(peak: int, held: int) -> bool:
    """A peak of ``held`` bytes, give or take the few bytes of torch's own temporaries (a random
    generator's state, a wrapped scalar), which the allocator hands out too."""
    return held <= peak < held + 64


def test_the_meter_counts_new_storages_while_they_live_and_never_views_of_older_ones() -> None:
    meter_cls = _bench().AllocationMeter
    weight = torch.randn(256, 256)
    outside = torch.randn(1024)             # allocated before the meter: never its own
    with meter_cls() as meter:
        t = weight.t()                      # a view of an older storage: nothing new
        assert meter.bytes == 0
        a = torch.randn(1024)               # 4 KiB
        b = a.view(32, 32)                  # the same storage again
        assert meter.bytes == 4096 and b.numel() == 1024
        c = a * 2                           # 4 KiB more
        assert meter.bytes == 8192
        del a, b                            # a's storage dies with its last reference
        assert meter.bytes == 4096
        c = c + 1                           # the new c is allocated before the old one dies
        assert meter.bytes == 4096 and _about(meter.peak, 8192)
        del outside                         # dies while the meter is on: it was not charged
        assert meter.bytes == 4096
    del c                                   # dies after: taken from the meter that was charged
    assert meter.bytes == 0 and _about(meter.peak, 8192) and t.shape == (256, 256)
    meter.start()
    assert meter.peak == 0


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
    assert _about(meter.peak, 8192) and z.shape == (1024,)


def test_the_meters_read_is_an_allocator_view_the_bytes_now_and_the_peak_since_the_last_read() -> None:
    meter = _bench().AllocationMeter()
    with meter:
        a = torch.randn(1024)               # 4 KiB
        b = a * 2                           # 8 KiB
    now, peak = meter.read()
    assert now == 8192 and _about(peak, 8192)
    del b
    assert meter.read() == (4096, 8192)     # b died; 8 KiB were held since the last read
    assert meter.read() == (4096, 4096)     # the peak restarts from what is held
    with meter:
        c = a + 1
    now, peak = meter.read()
    assert now == 8192 and _about(peak, 8192) and c.numel() == 1024


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
    assert summary["fastest_static"] in summary["survivors_undominated"]
    assert [line.split(":")[0] for line in result["lines"]] == ["pytorch default oracle", "pytorch default tuned"]
    # The tuned run: tuned on the calm micro-batch, it ran the whole trace exactly, every crash
    # charged a measured restart, and its violations are its crashes.
    tuned = rows["tuned"]
    assert tuned["config"] in summary["calm_holders"] and tuned["gave_up_at"] is None
    assert tuned["violations"] == len({c["at"] for c in tuned["crashes"]}) == len(tuned["restarts"])
    assert tuned["total_s"] == pytest.approx(tuned["trace_s"] + tuned["restart_s"])
    assert all(c["process_s"] > 0 and c["checkpoint_s"] > 0 for c in tuned["restarts"])
    assert set(summary["kinds"]["adaptive_cost"]) == {"over keep_all", "over static", "over tuned"}
    assert summary["kinds"]["counts"]["spike"] == len(ranks[0]["spikes"])
    assert set(summary["goals"]) == {"violations", "captured_share_of_ceiling", "over_best_static_tight",
                                     "over_tuned"}


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
        assert set(r["static_peaks"]) == {*summary["grid"], "keep_all"}
        # every probe, and the calm micro-batches the tuned protocol tunes on
        assert all(set(map(str, r["probes"])) <= set(map(str, peaks)) for peaks in r["static_peaks"].values())
        for name in r["survivors"]:  # survivors held the budget under the meter, on every rank
            assert max(r["static_peaks"][name].values()) <= r["budget_bytes"], (name, r["static_peaks"][name])
        _check_adaptive_read_its_meter(r)
    # The engine's recompute options are exact: every static configuration's losses equal
    # keep-all's at the probes, and every run's over the whole trace.
    assert all(summary["probe_losses_equal"].values()), summary["probe_losses_equal"]
    assert all(row["losses_equal_keep_all"] for row in summary["rows"].values()), summary["rows"]
    assert summary["fastest_static"] in summary["survivors_undominated"]
    assert len(result["lines"]) == 2 and result["lines"][0].startswith(
        f"{engine} default oracle: adaptive ") and "the fastest static configuration that held the budget" in result["lines"][0]
    assert result["lines"][1].startswith(f"{engine} default tuned: adaptive ")
    # Its own checkpointing was timed (DCP for torchtitan where it works, as the JSON says).
    assert summary["rows"]["tuned"]["checkpointing"]


# ---------------------------------------------------------------------------------------------
# The picks, the kinds of micro-batch, the restart charges, the goals and the closing lines
# (pure: no processes; an engine's superset order needs no engine installed)
# ---------------------------------------------------------------------------------------------


def _engine(module: str, cls: str, layers: int = 3):
    _bench()  # benchmarks/ on sys.path
    return getattr(importlib.import_module(module), cls)(Namespace(config="tiny", layers=layers, releases=None))


def test_a_pytorch_option_that_recomputes_more_is_never_picked_over_one_that_held_and_recomputes_less() -> None:
    eng = _engine("versus_static_pytorch", "PyTorchEngine")
    sup = eng.recomputes_superset
    grid = list(eng.grid())
    b0, b1, b01 = "checkpoint blocks 0", "checkpoint blocks 1", "checkpoint blocks 0,1"
    assert sup(b01, b0) and not sup(b0, b01) and not sup(b0, b1) and not sup(b1, b0)
    assert all(sup(n, "keep_all") and not sup("keep_all", n) for n in grid)
    assert not any(sup(n, n) for n in [*grid, "keep_all"])
    # A whole block over any op list in it; saving fewer ops recomputes more.
    for selective in (n for n in grid if n.startswith("selective")):
        assert sup("checkpoint blocks 0,1,2", selective) and not sup(selective, "checkpoint blocks 0,1,2")
        assert not sup("checkpoint blocks 0", selective) and not sup(selective, "checkpoint blocks 0")
    assert sup("selective: save matmuls", "selective: save matmuls + attention")
    assert sup("selective: save attention", "selective: save matmuls + attention")
    assert not sup("selective: save matmuls", "selective: save attention")
    # The pick drops the dominated before timing counts: the superset is faster here, by noise.
    bench = _bench()
    held = ["checkpoint blocks 0,1", "checkpoint blocks 0", "checkpoint blocks 1"]
    seconds = {"checkpoint blocks 0,1": 1.0, "checkpoint blocks 0": 1.1, "checkpoint blocks 1": 1.2}
    assert bench.undominated(held, sup) == ["checkpoint blocks 0", "checkpoint blocks 1"]
    assert bench.fastest(held, sup, seconds) == "checkpoint blocks 0"
    assert bench.fastest(["checkpoint blocks 0,1"], sup, seconds) == "checkpoint blocks 0,1"
    assert bench.fastest([], sup, seconds) is None
    assert bench.fastest(["keep_all", *held], sup, {**seconds, "keep_all": 9.0}) == "keep_all"


def test_torchtitan_and_megatron_declare_which_of_their_options_recompute_more() -> None:
    tt = _engine("versus_static_torchtitan", "TorchtitanEngine").recomputes_superset
    assert tt("full AC on blocks 0,1", "full AC on blocks 0") and not tt("full AC on blocks 0", "full AC on blocks 0,1")
    assert not tt("full AC on blocks 0", "full AC on blocks 1")
    assert tt("activation_checkpoint=full", "full AC on blocks 0,1") and tt("activation_checkpoint=full", "keep_all")
    assert tt("activation_checkpoint=selective (op list)",
              "activation_checkpoint=selective (op list, router matmul saved too)")
    assert not tt("activation_checkpoint=selective (op list)", "full AC on blocks 0")
    assert not tt("full AC on blocks 0", "activation_checkpoint=selective (op list)")

    mg = _engine("versus_static_megatron", "MegatronEngine").recomputes_superset
    uniform1, uniform3 = "full, uniform, recompute_num_layers=1", "full, uniform, recompute_num_layers=3"
    block1, block2 = "full, block, recompute_num_layers=1", "full, block, recompute_num_layers=2"
    attn, moe, both = ("selective, recompute_modules=core_attn", "selective, recompute_modules=moe",
                       "selective, recompute_modules=core_attn+moe")
    assert mg(block2, block1) and not mg(block1, block2)
    assert mg(uniform1, block2) and mg(uniform3, both) and not mg(uniform1, uniform3) and not mg(uniform3, uniform1)
    assert mg(both, attn) and mg(both, moe) and not mg(attn, moe) and not mg(attn, both)
    assert not mg(block2, attn) and not mg(attn, block1)
    assert all(mg(n, "keep_all") for n in (uniform1, block1, attn)) and not mg("keep_all", attn)


def test_releases_is_passed_only_when_asked_for() -> None:
    eng = _engine("versus_static_pytorch", "PyTorchEngine")
    assert eng.releases_option() == {}
    eng.args.releases = "operators"
    assert eng.releases_option() == {"releases": "operators"}


def test_each_micro_batch_is_calm_a_spike_or_after_one() -> None:
    kinds = _bench().micro_batch_kinds(12, [3, 4, 10], after=2)
    assert kinds == ["calm", "calm", "calm", "spike", "spike", "after a spike", "after a spike", "calm",
                     "calm", "calm", "spike", "after a spike"]
    cost = _bench().per_kind(kinds, [2.0] * 12, [1.0] * 3 + [4.0, 2.0] + [1.0] * 7)
    assert cost["spike"] == {"median": 1.0, "quartiles": [0.75, 1.5], "n": 3}  # 0.5, 1 and 2
    assert cost["calm"]["median"] == 2.0 and cost["calm"]["n"] == 6
    assert _bench().per_kind(["calm"], [1.0], [2.0])["after a spike"] is None


def test_a_crash_is_charged_a_process_the_new_models_set_up_a_checkpoint_and_the_redo_since_it() -> None:
    crashes = [{"at": 57, "config": "keep_all", "restart_with": "b0", "attempt_s": 9.0},
               {"at": 120, "config": "b0", "restart_with": "b01", "attempt_s": 9.0},
               {"at": 130, "config": "b01", "restart_with": None, "attempt_s": 9.0}]
    config_at = ["keep_all"] * 57 + ["b0"] * 63 + ["b01"] * 10
    seconds = [1.0] * 57 + [2.0] * 62 + [4.0] + [3.0] * 10
    charges = _bench().restart_charges(crashes, config_at, seconds, {"b0": 0.5, "b01": 0.25}, process_s=4.0,
                                       save_s=0.75, load_s=0.5, every=50)
    assert len(charges) == 2  # the last crash had nothing to restart with: the run ended
    first, second = charges
    assert first["redo_micro_batches"] == 7 and first["redo_s"] == 7 * 2.0  # b0's own median
    assert first["total_s"] == 4.0 + 0.5 + 1.25 + 14.0
    assert second["redo_micro_batches"] == 20 and second["redo_s"] == 20 * 3.0
    assert second["total_s"] == 4.0 + 0.25 + 1.25 + 60.0
    assert _bench().restart_charges(crashes[:1], config_at, seconds, {"b0": 0.5}, 4.0, 0.75, 0.5,
                                    every=57)[0]["redo_s"] == 0.0  # right after a checkpoint


def test_the_goals_say_how_far_each_is() -> None:
    bench = _bench()
    assert bench.captured_share(1.05, 0.95) == pytest.approx(0.05 / (1.05 / 0.95 - 1.0))
    assert bench.captured_share(1.0, 1.1) is None  # the static pick is faster than keeping all
    g = bench.goals("tight", 2, 0.5, 1.2, 1.1)
    assert g["violations"] == {"value": 2, "goal": 0, "direction": "at most", "met": False, "by": -2}
    share = g["captured_share_of_ceiling"]
    assert share["met"] is False and share["by"] == pytest.approx(-0.3)
    assert g["over_best_static_tight"]["met"] is True and g["over_best_static_tight"]["by"] == pytest.approx(0.06)
    assert g["over_tuned"]["met"] is False and g["over_tuned"]["by"] == pytest.approx(-0.04)
    g = bench.goals("default", 0, None, 1.2, None)
    assert g["violations"]["met"] and g["violations"]["by"] == 0
    assert g["over_best_static_tight"] is None and g["over_tuned"] is None and g["captured_share_of_ceiling"] is None


def test_one_closing_line_per_protocol() -> None:
    row = {"speedup_median": 1.0512, "speedup_range": [1.01, 1.09], "segments": 4, "per_micro_batch_median": 1.04}
    summary = {"engine": "pytorch", "regime": "tight", "protocols": ["oracle", "tuned"], "rows": {
        "adaptive": {"violations": 0},
        "static": {**row, "config": "checkpoint blocks 0,1"},
        "tuned": {**row, "config": "keep_all", "speedup_total": 2.345, "gave_up_at": None, "restart_s": 5.5,
                  "crashes": [{"at": 22, "restart_with": "checkpoint blocks 0"}],
                  "restart_breakdown_s": {"process_s": 4.0, "setup_s": 0.5, "checkpoint_s": 0.25, "redo_s": 0.75}}}}
    oracle, tuned = _bench().closing_lines(summary)
    assert oracle.startswith("pytorch tight oracle: adaptive 1.05x over checkpoint blocks 0,1, 0 violations (")
    assert tuned.startswith("pytorch tight tuned: adaptive 2.35x over keep_all, 0 violations (")
    assert "at 22 -> checkpoint blocks 0" in tuned and "process 4.00" in tuned
    summary["rows"]["tuned"]["gave_up_at"] = 40
    del summary["rows"]["static"]
    oracle, tuned = _bench().closing_lines(summary)
    assert oracle.startswith("pytorch tight oracle: adaptive -x over none, 0 violations (")
    assert tuned.startswith("pytorch tight tuned: adaptive -x over keep_all, 0 violations (") and "40" in tuned


def test_the_summary_charges_each_restart_where_the_tuned_run_crashed() -> None:
    n = 6
    rank = {"engine": "pytorch", "rank": 0, "grid": ["b0"], "left_out": {}, "spikes": [2],
            "protocols": ["oracle", "tuned"], "probes": [0, 2], "budget_bytes": 100,
            "keep_all_probe_peaks": {"0": 90, "2": 120},
            "seconds": {"adaptive": [1.0] * n, "keep_all": [0.8] * n, "recompute_all": [1.3] * n,
                        "static": [1.1] * n, "tuned": [0.8, 0.8] + [1.1] * 4},
            "over_budget": {"adaptive": [], "static": [], "tuned": [2]},
            "losses_equal": {name: True for name in ("adaptive", "keep_all", "recompute_all", "static", "tuned")},
            "fastest_static": "b0", "survivors": ["b0"], "survivors_undominated": ["b0"],
            "calm_holders": ["keep_all", "b0"], "tuned_on": [0, 1], "probe_losses_equal": {"b0": True},
            "tuned": {"start": "keep_all", "config_at": ["keep_all"] * 2 + ["b0"] * 4, "gave_up_at": None,
                      "crashes": [{"at": 2, "config": "keep_all", "restart_with": "b0", "attempt_s": 0.5}]},
            "checkpoint": {"how": "torch.save", "save_s": 0.25, "load_s": 0.25},
            "setup_s": {"keep_all": 0.5, "b0": 0.5}}
    summary = _bench().summarize([rank], 2, "default", process_s=2.0, checkpoint_every=50)
    tuned = summary["rows"]["tuned"]
    charge = 2.0 + 0.5 + 0.5 + 2 * 1.1  # process, set-up, checkpoint save + load, redo of 2 at b0's seconds
    assert tuned["restart_s"] == pytest.approx(charge) and tuned["violations"] == 1
    assert tuned["total_s"] == pytest.approx(6.0 + charge)
    assert tuned["speedup_total"] == pytest.approx((6.0 + charge) / 6)
    assert tuned["speedup_range"] == pytest.approx([1.1, (2.7 + charge) / 3])  # the charge in its segment
    cost = summary["kinds"]["adaptive_cost"]
    assert summary["kinds"]["counts"] == {"calm": 3, "spike": 1, "after a spike": 2}
    assert cost["over tuned"]["spike"]["median"] == pytest.approx(1.0 / (1.1 + charge))
    assert cost["over keep_all"]["calm"]["median"] == pytest.approx(1.25)
    assert summary["goals"]["over_tuned"]["met"] and summary["goals"]["violations"]["met"]
    # static 1.1x over adaptive, keep-all 0.8x: of the ceiling 1.1 / 0.8 - 1, adaptive took 0.1
    assert summary["goals"]["captured_share_of_ceiling"]["value"] == pytest.approx(0.1 / (1.1 / 0.8 - 1.0))


def test_a_crash_restarts_with_the_fastest_that_held_what_crashed_and_never_with_what_crashed(monkeypatch) -> None:
    bench = _bench()
    trace_peaks = {("keep", 3): 120, ("a", 3): 120, ("b", 5): 120}  # over the budget of 100; else 50

    class FakeConfig:
        def __init__(self, name: str) -> None:
            self.name, self.closed = name, False

        def ready(self):
            return self

        def close(self) -> None:
            self.closed = True

    class FakeMeter:
        peak = 0

    def timed_step(cfg, rank, trace, i, meter):
        meter.peak = trace_peaks.get((cfg.name, i), 50)
        return 1.0, 0.5

    monkeypatch.setattr(bench, "_timed_step", timed_step)
    monkeypatch.setattr(bench, "AllocationMeter", FakeMeter)  # a restart's new meter
    monkeypatch.setattr(bench, "_all_min", lambda flag: flag)
    # Measured alone, "a" held micro-batch 3 (its trace run says otherwise); nothing holds 5.
    alone = {("a", 3): True, ("b", 3): True, ("c", 3): False}
    asked = []

    def holds(name: str, i: int) -> bool:
        asked.append((name, i))
        return alone.get((name, i), False)

    tuned = {"start": "keep", "config_at": [], "crashes": [], "gave_up_at": None}
    contenders = {"tuned": FakeConfig("keep")}
    meters = {"tuned": FakeMeter()}
    record = {"seconds": {"tuned": []}, "losses": {"tuned": []}, "peaks": {"tuned": []}}
    for i in range(3, 7):
        if tuned["gave_up_at"] is None:
            bench._tuned_step(tuned, contenders, meters, 0, None, i, 100, ["keep", "a", "b", "c"], holds,
                              lambda names: names[0] if names else None, FakeConfig, **record)
    assert [(c["at"], c["config"], c["restart_with"]) for c in tuned["crashes"]] == [
        (3, "keep", "a"), (3, "a", "b"), (5, "b", None)]
    assert tuned["gave_up_at"] == 5 and tuned["config_at"] == ["b", "b"]  # micro-batches 3 and 4
    assert record["peaks"]["tuned"] == [50, 50] and ("keep", 3) not in asked  # what crashed is never asked
