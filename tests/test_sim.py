"""Tests of the cluster-scale simulator (bagualu2.sim): each test names the invariant it defends."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bagualu2.sim.clusters import CLUSTER_PRESETS, get_cluster
from bagualu2.sim.engine import POLICIES, Simulator, planner_api
from bagualu2.sim.layout import Layout, stage_static_bytes
from bagualu2.sim.models import MODEL_PRESETS, OP_TABLE, ModelSpec, get_model, unit_ops
from bagualu2.sim.schedule import Timeline, inflight_depth, schedule
from bagualu2.sim.traces import generate_trace, rank_counts, read_telemetry, write_telemetry

TOY = ModelSpec(name="toy", hidden=256, layers=8, dense_layers=0, vocab=1000, heads=4, kv_heads=4,
                head_dim=64, experts=8, shared_experts=0, top_k=2, expert_ffn=512,
                embed_units=False, seq=256)
MiB = 2**20
FAST = settings(max_examples=12, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def toy_sim(memory: float, pp: int = 4, vpp: int = 1, m: int = 8, **kw: object) -> Simulator:
    cluster = get_cluster("h200", device_memory=float(memory), workspace=0.0)
    return Simulator(TOY, cluster, Layout(pp=pp, vpp=vpp, ep=8, microbatches=m, seq=256), **kw)


def act_peak_bytes(sim: Simulator, load: np.ndarray) -> np.ndarray:
    """Independent keep_all peak per step: walk each stage's order summing the analytic
    saved bytes of ``unit_ops`` (not the engine's linear tables)."""
    kinds = TOY.unit_kinds()
    per_kind = {k: unit_ops(TOY, k, 1, 256, 1) for k in set(kinds)}
    out = np.zeros(load.shape[0])
    for i in range(load.shape[0]):
        best = 0.0
        for s, order in enumerate(sim.orders):
            res, held = 0.0, {}
            for fwd, mb, c in order:
                if fwd:
                    b = sum(per_kind[kinds[u]].saved_bytes(load[i, mb, u])
                            for u in sim.layout.chunk_units(TOY, s, c))
                    held[(mb, c)] = b
                    res += b
                    best = max(best, res + sim.static[s])
                else:
                    res -= held.pop((mb, c))
        out[i] = best
    return out


# -- presets -------------------------------------------------------------------------------------
def test_presets_load_with_published_parameter_counts() -> None:
    expect = {"deepseek-v3-671b": 671e9, "mixtral-8x7b": 46.7e9, "qwen3-235b-a22b": 235e9,
              "deepseek-v3-188b": 188e9, "deepseek-v3-1.04t": 1.03e12}
    for name, total in expect.items():
        assert abs(get_model(name).params()["total"] / total - 1) < 0.01, name
    for name in MODEL_PRESETS:
        for kind in set(get_model(name).unit_kinds()):
            for op in unit_ops(get_model(name), kind, 1, 512, 1).ops:
                assert op.name in OP_TABLE
    for name, c in CLUSTER_PRESETS.items():
        for f in ("device_memory", "peak_flops", "hbm_bw", "host_d2h_bw", "intra_bw", "inter_bw",
                  "network_efficiency", "dp_efficiency", "compute_efficiency", "restart_s"):
            assert c.sources.get(f), f"{name}.{f} has no cited source"


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ValueError, match="deepseek-v3-671b"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="dcu-64g"):
        get_cluster("tpu")


def test_layout_errors_name_the_bad_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"pp \* vpp = 3 \* 1 = 3 does not divide the 64"):
        Layout(pp=3, ep=64).validate(get_model("deepseek-v3-671b"))
    with pytest.raises(ValueError, match="ep = 48 does not divide the 256 experts"):
        Layout(pp=16, ep=48).validate(get_model("deepseek-v3-671b"))


