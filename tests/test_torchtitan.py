"""torchtitan 0.3.0 as an engine: tiny MoE models (Qwen3-MoE, DeepSeek-V3) parallelized by
torchtitan's own functions (FSDP2, EP, FSDP2 + EP, PP, PP x EP) on gloo, trained with and
without bagualu2.

Invariants defended, on every rank: exactness (loss and every gradient bit for bit against the
same torchtitan run without bagualu2, for keep_all, offload_all, recompute_all, a random
per-operator plan and adaptive through routing spikes, under a budget 5% above the calm peak
and one 30% below it), budget (adaptive holds its budget: no violations), nothing leaked (no resident activation bytes and no host copy in use after
each step); and that the gates are found without registration and report the tokens each
rank's experts receive after torchtitan's EP count exchange.

The CPU shims torchtitan needs here are in tests/torchtitan_shims.py (docs/engines.md).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

from engine_required import TORCHTITAN, require  # noqa: E402

require(*TORCHTITAN)

with warnings.catch_warnings():
    # torchtitan's attention module compiles FlexAttention at import, and torch's compiler
    # imports torch.utils.mkldnn, which warns that torch.jit.script_method is deprecated.
    warnings.simplefilter("ignore", DeprecationWarning)
    import torchtitan.models.qwen3  # noqa: F401


import torchtitan_ranks as ranks  # noqa: E402
from pipeline_harness import check_engine_rank, launch  # noqa: E402

POLICIES = ranks.POLICIES


def _run(case: dict, world: int, tmp_path: Path) -> list:
    launch(ranks.run_case, world, case, str(tmp_path), timeout_s=600)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check(found: list) -> None:
    for rank, result in enumerate(found):
        check_engine_rank(rank, result, POLICIES, "torchtitan")
        assert result["policies"]["random_plan"]["by_choice"]["recompute"] > 0, "the random plan recomputed nothing"


def _tight_violations(found: list) -> list:
    """(rank, violations, peak, budget) of every rank that crossed the budget below its calm peak."""
    return [(rank, got["violations"], got["peak"], got["budget"])
            for rank, got in enumerate(r["policies"]["adaptive_tight"] for r in found)
            if got["violations"] or got["peak"] > got["budget"]]


CASES = {
    "fsdp2": ({}, 2),
    "ep2": ({"ep": 2, "fsdp": False}, 2),
    "fsdp2_ep2": ({"ep": 2}, 2),
    "pp2": ({"pp": 2}, 2),
    "pp2_ep2": ({"pp": 2, "ep": 2}, 4),  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    # MLA attention, a dense first layer, a shared expert (parallelize_deepseekv3 always shards)
    "fsdp2_ep2_deepseek_v3": ({"ep": 2, "flavor": "deepseek_v3"}, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CASES))
def test_torchtitan_exact_budget_no_leak(layout: str, tmp_path: Path) -> None:
    case, world = CASES[layout]
    found = _run(case, world, tmp_path)
    _check(found)
    crossed = _tight_violations(found)
    assert not crossed, f"adaptive crossed a budget 30% below the calm peak: (rank, violations, peak, budget) {crossed}"
    if case.get("ep", 1) > 1:
        # Rank 0's tokens all go to expert 3, which lives on rank 1: rank 1's gate reports what
        # its experts receive from both ranks (after torchtitan's count exchange), so its
        # second local expert gets at least rank 0's every token in a spiked micro-batch.
        tokens = ranks.SEQ * (ranks.BATCH // 2 if case.get("pp", 1) > 1 else ranks.BATCH)  # per micro-batch
        counts = found[1]["policies"]["adaptive"]["counts"]
        spiked = [c for c, on in zip(counts, ranks.SPIKES) if on]
        assert spiked and all(len(c["0"]) == 2 and c["0"][1] >= tokens for c in spiked), counts
        calm = [c for c, on in zip(counts, ranks.SPIKES) if not on]
        assert all(sum(c["0"]) <= 2 * tokens * 2 for c in calm)


def _tiny_model() -> torch.nn.Module:
    config = ranks.tiny_config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


@pytest.mark.filterwarnings("ignore:In CPU autocast")  # torchtitan's router asks for fp32 autocast
def test_torchtitan_gates_found_without_registration() -> None:
    import bagualu2
    from bagualu2.runtime.gates import find_gates

    model = _tiny_model()
    specs = find_gates(model)
    assert [s.name for s in specs] == [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(2)]
    assert all(s.pre_hook and s.num_experts == 4 and s.top_k == 2 and s.ep_size == 1 for s in specs)
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    try:
        inputs, labels = ranks.batch(0)
        ranks.loss_fn(model(inputs), labels).backward()
        # Without EP the experts' counts are the layer's routing: top-k slots of every token.
        assert {k: sum(v) for k, v in prov.routing.counts.items() if k >= 0} == {
            0: ranks.BATCH * ranks.SEQ * 2, 1: ranks.BATCH * ranks.SEQ * 2}
        assert prov.report()["resident_bytes"] == 0
    finally:
        prov.disable()


@pytest.mark.parametrize("option", ["full", "selective"])
def test_torchtitan_activation_checkpointing_refused(option: str) -> None:
    import bagualu2
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    model = _tiny_model()
    policy = FullAC.Config() if option == "full" else SelectiveAC.Config()
    policy.build().apply(model)
    with pytest.raises(ValueError, match=r"activation checkpointing.*activation_checkpoint=None"):
        bagualu2.enable(model, budget=None)
    assert "forward" not in model.__dict__, "a refused enable must leave the model as it was"


def test_torchtitan_memory_budget_checkpointing_refused() -> None:
    import bagualu2

    model = _tiny_model()
    # torch's own patch: a monkeypatch of its config module deletes the entry on undo.
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        with pytest.raises(ValueError, match=r"activation_memory_budget=0.5.*activation_checkpoint=None"):
            bagualu2.enable(model, budget=None)

