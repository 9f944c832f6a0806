"""Megatron-Core as an engine: tiny MoE GPTModels built by Megatron's own classes (local spec),
trained through Megatron's own schedules (``get_forward_backward_func()``: no pipelining, the
1F1B and the interleaved 1F1B with two model chunks per rank) on gloo, with and without bagualu2.

Invariants defended, on every rank: exactness (loss and every gradient bit for bit against the
same Megatron run without bagualu2, for keep_all, offload_all, recompute_all, a random
per-operator plan and adaptive through routing spikes), budget (adaptive holds its budget: no
violations, the first pipeline stage included), nothing leaked (no resident activation bytes
and no host copy in use after each step); that the gates are found without registration and
report the tokens each rank's experts receive (the token dispatcher's counts, alltoall and
allgather); that the routers count each micro-batch's tokens for their expert-bias update once,
as without bagualu2; that the phase declared before each forward is what then stacks in
Megatron's own schedule (and, interleaved, that a spike on an EP rank pushes keep_all over the
budget adaptive holds); and that Megatron's own recompute / offload options are refused by name.

The CPU shims Megatron needs here are in tests/megatron_shims.py (docs/engines.md). The ranks
run with TORCHDYNAMO_DISABLE=1: Megatron's ``jit_fuser`` compiles a few functions with
torch.compile, and compiling them inside a provisioned forward is slow here (see
docs/engines.md); both runs compared are then eager.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():
    # Megatron-Core warns at import that Transformer Engine and Apex are not installed.
    warnings.simplefilter("ignore")
    if os.environ.get("BAGUALU2_REQUIRE_MEGATRON") == "1":
        import megatron.core  # noqa: F401  CI installed it: a failed import fails the run, never skips it
    else:
        pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                                                    "(pip install megatron-core==0.16.1: docs/engines.md)")
    import megatron.core.models.gpt  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

import megatron_ranks as ranks  # noqa: E402
from pipeline_harness import check_engine_rank, launch  # noqa: E402

POLICIES = ("keep_all", "offload_all", "recompute_all", "random_plan", "adaptive")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


def _run(case: dict, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # inherited by the spawned ranks
    launch(ranks.run_case, world, case, str(tmp_path), timeout_s=600)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check(found: list) -> None:
    for rank, result in enumerate(found):
        check_engine_rank(rank, result, POLICIES, "Megatron")
        assert result["policies"]["random_plan"]["by_choice"]["recompute"] > 0, "the random plan recomputed nothing"


CASES = {
    "single": ({}, 1),
    "ep2_alltoall": ({"ep": 2, "dispatcher": "alltoall"}, 2),
    "ep2_allgather": ({"ep": 2, "dispatcher": "allgather"}, 2),
    "pp2_1f1b": ({"pp": 2, "microbatches": 3}, 2),
    "pp2_ep2": ({"pp": 2, "ep": 2, "microbatches": 3}, 4),
    # Interleaved 1F1B: two model chunks per rank (one layer each), micro-batch groups of 2.
    "pp2_vpp2": ({"pp": 2, "vpp": 2, "microbatches": 4}, 2),
    # Every rank routes all its tokens onto both experts of EP rank 1: a spike that about
    # doubles what those experts receive.
    "pp2_vpp2_ep2": ({"pp": 2, "vpp": 2, "ep": 2, "microbatches": 4, "spiked_keep_all": True,
                      "spike_expert": [2, 3], "spike_rank": None}, 4),
}


def _check_schedule(layout: str, case: dict, found: list) -> None:
    """The phase enable_pipeline declares follows Megatron's own schedule, forward by forward."""
    for rank, result in enumerate(found):
        schedule = result["schedule"]
        # What stacked in Megatron's run without bagualu2 is what enable_pipeline derives ...
        assert schedule["megatron"] == schedule["derived"], f"{layout} rank {rank}: {schedule}"
        # ... and before every forward of the provisioned run the provisioner was told what then
        # stacked on this rank, chunk by chunk.
        assert schedule["told"] == schedule["provisioned"], f"{layout} rank {rank}: {schedule}"
        assert {c for c, _ in schedule["told"]} == set(range(case.get("vpp", 1))), schedule["told"]
        assert set(schedule["phases"]) <= {"warmup", "steady"}, schedule["phases"]
    if case.get("vpp"):
        from bagualu2.integrations.megatron import one_f_one_b_phases

        # Interleaving stacks more micro-batches on the first stage than 1F1B's warm-up does.
        first = found[0]["schedule"]["told"][0][1]
        assert first > one_f_one_b_phases(case["pp"], 0, case["microbatches"])[0][1], found[0]["schedule"]


