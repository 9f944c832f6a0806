"""torchtitan 0.3.0 with compile on: ``CompileConfig(enable=True, components=["model"])``, so
torchtitan's ``apply_compile`` calls ``block.compile(backend, fullgraph=True)`` on every
transformer block before FSDP2 wraps it, on FSDP2, EP, FSDP2 + EP and PP (2 gloo ranks each).

Invariants defended, on every rank, against the same compiled torchtitan run without bagualu2
(same compile options): exactness (loss and every gradient bit for bit); backward dispatches
exactly the collectives it dispatches without bagualu2 (a compiled block that issues
collectives, through FSDP2's hooks or the EP token exchange inside it, is never rerun in
backward); nothing leaked after each step; no graph compiled and no recompile that the run
without bagualu2 did not do (Dynamo's counters over the runs without bagualu2, then, after
``torch._dynamo.reset()``, over the runs with it: bagualu2 is enabled before the blocks' first
compiled forward, see docs/CONTRACTS.md); the gates inside the compiled blocks report, through
the ``report_gate`` op, the tokens each rank's experts receive (EP: DTensor expert weights); adaptive under a budget 5% above the calm keep-all peak holds it through
spikes, which on the EP layouts push keep_all over that budget.

The policy matrix (keep_all, offload_all, recompute_all, a random plan, adaptive at 5% above the
calm peak and 30% below it) runs on FSDP2 + EP; the other layouts run recompute_all, a random
plan and adaptive (compiling is slow on 2 cores). Backend ``aot_eager`` (what
tests/test_compile.py uses on CPU; torchtitan passes ``CompileConfig.backend`` through, and
without FlexAttention, which the CPU shims replace, it does not force inductor).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

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
    import torchtitan.distributed.compile  # noqa: F401


import torchtitan_ranks as ranks  # noqa: E402
from pipeline_harness import check_engine_rank, launch  # noqa: E402

REDUCED = ("recompute_all", "random_plan", "adaptive")
EP_SPIKE = {"spike_rank": "all", "spike_experts": [2, 3], "keep_all_over": True}  # rank 1's experts take every token
CASES = {
    "fsdp2": ({"policies": REDUCED, "count_collectives": True}, 2),
    "ep2": ({"ep": 2, "fsdp": False, "policies": REDUCED, "count_collectives": True, **EP_SPIKE}, 2),
    "fsdp2_ep2": ({"ep": 2, "policies": ranks.POLICIES, "count_collectives": True, **EP_SPIKE}, 2),
    # a schedule runs forward and backward together: no backward count, the rest as above
    "pp2": ({"pp": 2, "policies": REDUCED}, 2),
}


def _run(case: Dict[str, Any], world: int, tmp_path: Path) -> List[Dict[str, Any]]:
    launch(ranks.run_case, world, {**case, "compile": "aot_eager"}, str(tmp_path), timeout_s=900)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CASES))
def test_torchtitan_compiled_blocks_exact_budget_no_recompile(layout: str, tmp_path: Path) -> None:
    case, world = CASES[layout]
    found = _run(case, world, tmp_path)
    for rank, result in enumerate(found):
        check_engine_rank(rank, result, case["policies"], "torchtitan")
        assert result["compiled_plain"]["graphs"] >= 1, f"rank {rank}: nothing was compiled: {result['compiled_plain']}"
        assert result["compiled"] == result["compiled_plain"], (
            f"rank {rank}: Dynamo compiled {result['compiled']} by the end, {result['compiled_plain']} after the "
            f"runs without bagualu2")
        assert any(k.endswith(":compiled") for k in result["random_plan_keys"]), result["random_plan_keys"]
    # The gates inside the compiled blocks report every micro-batch's routing: each token's
    # top-k slots, on this rank without EP, over the EP ranks with it.
    tokens = ranks.SEQ * (ranks.BATCH // 2 if case.get("pp", 1) > 1 else ranks.BATCH)
    ep = case.get("ep", 1)
    for i in range(len(ranks.SPIKES)):
        seen = [r["policies"]["adaptive"]["counts"][i] for r in found]
        for group in ([seen] if ep > 1 else [[c] for c in seen]):
            assert all(c for c in group), f"micro-batch {i}: a gate did not report: {seen}"
            for layer in group[0]:
                assert sum(sum(c[layer]) for c in group) == len(group) * tokens * 2, (i, layer, seen)
    if case.get("keep_all_over"):
        # Every token of both ranks goes to experts 2 and 3, rank 1's: its gate, inside the
        # compiled block, reports what its experts receive after the EP count exchange.
        tokens = ranks.SEQ * ranks.BATCH
        counts = found[1]["policies"]["adaptive"]["counts"]
        spiked = [c["0"] for c, on in zip(counts, ranks.SPIKES) if on]
        assert spiked and all(c == [2 * tokens, 2 * tokens] for c in spiked), counts
        keep_all = found[1]["policies"]["keep_all_budget"]
        assert keep_all["violations"] > 0, f"the spike must push keep_all over the budget on rank 1: {keep_all}"
        adaptive = found[1]["policies"]["adaptive"]
        released = adaptive["by_choice"]["offload"] + adaptive["by_choice"]["recompute"]
        assert released > 0, f"rank 1: adaptive released nothing where keep_all crossed: {adaptive['by_choice']}"


def _tiny_compiled_model(backend: str = "aot_eager") -> torch.nn.Module:
    """The tiny model, every block compiled by torchtitan's own ``apply_compile``."""
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    config = ranks.tiny_config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"], backend=backend),
                  parallel_dims=ParallelDims.from_config(ParallelismConfig(), 1))
    return model.train()


