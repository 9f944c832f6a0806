"""Per-rank code of the torchtitan tests (tests/test_torchtitan.py): build a tiny torchtitan MoE
model, parallelize it with torchtitan's own functions, and compare training steps with and
without bagualu2. Run in processes started by ``pipeline_harness.launch``."""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

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
          layers: int = 2, microbatches: int = 2, compile_backend: Optional[str] = None, ac_config: Any = None,
          **sizes: Any) -> SimpleNamespace:
    """The model (or this rank's pipeline stages) parallelized by torchtitan: FSDP2 over the
    ranks a pipeline stage has (unless ``fsdp`` is false: torchtitan's ``skip_dp``), EP of
    ``ep`` inside them, torchtitan's activation checkpointing ``ac_config`` (none by default);
    with ``compile_backend``, every block compiled by torchtitan (``CompileConfig(enable=True,
    components=["model"], backend=compile_backend)``: each block's ``compile(backend,
    fullgraph=True)``). ``sizes``: :func:`tiny_config`'s keywords."""
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
    compile_config = (CompileConfig() if compile_backend is None
                      else CompileConfig(enable=True, components=["model"], backend=compile_backend))
    kwargs = dict(parallel_dims=dims, training=training, parallelism=parallelism,
                  compile_config=compile_config, ac_config=ac_config, dump_folder="")
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


def batch(seed: Optional[int]) -> tuple:
    """Inputs and labels drawn from ``seed``, or from the global RNG when it is None (a data
    pipeline whose state a checkpoint must restore)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step(run: SimpleNamespace, seed: Optional[int], update: Optional[Callable[[], None]] = None,
         count: bool = False) -> Dict[str, Any]:
    """One forward + backward on ``batch(seed)``; returns the loss and every gradient (local
    shards), calls ``update`` (an optimizer step) and clears the gradients. ``count`` (no
    pipeline): also the collectives backward dispatched."""
    from pipeline_harness import CollectiveCounter

    inputs, labels = batch(seed)
    counter = None
    if run.schedule is not None:
        losses: List[torch.Tensor] = []
        run.schedule.step(inputs if run.first else None, target=labels if run.last else None,
                          losses=losses)
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
    else:
        loss = loss_fn(run.parts[0](inputs), labels)
        if count:
            with CollectiveCounter() as counter:
                loss.backward()
        else:
            loss.backward()
    grads = {}
    for i, part in enumerate(run.parts):
        for name, p in part.named_parameters():
            g = p.grad
            if g is not None:
                grads[f"{i}.{name}"] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
    if update is not None:
        update()
    for part in run.parts:
        for p in part.parameters():
            p.grad = None
    return {"loss": loss.detach().clone(), "grads": grads,
            "backward_collectives": counter.count if counter is not None else None}


def mismatches(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    bad = [] if torch.equal(a["loss"], b["loss"]) else [f"loss {a['loss'].item()} != {b['loss'].item()}"]
    if a["grads"].keys() != b["grads"].keys():
        bad.append(f"grad names differ: {sorted(a['grads'].keys() ^ b['grads'].keys())}")
    bad += [f"grad {n}" for n in a["grads"] if n in b["grads"] and not torch.equal(a["grads"][n], b["grads"][n])]
    if a["backward_collectives"] != b["backward_collectives"]:
        bad.append(f"backward dispatched {b['backward_collectives']} collectives, {a['backward_collectives']} "
                   f"without bagualu2")
    return bad


def set_spike(run: SimpleNamespace, on: bool, *experts: int) -> None:
    """Route every token of this rank to each of ``experts`` (at most top-k of them; its other
    choices as before) through torchtitan's own load-balancing bias, or route freely again."""
    for part in run.parts:
        for layer in part.layers.values():
            moe = getattr(layer, "moe", None)
            if moe is not None and moe.expert_bias_E is not None:
                moe.expert_bias_E.zero_()
                if on:
                    moe.expert_bias_E[list(experts)] = 1.0  # above any softmax score: always chosen


# Micro-batches of the adaptive run: profiled and calibrating ones first, then spikes.
SPIKES = [False] * 6 + [True, True, False, True, False]
STATIC = [False, True, False]
POLICIES = ("keep_all", "offload_all", "recompute_all", "random_plan", "adaptive", "adaptive_tight")