def _check_keep_all_crosses(case: dict, found: list) -> None:
    """The spike pushes keep_all over the budget adaptive holds, on the ranks whose experts receive
    it. Without EP a rank's experts compute top-k slots of its own tokens whatever the routing,
    so only an EP rank's received tokens (and bytes) grow with a spike."""
    receivers = [r for r in range(len(found)) if r % case["ep"] == 1]  # EP rank 1 (rank order tp-cp-ep-dp-pp)
    for rank in receivers:
        spiked = found[rank]["policies"]["keep_all_spiked"]
        assert spiked["violations"] > 0 and spiked["peak"] > spiked["budget"], f"rank {rank}: {spiked}"
        assert found[rank]["policies"]["adaptive"]["violations"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CASES))
def test_megatron_exact_budget_no_leak(layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case, world = CASES[layout]
    found = _run(case, world, tmp_path, monkeypatch)
    _check(found)
    if case.get("pp", 1) > 1:
        _check_schedule(layout, case, found)
    if case.get("spiked_keep_all"):
        _check_keep_all_crosses(case, found)
    for rank, result in enumerate(found):
        # Every policy leaves the routers' expert-bias counts as Megatron's own run does: a
        # rerun in backward must not count a micro-batch's routed tokens twice.
        for policy in POLICIES:
            counted = [m for m in result["policies"][policy]["counted_mismatches"] if m]
            assert not counted, f"rank {rank} {policy}: {counted}"
    if case.get("ep", 1) > 1:
        # Rank 0's tokens all go to expert 3, which lives on the other EP rank: its gate reports
        # what its experts receive from both ranks (the dispatcher's counts), so its second
        # local expert gets at least rank 0's every token in a spiked step.
        tokens = ranks.MICRO_BATCH * ranks.SEQ
        receiver = 1  # EP rank 1 of the first stage (Megatron's rank order: tp-cp-ep-dp-pp)
        counts = found[receiver]["policies"]["adaptive"]["counts"]
        spiked = [c for c, on in zip(counts, ranks.SPIKES) if on]
        # The step's last micro-batch ran the last chunk: its layer is the last reported.
        assert spiked and all(len(v) == 2 and v[1] >= tokens for c in spiked for v in c.values()), counts


# What only a GPU runs: each case needs the packages named (GPU-only builds) and as many GPUs
# as processes; on a machine without them it skips and says which is missing.
GPU_CASES = {
    "te_spec": ({"device": "cuda", "te": True}, 1, ("transformer_engine",)),
    "te_grouped_gemm": ({"device": "cuda", "te": True, "grouped_gemm": True}, 1, ("transformer_engine",)),
    "flex_deepep": ({"device": "cuda", "te": True, "ep": 2, "dispatcher": "flex"}, 2,
                    ("transformer_engine", "deep_ep")),
}


@pytest.mark.slow
@pytest.mark.cuda_only
@pytest.mark.parametrize("layout", list(GPU_CASES))
def test_megatron_gpu_exact_budget_no_leak(layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformer Engine's layer spec, its grouped GEMM experts and the flex (DeepEP) dispatcher,
    under every policy on the GPU: the same checks as the CPU layouts."""
    case, world, needs = GPU_CASES[layout]
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (GPU-only packages, not installed here)")
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    launch(ranks.run_case, world, case, str(tmp_path), backend="nccl", timeout_s=600)
    _check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)])


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group for Megatron's parallel state in this process, and dynamo off as
    in the spawned ranks (module note)."""
    import torch.distributed as dist

    disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in memory: no server thread
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        torch._dynamo.config.disable = disabled


def _tiny_model(**config_options):
    """A one-process Megatron model (needs the ``one_rank`` fixture)."""
    return ranks.build(**config_options)


def test_megatron_gates_found_without_registration(one_rank: None) -> None:
    import bagualu2
    from bagualu2.runtime.gates import find_gates

    run = _tiny_model()
    specs = find_gates(run.model)
    assert [s.name for s in specs] == [f"decoder.layers.{i}.mlp.experts" for i in range(ranks.LAYERS)]
    assert all(s.pre_hook and s.num_experts == ranks.EXPERTS and s.top_k == ranks.TOP_K and s.ep_size == 1
               for s in specs)
    prov = bagualu2.enable(run.model, budget=None, policy="keep_all", min_bytes=0)
    try:
        ranks.step(run, 0, 1)
        # Without EP the experts' counts are the layer's routing: top-k slots of every token.
        slots = ranks.MICRO_BATCH * ranks.SEQ * ranks.TOP_K
        assert {k: sum(v) for k, v in prov.routing.counts.items() if k >= 0} == {i: slots for i in range(ranks.LAYERS)}
        assert prov.report()["resident_bytes"] == 0
    finally:
        prov.disable()


def test_megatron_1f1b_phases() -> None:
    from bagualu2.integrations.megatron import one_f_one_b_phases

    # Stage 0 of 2, 3 micro-batches: F0 (warm-up; F1 follows before B0), F1, F2 steady.
    assert one_f_one_b_phases(2, 0, 3) == [("warmup", 1), ("steady", 0), ("steady", 0)]
    assert one_f_one_b_phases(2, 1, 3) == [("steady", 0)] * 3
    # Stage 0 of 4, 2 micro-batches: all warm-up, nothing steady after.
    assert one_f_one_b_phases(4, 0, 2) == [("warmup", 1), ("warmup", 0)]
    assert one_f_one_b_phases(4, 0, 5) == [("warmup", 3), ("warmup", 2), ("warmup", 1), ("steady", 0), ("steady", 0)]


REFUSED = {
    "recompute_full": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                       r"recompute_granularity='full'"),
    "recompute_selective": (dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                            r"recompute_granularity='selective'.*core_attn"),
    "recompute_moe": (dict(recompute_granularity="selective", recompute_modules=["moe"]),
                      r"recompute_granularity='selective'.*moe"),
    "fine_grained_offloading": (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]),
                                r"fine_grained_activation_offloading=True"),
}