def test_torchtitan_compiled_blocks_are_regions() -> None:
    """``enable`` takes a model torchtitan compiled: each block is a region a fixed plan may name."""
    import bagualu2

    model = _tiny_compiled_model()
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.layers.values())
    prov = bagualu2.enable(model, budget=None, policy=bagualu2.Plan({"layers.1:compiled": bagualu2.Choice.RECOMPUTE}))
    assert [g.name for g in prov.gates] == [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(2)]
    prov.disable()
    with pytest.raises(ValueError, match="no compiled region"):
        bagualu2.enable(model, budget=None, policy=bagualu2.Plan({"layers.2:compiled": bagualu2.Choice.RECOMPUTE}))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:In CPU autocast")  # torchtitan's router asks for fp32 autocast
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("policy, backend", [("recompute_all", "aot_eager"), ("offload_all", "aot_eager"),
                                             ("recompute_all", "inductor"), ("offload_all", "inductor")])
def test_torchtitan_compiled_blocks_without_parallelism_rerun_exactly(policy: str, backend: str) -> None:
    """One process, no parallelism: the compiled blocks hold no collective, but write their own
    buffer (tokens per expert), so recompute_all offloads them rather than rerun them; bit-exact,
    and no more graphs than without bagualu2, with AOT autograd alone and with inductor's
    generated kernels."""
    import bagualu2
    from torch._dynamo.utils import counters

    def run(model: torch.nn.Module) -> List[Any]:
        out = []
        for i in range(3):
            inputs, labels = ranks.batch(i)
            loss = ranks.loss_fn(model(inputs), labels)
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        return out

    torch._dynamo.reset()
    counters.clear()
    expected = run(_tiny_compiled_model(backend))
    plain = ranks.compiled_graphs()
    torch._dynamo.reset()
    counters.clear()
    model = _tiny_compiled_model(backend)
    prov = bagualu2.enable(model, budget=None, policy=policy, min_bytes=0)
    try:
        got = run(model)
        assert ranks.compiled_graphs() == plain and plain["graphs"] >= 1, (ranks.compiled_graphs(), plain)
        for i, ((la, ga), (lb, gb)) in enumerate(zip(expected, got)):
            assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb)), f"step {i} differs"
        report = prov.report()
        if policy == "recompute_all":
            # torchtitan's MoE counts tokens per expert in a buffer its forward writes in place
            # (tokens_per_expert_E.add_): a rerun would count them twice, so its blocks are
            # offloaded instead, a fallback each (tests/test_compile.py)
            assert report["fallbacks"] > 0 and report["saved_bytes_by_choice"]["offload"] > 0, report
        else:
            assert report["fallbacks"] == 0 and report["saved_bytes_by_choice"]["offload"] > 0, report
        assert report["resident_bytes"] == 0
    finally:
        prov.disable()
        torch._dynamo.reset()