def test_static_bytes_shrink_with_expert_parallelism() -> None:
    m = get_model("deepseek-v3-671b")
    a = stage_static_bytes(m, Layout(pp=16, ep=8), 3)["total"]
    b = stage_static_bytes(m, Layout(pp=16, ep=64), 3)["total"]
    assert b < a / 4


# -- schedules -----------------------------------------------------------------------------------
@FAST
@given(pp=st.integers(1, 12), extra=st.integers(0, 12), data=st.data())
def test_1f1b_warmup_stacking_depth_is_stages_minus_stage_index(pp: int, extra: int, data) -> None:
    m = pp + extra
    s = data.draw(st.integers(0, pp - 1))
    assert inflight_depth(schedule(pp, 1, m, s)) == pp - s


@FAST
@given(pp=st.integers(1, 6), vpp=st.integers(1, 4), groups=st.integers(1, 3), data=st.data())
def test_interleaved_schedule_runs_each_action_once_forward_first(pp: int, vpp: int, groups: int,
                                                                 data) -> None:
    m = pp * groups
    s = data.draw(st.integers(0, pp - 1))
    order = schedule(pp, vpp, m, s)
    assert len(order) == len(set(order)) == 2 * m * vpp
    seen = set()
    for fwd, mb, c in order:
        assert fwd or (mb, c) in seen, "backward before its forward"
        seen.add((mb, c))
    if vpp > 1:  # Megatron's warm-up count plus the first steady-state forward
        assert inflight_depth(order) == min((pp - s - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 3), (4, 1, 8), (8, 1, 8), (4, 2, 8), (2, 3, 4)])
def test_timeline_matches_the_pipeline_bubble_closed_form(pp: int, vpp: int, m: int) -> None:
    # uniform chunks (forward 1, backward 2): makespan = (m * vpp + pp - 1) * 3
    t = Timeline(pp, vpp, m)
    dur = {(f, mb, c, s): np.full(2, 1.0 if f else 2.0)
           for s, o in enumerate(t.orders) for f, mb, c in o}
    makespan, _ = t.run(dur, send_s=0.0)
    assert np.allclose(makespan, (m * vpp + pp - 1) * 3.0)


# -- traces --------------------------------------------------------------------------------------
def test_generated_trace_matches_requested_spike_rate_and_imbalance() -> None:
    tr = generate_trace(6000, 4, 3, ep=8, spike_rate=0.029, max_imbalance=2.6, seed=1)
    st_ = tr.stats()
    sigma = math.sqrt(0.029 * 0.971 / 6000)
    assert abs(st_["spike_rate"] - 0.029) < 4 * sigma
    assert st_["max_imbalance"] == pytest.approx(2.6)
    calm = tr.load[~tr.spike]
    assert calm.min() >= 1.05 and calm.max() <= 1.2 and 1.1 <= calm.mean() <= 1.15
    assert (tr.load[tr.spike].reshape(tr.spike.sum(), -1).max(axis=1) == pytest.approx(2.6))


@FAST
@given(rate=st.floats(0.0, 0.5), peak=st.floats(1.3, 4.0), seed=st.integers(0, 2**31))
def test_trace_bounds_and_determinism_from_seed(rate: float, peak: float, seed: int) -> None:
    a = generate_trace(60, 3, 2, ep=4, spike_rate=rate, max_imbalance=peak, seed=seed)
    b = generate_trace(60, 3, 2, ep=4, spike_rate=rate, max_imbalance=peak, seed=seed)
    assert np.array_equal(a.load, b.load) and np.array_equal(a.spike, b.spike)
    assert a.load.min() >= 1.0 and a.load.max() <= peak + 1e-12


def test_rank_counts_have_the_requested_imbalance() -> None:
    c = rank_counts(8192, 16, 2.6)
    assert c.sum() == pytest.approx(8192) and c.max() / c.mean() == pytest.approx(2.6)