@pytest.mark.parametrize("option", list(REFUSED))
def test_megatron_memory_options_refused(option: str, one_rank: None) -> None:
    import bagualu2

    config_options, message = REFUSED[option]
    run = _tiny_model(**config_options)
    with pytest.raises(ValueError, match=message):
        bagualu2.enable(run.model, budget=None)
    assert "forward" not in run.model.__dict__, "a refused enable must leave the model as it was"


def test_megatron_cpu_offloading_refused(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import bagualu2

    run = _tiny_model()
    # cpu_offloading needs Transformer Engine to build; the check reads the config as built.
    monkeypatch.setattr(run.config, "cpu_offloading", True)
    with pytest.raises(ValueError, match=r"cpu_offloading=True"):
        bagualu2.enable(run.model, budget=None)


def test_megatron_interleaved_phases_follow_megatron() -> None:
    """The chunk order and warm-up enable_pipeline derives are those of Megatron's own interleaved
    schedule helpers (get_schedule_table, get_pp_rank_microbatches), over many layouts."""
    from types import SimpleNamespace

    from bagualu2.integrations.megatron import interleaved_chunks, interleaved_phases
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    checked = 0
    for stages in (2, 3, 4):
        for chunks in (2, 3):
            for group in range(stages, stages + 3):
                for micro in range(group, 3 * group + 2):
                    if 0 < micro % group < stages:
                        continue  # Megatron refuses a last group smaller than the pipeline
                    table = [c for _, c in get_schedule_table(micro, chunks, group)]
                    assert interleaved_chunks(micro, chunks, group) == table, (stages, chunks, group, micro)
                    for stage in range(stages):
                        p2p = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: stages, rank=lambda: stage),
                                              virtual_pipeline_model_parallel_size=chunks)
                        total, _, warmup, _ = get_pp_rank_microbatches(micro, chunks, group, p2p_communicator=p2p)
                        phases = interleaved_phases(stages, stage, micro, chunks, group)
                        assert len(phases) == total and [c for c, _, _ in phases] == table
                        assert [p for _, p, _ in phases] == ["warmup"] * warmup + ["steady"] * (total - warmup)
                        checked += 1
    assert checked > 100
    # Stage 0 of 2, two chunks, 4 micro-batches in groups of 2: F(mb0,c0) has F(mb1,c0),
    # F(mb0,c1), F(mb1,c1) and the first steady forward F(mb2,c0) after it before B(mb0,c1).
    assert interleaved_phases(2, 0, 4, 2, 2)[:5] == [(0, "warmup", 4), (0, "warmup", 3), (1, "warmup", 2),
                                                     (1, "warmup", 1), (0, "steady", 0)]


