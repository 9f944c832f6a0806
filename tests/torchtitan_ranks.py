"""Per-rank code of the torchtitan tests (tests/test_torchtitan.py): build a tiny torchtitan MoE
model, parallelize it with torchtitan's own functions, and compare training steps with and
without bagualu2. Run in processes started by ``pipeline_harness.launch``."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

import torchtitan_shims as shims

VOCAB, DIM, HEAD_DIM, SEQ, BATCH = 128, 64, 16, 16, 2


def tiny_config(flavor: str = "qwen3", layers: int = 2, experts: int = 4, top_k: int = 2, *, vocab: int = VOCAB,
                dim: int = DIM, heads: int = 4, head_dim: int = HEAD_DIM, moe_hidden: int = 32,
                max_seq: int = 4 * SEQ):
    """A tiny torchtitan MoE decoder config of ``flavor`` (``"qwen3"``: every layer MoE;
    ``"deepseek_v3"``: MLA attention, a dense first layer, then ``layers`` MoE layers with a
    shared expert), attention swapped for CPU SDPA. The keyword sizes apply to qwen3 (the
    deepseek_v3 config keeps the tests' own)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear

    if flavor == "qwen3":
        from torchtitan.models.qwen3 import (Qwen3Model, _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers,
                                             _qwen3_norm)
        config = Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
            layers=_build_qwen3_moe_layers(
                n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=max(1, heads // 2), head_dim=head_dim,
                moe_hidden_dim=moe_hidden, num_experts=experts, top_k=top_k, attn_backend="flex",
                moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq, theta=1e6)))
    elif flavor == "deepseek_v3":
        from torchtitan.models.common.nn_modules import RMSNorm
        from torchtitan.models.deepseek_v3 import (DeepSeekV3Model, _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers,
                                                   _build_mtp_layers, _output_linear_init)
        blocks = _build_dsv3_layers(
            n_layers=layers + 1, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
            qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=8, v_head_dim=HEAD_DIM, mscale=0.70,
            dense_hidden_dim=64, moe_hidden_dim=32, num_experts=experts, num_shared_experts=1,
            router_top_k=top_k, router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
            non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=8, max_seq_len=4 * SEQ, theta=1e4))
        config = DeepSeekV3Model.Config(
            vocab_size=VOCAB, dim=DIM, norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
            layers=blocks, mtp_layers=_build_mtp_layers(blocks[-1], dim=DIM, num_mtp_layers=0))
    else:
        raise ValueError(f"flavor={flavor!r}: the tests build 'qwen3' or 'deepseek_v3'")
    return shims.with_sdpa(config)


def parallelize_fn(flavor: str):
    """torchtitan's own parallelize function of ``flavor``."""
    if flavor == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
        return parallelize_deepseekv3
    from torchtitan.models.qwen3 import parallelize_qwen3
    return parallelize_qwen3


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def pipeline_loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple:
    """torchtitan's pipeline schedules take a loss function returning (loss, extra)."""
    return loss_fn(logits, labels), None