def test_telemetry_json_lines_round_trip(tmp_path) -> None:
    tr = generate_trace(5, 2, 3, ep=8, spike_rate=0.5, seed=3)
    write_telemetry(tr, tmp_path / "t.jsonl")
    back = read_telemetry(tmp_path / "t.jsonl", ep=8)
    assert np.allclose(back.load, tr.load)
    with open(tmp_path / "c.jsonl", "w") as fh:
        fh.write(json.dumps({"step": 0, "microbatch": 0, "layer": 0,
                             "tokens_per_expert": [30, 10, 10, 10]}) + "\n")
    assert read_telemetry(tmp_path / "c.jsonl", ep=2).load[0, 0, 0] == pytest.approx(40 / 30)


def test_reads_the_provisioners_telemetry_records(tmp_path) -> None:
    from bagualu2.telemetry import Decision, MicroBatch, Telemetry

    tel = Telemetry(tmp_path / "run.jsonl")
    for mb, imb in ((0, 1.1), (1, 2.6)):
        tel.add(Decision(step=3, micro_batch=mb, layer=1, imbalance=imb, resident_bytes=0,
                         predicted_bytes=0, planned_bytes=0, budget_bytes=None, mix={},
                         latency_us=1.0))
        tel.add(MicroBatch(step=3, micro_batch=mb, peak_bytes=0, predicted_peak_bytes=0,
                           budget_bytes=None, imbalance=imb, bytes_by_choice={}, violations=0,
                           fallbacks=0, forward_seconds=0.1))
    tr = read_telemetry(tmp_path / "run.jsonl", ep=8)
    assert tr.load.shape == (1, 2, 2) and tr.load[0, 1, 1] == pytest.approx(2.6)
    assert bool(tr.spike[0]) and tr.load[0, 0, 0] == 1.0  # unrecorded layer 0: balanced
    # per-expert imbalance spread over 4 experts per rank: (2.6 + 3) / 4
    tr4 = read_telemetry(tmp_path / "run.jsonl", ep=8, experts_per_rank=4)
    assert tr4.load[0, 1, 1] == pytest.approx(1.4)


# -- policies ------------------------------------------------------------------------------------
def test_planner_is_the_runtime_planner() -> None:
    import bagualu2.plan.planner as runtime

    assert planner_api() == (runtime.Planner, runtime.Candidate, runtime.Choice)


@FAST
@given(frac=st.floats(0.6, 1.4), seed=st.integers(0, 1000))
def test_keep_all_ooms_exactly_when_the_analytic_peak_exceeds_memory(frac: float,
                                                                     seed: int) -> None:
    probe = toy_sim(1e12)
    tr = generate_trace(12, 8, len(probe.moe_units), ep=8, spike_rate=0.4, seed=seed)
    load = probe.full_load(tr)
    peak = act_peak_bytes(probe, load)
    mem = float(np.median(peak) * frac)
    sim = toy_sim(mem)
    r = sim.simulate_policy("keep_all", load, max_load=2.6)
    assert np.allclose(r.peak.max(axis=0), peak, rtol=1e-9)
    assert np.array_equal(r.oom, peak > mem)


@FAST
@given(frac=st.floats(0.45, 1.0), seed=st.integers(0, 1000), vpp=st.sampled_from([1, 2]))
def test_adaptive_never_exceeds_device_memory_when_a_feasible_plan_exists(frac: float, seed: int,
                                                                          vpp: int) -> None:
    probe = toy_sim(1e12, vpp=vpp)
    tr = generate_trace(10, 8, len(probe.moe_units), ep=8, spike_rate=0.5, seed=seed)
    load = probe.full_load(tr)
    mem = float(act_peak_bytes(probe, load).max() * frac) if vpp == 1 else 0.0
    if vpp > 1:
        keep = probe.simulate_policy("keep_all", load, max_load=2.6)
        mem = float(keep.peak.max() * frac)
    sim = toy_sim(mem, vpp=vpp)
    for policy in ("adaptive", "adaptive_overlap"):
        r = sim.simulate_policy(policy, load, max_load=float(load.max()))
        ok = r.infeasible == 0
        assert (r.peak.max(axis=0)[ok] <= mem + 1e-6).all(), policy
        assert not r.oom[ok].any()