def compiled_graphs() -> Dict[str, int]:
    """What Dynamo compiled in this process so far: graphs, and recompiles (guard failures)."""
    from torch._dynamo.utils import counters, guard_failures

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "recompiles": sum(len(v) for v in guard_failures.values())}


def run_case(rank: int, world: int, case: Dict[str, Any], out: str) -> None:
    """The policies ``case["policies"]`` (default all of ``POLICIES``) on one parallel layout
    against the same run without bagualu2; writes this rank's findings to ``out/rank<r>.json``.
    With ``case["compile"]`` (a backend) every block is compiled by torchtitan, and what Dynamo
    compiled is recorded after the runs without bagualu2 and after all."""
    import bagualu2
    from bagualu2.integrations import torchtitan as adapter

    run = build(world, ep=case.get("ep", 1), pp=case.get("pp", 1), fsdp=case.get("fsdp", True),
                flavor=case.get("flavor", "qwen3"), compile_backend=case.get("compile"))
    # The ranks that spike (default rank 0; "all": every rank), to the experts ``spike_experts``.
    spike_rank, spike_experts = case.get("spike_rank", 0), case.get("spike_experts", (3,))
    count = bool(case.get("count_collectives"))
    wanted = set(case.get("policies", POLICIES))

    def sequence(spikes: List[bool], start: int = 0) -> List[Dict[str, Any]]:
        results = []
        for i, on in enumerate(spikes, start):
            set_spike(run, on and spike_rank in (rank, "all"), *spike_experts)
            results.append(step(run, 1000 * rank + i, count=count))
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
    found: Dict[str, Any] = {"gates": [], "policies": {}, "compiled_plain": compiled_graphs()}
    if case.get("compile"):
        # bagualu2 is enabled before the compiled blocks' first forward, as a user does: Dynamo
        # does not guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards), so
        # code compiled before enable would keep running without the gates' report.
        from torch._dynamo.utils import counters, guard_failures

        torch._dynamo.reset()
        counters.clear()
        guard_failures.clear()

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
        if policy not in wanted:
            continue
        prov = enable(budget=None, policy=policy)
        results = sequence(STATIC)
        found["gates"] = prov.report()["gates"]
        record(policy, results, prov.report())
        prov.disable()

    if "random_plan" in wanted:  # over the operator and region keys a profiled micro-batch saved
        prov = enable(budget=None, policy=bagualu2.Plan({}))
        first = sequence(STATIC[:1])  # profiled, all kept
        found["gates"] = prov.report()["gates"]
        choices = list(bagualu2.Choice)
        pick = random.Random(case.get("plan_seed", 0))
        plan = {key: pick.choice(choices) for key in prov.cost.order}
        prov.policy = plan
        found["random_plan_keys"] = {key: choice.name for key, choice in plan.items()}
        record("random_plan", first + sequence(STATIC[1:], start=1), prov.report())
        prov.disable()

    # Adaptive under a budget 5% above the calm peak of keep_all on this rank.
    prov = enable(budget=None, policy="keep_all")
    sequence([False] * 2)
    calm = prov.report()["peak_bytes_with_backward"]
    found["gates"] = prov.report()["gates"]
    prov.disable()
    if case.get("keep_all_over"):  # what keep_all does under that budget through the spikes
        prov = enable(budget=int(calm * 1.05), policy="keep_all")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "went over the activation budget")
            record("keep_all_budget", sequence(SPIKES), prov.report())
        prov.disable()
    if "adaptive" in wanted:
        prov = enable(budget=int(calm * 1.05), policy="adaptive")
        record("adaptive", sequence(SPIKES), prov.report())
        prov.disable()
    if "adaptive_tight" in wanted:
        # ... and under one below it: every micro-batch is traced and planned, and the first
        # ones after profiling recompute all they can (calibration).
        prov = enable(budget=int(calm * 0.7), policy="adaptive")
        record("adaptive_tight", sequence(SPIKES), prov.report())
        prov.disable()
    found["compiled"] = compiled_graphs()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