def build(world: int, *, ep: int = 1, pp: int = 1, fsdp: bool = True, flavor: str = "qwen3",
          layers: int = 2, microbatches: int = 2, ac_config: Any = None, **sizes: Any) -> SimpleNamespace:
    """The model (or this rank's pipeline stages) parallelized by torchtitan: FSDP2 over the
    ranks a pipeline stage has (unless ``fsdp`` is false: torchtitan's ``skip_dp``), EP of
    ``ep`` inside them, torchtitan's activation checkpointing ``ac_config`` (none by default).
    ``sizes``: :func:`tiny_config`'s keywords."""
    shims.use_cpu()
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    parallelize = parallelize_fn(flavor)
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(expert_parallel_degree=ep, pipeline_parallel_degree=pp,
                                    spmd_backend="partial_dtensor",
                                    pipeline_parallel_schedule="1F1B",
                                    pipeline_parallel_microbatch_size=BATCH // microbatches if pp > 1 else 1)
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    config = tiny_config(flavor, layers, **sizes)
    # Sets the sharding torchtitan's parallelize applies (EP's expert sharding among it), as
    # its Trainer does before building.
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    kwargs = dict(parallel_dims=dims, training=training, parallelism=parallelism,
                  compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
    if not fsdp:
        kwargs["skip_dp"] = True
    schedule = None
    if pp > 1:
        from torchtitan.distributed.pipeline_parallel import pipeline_llm

        schedule, parts, first, last = pipeline_llm(
            model, device=torch.device("cpu"), model_config=config, parallelize_fn=parallelize,
            loss_fn=pipeline_loss_fn, **kwargs)
    else:
        parts = [parallelize(model, **kwargs)]
        first = last = True
    for part in parts:
        part.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
        shims.force_sum_reduction(part)
    return SimpleNamespace(parts=parts, schedule=schedule, first=first, last=last, dims=dims)


def batch(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step(run: SimpleNamespace, seed: int) -> Dict[str, Any]:
    """One forward + backward; returns the loss and every gradient (local shards), and clears
    the gradients."""
    inputs, labels = batch(seed)
    if run.schedule is not None:
        losses: List[torch.Tensor] = []
        run.schedule.step(inputs if run.first else None, target=labels if run.last else None,
                          losses=losses)
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
    else:
        loss = loss_fn(run.parts[0](inputs), labels)
        loss.backward()
    grads = {}
    for i, part in enumerate(run.parts):
        for name, p in part.named_parameters():
            g = p.grad
            if g is not None:
                grads[f"{i}.{name}"] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
            p.grad = None
    return {"loss": loss.detach().clone(), "grads": grads}


def mismatches(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    bad = [] if torch.equal(a["loss"], b["loss"]) else [f"loss {a['loss'].item()} != {b['loss'].item()}"]
    if a["grads"].keys() != b["grads"].keys():
        bad.append(f"grad names differ: {sorted(a['grads'].keys() ^ b['grads'].keys())}")
    bad += [f"grad {n}" for n in a["grads"] if n in b["grads"] and not torch.equal(a["grads"][n], b["grads"][n])]
    return bad


def set_spike(run: SimpleNamespace, on: bool, expert: int) -> None:
    """Route every token of this rank to ``expert`` (besides its other top-k choices) through
    torchtitan's own load-balancing bias, or route freely again."""
    for part in run.parts:
        for layer in part.layers.values():
            moe = getattr(layer, "moe", None)
            if moe is not None and moe.expert_bias_E is not None:
                moe.expert_bias_E.zero_()
                if on:
                    moe.expert_bias_E[expert] = 1.0  # above any softmax score: always chosen


# Micro-batches of the adaptive run: profiled and calibrating ones first, then spikes.
SPIKES = [False] * 6 + [True, True, False, True, False]
STATIC = [False, True, False]


def run_case(rank: int, world: int, case: Dict[str, Any], out: str) -> None:
    """Every policy on one parallel layout against the same run without bagualu2; writes this
    rank's findings to ``out/rank<r>.json``."""
    import bagualu2
    from bagualu2.integrations import torchtitan as adapter

    run = build(world, ep=case.get("ep", 1), pp=case.get("pp", 1), fsdp=case.get("fsdp", True),
                flavor=case.get("flavor", "qwen3"))
    spike_rank, spike_expert = case.get("spike_rank", 0), case.get("spike_expert", 3)

    def sequence(spikes: List[bool], start: int = 0) -> List[Dict[str, Any]]:
        results = []
        for i, on in enumerate(spikes, start):
            set_spike(run, on and rank == spike_rank, spike_expert)
            results.append(step(run, 1000 * rank + i))
            if prov is not None:
                rep = prov.report()
                results[-1]["resident"] = rep["resident_bytes"]
                results[-1]["arena_in_use"] = rep["arena_in_use_bytes"]
                results[-1]["counts"] = {str(k): v for k, v in prov.routing.counts.items() if k >= 0}
        return results

    def enable(**options: Any) -> Any:
        if run.schedule is not None:
            return adapter.enable_pipeline(run.schedule, run.parts, min_bytes=0, **options)
        return bagualu2.enable(run.parts[0], min_bytes=0, **options)

    prov = None
    plain = {"static": sequence(STATIC), "spikes": sequence(SPIKES)}
    found: Dict[str, Any] = {"gates": [], "policies": {}}

    def record(name: str, results: List[Dict[str, Any]], report: Dict[str, Any]) -> None:
        reference = plain["spikes" if len(results) == len(SPIKES) else "static"]
        found["policies"][name] = {
            "mismatches": [mismatches(a, b) for a, b in zip(reference, results)],
            "resident_after_steps": [r["resident"] for r in results],
            "arena_after_steps": [r["arena_in_use"] for r in results],
            "violations": report["violations"], "peak": report["peak_bytes_with_backward"],
            "budget": report["budget_bytes"], "by_choice": report["saved_bytes_by_choice"],
            "micro_batches": report["micro_batches"], "traced": report["traced_micro_batches"],
            "decisions": report["decisions"], "fallbacks": report["fallbacks"],
            "counts": [r.get("counts") for r in results]}

    for policy in ("keep_all", "offload_all", "recompute_all"):
        prov = enable(budget=None, policy=policy)
        results = sequence(STATIC)
        found["gates"] = prov.report()["gates"]
        record(policy, results, prov.report())
        prov.disable()

    # A random plan over the operator keys a profiled micro-batch saved.
    prov = enable(budget=None, policy=bagualu2.Plan({}))
    first = sequence(STATIC[:1])  # profiled, all kept
    choices = list(bagualu2.Choice)
    pick = random.Random(case.get("plan_seed", 0))
    prov.policy = {key: pick.choice(choices) for key in prov.cost.order}
    record("random_plan", first + sequence(STATIC[1:], start=1), prov.report())
    prov.disable()

    # Adaptive under a budget 5% above the calm peak of keep_all on this rank.
    prov = enable(budget=None, policy="keep_all")
    sequence([False] * 2)
    calm = prov.report()["peak_bytes_with_backward"]
    prov.disable()
    prov = enable(budget=int(calm * 1.05), policy="adaptive")
    record("adaptive", sequence(SPIKES), prov.report())
    prov.disable()
    # ... and under one below it: every micro-batch is traced and planned, and the first ones
    # after profiling recompute all they can (calibration).
    prov = enable(budget=int(calm * 0.7), policy="adaptive")
    record("adaptive_tight", sequence(SPIKES), prov.report())
    prov.disable()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