def test_adaptive_memory_invariant_is_exercised() -> None:
    # the property above is not vacuous: at 60% of keep_all's peak the adaptive plans are
    # feasible in most steps and release operators to stay within memory
    probe = toy_sim(1e12)
    load = probe.full_load(generate_trace(10, 8, len(probe.moe_units), ep=8, spike_rate=0.5,
                                          seed=3))
    mem = float(probe.simulate_policy("keep_all", load, max_load=2.6).peak.max() * 0.6)
    r = toy_sim(mem).simulate_policy("adaptive", load, max_load=float(load.max()))
    assert (r.infeasible == 0).sum() >= 5 and r.mix["recompute"] + r.mix["offload"] > 0
    assert r.peak.max() <= mem and not r.oom.any()


def test_planner_called_and_plan_mix_follows_the_load() -> None:
    probe = toy_sim(1e12)
    calm = generate_trace(20, 8, len(probe.moe_units), ep=8, spike_rate=0.0, seed=1)
    spiky = generate_trace(20, 8, len(probe.moe_units), ep=8, spike_rate=1.0, seed=1)
    keep_calm = probe.simulate_policy("keep_all", probe.full_load(calm), max_load=1.2)
    mem = float(keep_calm.peak.max()) * 1.02  # calm fits, spikes do not
    sim = toy_sim(mem)
    mixes = {}
    for name, tr in (("calm", calm), ("spiky", spiky)):
        res = sim.run(tr, ["adaptive"])
        mixes[name] = res.policies["adaptive"].mix
        assert res.policies["adaptive"].summary["oom_count"] == 0
    released = {k: v["offload"] + v["recompute"] for k, v in mixes.items()}
    assert released["spiky"] > released["calm"]


def test_simulation_is_deterministic_from_the_seed() -> None:
    sim = toy_sim(40 * MiB)
    a = sim.run(generate_trace(15, 8, len(sim.moe_units), ep=8, seed=7)).table()
    b = sim.run(generate_trace(15, 8, len(sim.moe_units), ep=8, seed=7)).table()
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_policies_order_sensibly_and_restarts_cost_time() -> None:
    probe = toy_sim(1e12)
    tr = generate_trace(40, 8, len(probe.moe_units), ep=8, spike_rate=0.2, seed=2)
    calm_peak = probe.simulate_policy("keep_all", probe.full_load(
        generate_trace(5, 8, len(probe.moe_units), ep=8, spike_rate=0.0)), max_load=1.2).peak.max()
    sim = toy_sim(float(calm_peak) * 1.03, checkpoint_interval=10)
    res = sim.run(tr)
    s = {p: r.summary for p, r in res.policies.items()}
    assert s["recompute_all"]["oom_count"] == 0
    assert s["keep_all"]["oom_count"] > 0 and s["keep_all"]["lost_s"] > sim.restart_s
    assert s["recompute_all"]["calm_mfu"] < s["keep_all"]["calm_mfu"]
    for p in ("static", "adaptive", "adaptive_overlap"):
        assert s[p]["tokens_per_s"] >= s["recompute_all"]["tokens_per_s"] * 0.999, p
    assert s["adaptive_overlap"]["tokens_per_s"] >= s["adaptive"]["tokens_per_s"] * 0.999


def test_calibrated_presets_reproduce_the_published_baselines() -> None:
    from bagualu2.sim.calibrate import TARGETS, calm_mfu, reference_setup

    model, cluster, layout = reference_setup()
    assert calm_mfu(model, cluster, layout, "keep_all") == pytest.approx(TARGETS["keep_all"],
                                                                         abs=0.003)
    assert calm_mfu(model, cluster, layout, "recompute_all") == pytest.approx(
        TARGETS["recompute_all"], abs=0.003)