def test_megatron_chunks_share_one_provisioner(one_rank: None) -> None:
    """Several chunks: one provisioner over them all; each chunk's forward is one micro-batch
    of it; disable gives each chunk its own forward back."""
    from bagualu2.integrations.megatron import MegatronChunks, enable_pipeline
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    chunks = [_tiny_model().model, _tiny_model().model]
    prov, _ = enable_pipeline(chunks, forward_backward_pipelining_with_interleaving, budget=None, min_bytes=0)
    try:
        assert isinstance(prov.model, MegatronChunks) and list(prov.model.chunks) == chunks
        assert len(prov.gates) == 2 * ranks.LAYERS
        with pytest.raises(RuntimeError, match=r"already have bagualu2"):
            enable_pipeline(chunks, forward_backward_pipelining_with_interleaving, budget=None)
        assert prov.profile_frames == 4  # two micro-batches of each chunk (groups of 1 without PP)
        batch = ranks.batches(0, 1)[0]
        positions = torch.arange(ranks.SEQ).unsqueeze(0).expand(ranks.MICRO_BATCH, -1)
        for _ in range(2):
            outs = [chunk(batch["tokens"], positions, None, labels=batch["labels"]) for chunk in chunks]
            assert prov.report()["resident_bytes"] > 0
            sum(o.sum() for o in outs).backward()
            assert prov.report()["resident_bytes"] == 0
        assert prov.report()["micro_batches"] == 4
        # Profiling ended on chunk 1, whose forward runs no gate of chunk 0: the worst routing
        # is still bounded (chunk 0's gates by the micro-batches they saw), so the host arena
        # is sized by it, not by the most it may reserve ahead.
        assert prov.cost.frames == 4 and 0 < prov.footprint.worst_bytes < 1 << 40
    finally:
        prov.disable()
    assert all("forward" not in chunk.__dict__ for chunk in chunks)


def test_megatron_interleaving_options_refused(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from bagualu2.integrations.megatron import enable_pipeline
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    run = _tiny_model()
    with pytest.raises(ValueError, match=r"2 model chunks.*forward_backward_pipelining_with_interleaving"):
        enable_pipeline([run.model, _tiny_model().model], run.forward_backward, budget=None)
    # It needs a GPU (and EP) to build; the check reads the config as built.
    monkeypatch.setattr(run.config, "overlap_moe_expert_parallel_comm", True)
    with pytest.raises(ValueError, match=r"overlap_moe_expert_parallel_comm=True"):
        enable_pipeline([run.model, _tiny_model().model], forward_backward_pipelining_with_interleaving,
                        budget=None)
    assert "forward" not in run.model.__dict__


def test_megatron_unexpected_chunk_order_warns(one_rank: None) -> None:
    """A schedule that runs another chunk than the interleaved order expects is told, and the rest
    of its step runs without declared phases (the provisioner counts what stacks itself)."""
    from types import SimpleNamespace

    from bagualu2.integrations.megatron import enable_pipeline

    chunks = [_tiny_model().model, _tiny_model().model]
    batch = ranks.batches(0, 1)[0]
    positions = torch.arange(ranks.SEQ).unsqueeze(0).expand(ranks.MICRO_BATCH, -1)
    seen = []

    def forward_backward_pipelining_with_interleaving(*, model: list, **kwargs: object) -> list:
        for chunk in (model[1], model[0]):  # the interleaved order runs chunk 0 first
            out = chunk(batch["tokens"], positions, None, labels=batch["labels"])
            seen.append((prov.stacking.phase, prov.stacking.declared))
            out.sum().backward()
        return []

    prov, forward_backward = enable_pipeline(chunks, forward_backward_pipelining_with_interleaving,
                                             budget=None, policy="keep_all", min_bytes=0)
    try:
        p2p = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: 2, rank=lambda: 0))
        with pytest.warns(RuntimeWarning, match=r"ran model chunk 1 where .* chunk 0"):
            forward_backward(model=chunks, num_microbatches=2, p2p_communicator=p2p)
        assert seen == [("none", 0), ("none", 0)]
    finally:
        prov.disable()