def test_measured_tables_drive_the_simulator() -> None:
    from bagualu2.models import MoEConfig
    from bagualu2.sim.measured import (MeasuredOp, measured_simulator, model_from_moe_config,
                                       prediction_error)

    cfg = MoEConfig.tiny()
    model = model_from_moe_config(cfg, seq=64)
    ops = [MeasuredOp("attn", 4096, 1e-4, 1e-4, releasable=False),
           MeasuredOp("attn.core", 8192, 2e-4, 2e-4),
           MeasuredOp("experts.fc1", 16384, 3e-4, 1e-4, load_scaled=True),
           MeasuredOp("experts.act", 0, 0.0, 0.0, nbytes_per_load=16384, fwd_s_per_load=1e-5,
                      recompute_s_per_load=3e-4)]
    sim = measured_simulator(model, {"moe": ops}, device_memory=120_000, microbatches=2,
                             copy_bw=1e9)
    calm = sim.run(generate_trace(4, 2, cfg.num_layers, ep=4, spike_rate=0.0, seed=0), ["keep_all"])
    # keep_all with pp = 1: one micro-batch (both layers) resident at a time
    loads = sim.full_load(generate_trace(4, 2, cfg.num_layers, ep=4, spike_rate=0.0, seed=0))
    expect = (2 * (4096 + 8192) + 32768 * loads.sum(axis=2)).max()
    assert calm.policies["keep_all"].peak.max() == pytest.approx(expect)
    res = sim.run(generate_trace(10, 2, cfg.num_layers, ep=4, spike_rate=0.5, seed=0))
    keep, ada = res.policies["keep_all"].summary, res.policies["adaptive"].summary
    assert keep["oom_count"] > 0
    assert ada["oom_count"] == 0 and ada["infeasible_decisions"] == 0
    assert math.isfinite(ada["mean_step_s"]) and ada["tokens_per_s"] > keep["tokens_per_s"]
    err = prediction_error(res, "adaptive", measured_step_s=ada["mean_step_s"] * 1.1,
                           measured_peak_bytes=float(res.policies["adaptive"].peak.max()))
    assert err["step_time_error"] == pytest.approx(1 / 1.1 - 1) and err["peak_error"] == 0.0


# -- command line --------------------------------------------------------------------------------
def test_cli_runs_end_to_end_on_a_small_layout(tmp_path, capsys) -> None:
    from bagualu2.sim.cli import main

    rc = main(["--model", "mixtral-8x7b", "--cluster", "h200", "--pp", "4", "--ep", "8",
               "--dp", "1", "--steps", "20", "--seq", "auto", "--no-progress",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "adaptive_overlap" in out
    data = json.loads((tmp_path / "result.json").read_text())
    assert set(data["policies"]) == set(POLICIES)
    assert (tmp_path / "memory_timeline.png").stat().st_size > 0
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert main(["--list"]) == 0
    write_telemetry(generate_trace(3, 2, 32, ep=8, spike_rate=0.5, seed=1), tmp_path / "t.jsonl")
    assert main(["--model", "mixtral-8x7b", "--cluster", "h200", "--pp", "4", "--ep", "8",
                 "--dp", "1", "--steps", "6", "--trace", str(tmp_path / "t.jsonl"),
                 "--policies", "keep_all,adaptive", "--no-progress"]) == 0
    assert "adaptive" in capsys.readouterr().out


def test_cli_reports_bad_values_with_the_fix(capsys) -> None:
    from bagualu2.sim.cli import main

    assert main(["--model", "nope", "--no-progress"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main(["--pp", "5", "--steps", "2", "--no-progress"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert main(["--policies", "keep_all,yolo", "--no-progress"]) == 2
    assert main(["--trace", "/nonexistent/telemetry.jsonl", "--steps", "2", "--no-progress"]) == 2
    assert "is not a file; pass the telemetry JSON lines" in capsys.readouterr().err
