"""Per-rank code of the Megatron-Core tests (tests/test_megatron.py): build a tiny Megatron MoE
GPTModel (local spec, CPU shims from tests/megatron_shims.py), train it through Megatron's own
``get_forward_backward_func()`` schedule, and compare steps with and without bagualu2. Run in
processes started by ``pipeline_harness.launch``."""
from __future__ import annotations

import json
import random
import warnings
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Union

import torch

VOCAB, HIDDEN, HEADS, SEQ, MICRO_BATCH = 128, 64, 4, 16, 2
EXPERTS, TOP_K, LAYERS = 4, 2, 2


def _quiet_import() -> None:
    """Megatron-Core warns at import that Transformer Engine and Apex are missing (CPU run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401


def build(*, pp: int = 1, ep: int = 1, vpp: Optional[int] = None, dispatcher: str = "alltoall",
          shared_expert: bool = True, dropout: float = 0.1, device: str = "cpu", te: bool = False,
          grouped_gemm: bool = False, vocab: int = VOCAB, **config_options: Any) -> SimpleNamespace:
    """Megatron's parallel state over the launched ranks (TP=1, ``pp`` stages, EP ``ep``, ``vpp``
    model chunks per rank when given: ``LAYERS`` layers per chunk) and this rank's chunks of a
    tiny MoE GPTModel built by Megatron's own classes (``chunks``; ``model`` is the first).
    ``device="cuda"``: on this rank's GPU without the CPU shims, with Transformer Engine's layer
    spec when ``te`` (its grouped GEMM experts when ``grouped_gemm``). ``config_options`` override
    the TransformerConfig's (sizes, recompute options)."""
    _quiet_import()
    import megatron_shims as shims
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    if device == "cuda":
        torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp)
    reseed(device, 1234)
    options = dict(
        num_layers=LAYERS * (vpp or 1), hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=HIDDEN,
        moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # how the tests spike the routing (set_spike)
        moe_shared_expert_intermediate_size=HIDDEN if shared_expert else None,
        hidden_dropout=dropout, attention_dropout=0.0, add_bias_linear=False,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp,
        **(shims.cpu_config_options() if device == "cpu" else dict(
            moe_grouped_gemm=grouped_gemm, params_dtype=torch.float32, pipeline_dtype=torch.float32,
            deallocate_pipeline_outputs=False)))
    options.update(config_options)
    config = TransformerConfig(**options)
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped_gemm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(1234)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = dict(ignore_virtual=False, vp_stage=vp_stage) if vpp else {}
        chunk = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                         max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(**stage),
                         post_process=parallel_state.is_pipeline_last_stage(**stage),
                         share_embeddings_and_output_weights=False, position_embedding_type="rope",
                         vp_stage=vp_stage if vpp else None)
        chunks.append(chunk.to(device).train())
    return SimpleNamespace(model=chunks[0], chunks=chunks, config=config, pp=pp, ep=ep, device=device,
                           forward_backward=get_forward_backward_func())


def reseed(device: str, value: int) -> None:
    """Seed torch and Megatron's RNG tracker: on the CPU generator through the test shims, or
    as Megatron seeds a GPU run."""
    import megatron_shims as shims

    if device == "cpu":
        shims.use_cpu(seed=value)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(value)
        model_parallel_cuda_manual_seed(value)


def batches(seed: int, count: int) -> List[Dict[str, Any]]:
    """``count`` micro-batches of tokens and next-token labels (``[batch, seq]``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def _routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "topk") and hasattr(m, "expert_bias")]


def set_spike(model: torch.nn.Module, expert: Union[int, List[int], None]) -> None:
    """Route every token of this rank to ``expert`` (an expert, or a list of at most top-k of them;
    besides its other top-k choices) through Megatron's own expert bias, or route freely again
    (``None``). Called between steps only, as Megatron updates the bias: under 1F1B a
    micro-batch's backward comes after later micro-batches' forwards, and a recompute must see
    the routing its forward saw."""
    experts = [] if expert is None else [expert] if isinstance(expert, int) else list(expert)
    for router in _routers(model):
        router.expert_bias.zero_()
        for e in experts:
            router.expert_bias[e] = 10.0  # above any sigmoid score: always chosen


def _loss_func(output: torch.Tensor) -> tuple:
    loss = output.float().sum()
    return loss, torch.tensor(output.numel(), dtype=torch.int), {"loss": loss.detach().clone()}


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple:
    """Megatron's forward_step_func: per-token losses and their reduction."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, -1)
    output = model(batch["tokens"].to(device), position_ids, None, labels=batch["labels"].to(device))
    return output, _loss_func


def step(run: SimpleNamespace, seed: int, microbatches: int, spike: Union[int, List[int], None] = None,
         forward_backward: Any = None) -> Dict[str, Any]:
    """One training step of ``microbatches`` through Megatron's schedule (the same RNG state for
    every run of it), routing this rank's tokens onto expert ``spike`` if given; returns the
    losses this rank saw, every gradient of every chunk and the tokens each router counted for
    its expert-bias update (which a rerun in backward must not count twice), and clears them."""
    func = forward_backward or run.forward_backward
    routers = [r for chunk in run.chunks for r in _routers(chunk)]
    for chunk in run.chunks:
        set_spike(chunk, spike)
    for router in routers:
        router.local_tokens_per_expert.zero_()  # as Megatron's expert-bias update does each step
    reseed(run.device, seed)
    # The interleaved schedule reads each chunk's micro-batches from its own iterator.
    data = ([iter(batches(seed, microbatches)) for _ in run.chunks] if len(run.chunks) > 1
            else iter(batches(seed, microbatches)))
    losses = func(forward_step_func=forward_step, data_iterator=data, model=run.chunks,
                  num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                  forward_only=False)
    loss = torch.stack([d["loss"] for d in losses]) if losses else torch.zeros(0)
    grads = {}
    for i, chunk in enumerate(run.chunks):
        for name, p in chunk.named_parameters():
            if p.grad is not None:
                grads[f"chunk {i}: {name}"] = p.grad.detach().clone()
            p.grad = None
    counted = {f"router {i}": r.local_tokens_per_expert.clone() for i, r in enumerate(routers)}
    return {"loss": loss, "grads": grads, "counted": counted}


def trace_schedule(run: SimpleNamespace, prov: Any = None) -> tuple:
    """Record the order in which Megatron's schedule runs forwards and backwards on this rank's
    chunks: ``("F", chunk, declared)`` as each chunk's decoder begins (``declared``: the phase and
    stacked forwards ``prov`` was told for it, when given) and ``("B", chunk)`` as the gradient of
    its decoder's output arrives. Returns (the record, a function removing the hooks)."""
    record: List[tuple] = []
    handles = []
    for i, chunk in enumerate(run.chunks):
        def before(module: Any, args: Any, i: int = i) -> None:
            if torch.is_grad_enabled():
                told = [prov.stacking.phase, prov.stacking.declared] if prov is not None else None
                record.append(("F", i, told))

        def after(module: Any, args: Any, out: Any, i: int = i) -> None:
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(lambda grad: record.append(("B", i)))

        handles += [chunk.decoder.register_forward_pre_hook(before), chunk.decoder.register_forward_hook(after)]
    return record, lambda: [h.remove() for h in handles]


def stacked_in(record: List[tuple]) -> List[List[int]]:
    """[chunk, forwards after it before the next backward] of each forward of a ``trace_schedule``
    record: what actually stacked."""
    out = []
    for n, event in enumerate(record):
        if event[0] == "F":
            later = 0
            for other in record[n + 1:]:
                if other[0] == "B":
                    break
                later += 1
            out.append([event[1], later])
    return out


def mismatches(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    bad = [] if torch.equal(a["loss"], b["loss"]) else [f"loss {a['loss'].tolist()} != {b['loss'].tolist()}"]
    if a["grads"].keys() != b["grads"].keys():
        bad.append(f"grad names differ: {sorted(a['grads'].keys() ^ b['grads'].keys())}")
    bad += [f"grad {n}" for n in a["grads"] if n in b["grads"] and not torch.equal(a["grads"][n], b["grads"][n])]
    return bad


def counted_mismatches(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """Routers whose tokens counted for the expert-bias update differ between two steps."""
    return [f"{n} counted {a['counted'][n].tolist()} != {b['counted'][n].tolist()}" for n in a["counted"]
            if not torch.equal(a["counted"][n], b["counted"][n])]


# Steps of the adaptive run (whether this rank's routing spikes in each): profiled and
# calibrating micro-batches first, then spikes.
SPIKES = [False] * 3 + [True, True, False, True, False]
STATIC = [False, True]


def run_case(rank: int, world: int, case: Dict[str, Any], out: str) -> None:
    """Every policy on one Megatron layout against the same run without bagualu2; writes this
    rank's findings to ``out/rank<r>.json``."""
    import bagualu2
    from bagualu2.integrations import megatron as adapter
    from megatron.core import parallel_state

    options = {k: v for k, v in case.items()
               if k not in ("microbatches", "spike_rank", "spike_expert", "plan_seed", "spiked_keep_all")}
    run = build(**options)
    micro = case.get("microbatches", 2)
    data_rank = parallel_state.get_data_parallel_rank()
    # The data-parallel rank that spikes (None: every one).
    spike = case.get("spike_expert", 3) if case.get("spike_rank", 0) in (None, data_rank) else None

    def sequence(spikes: List[bool], forward_backward: Any = None, start: int = 0) -> List[Dict[str, Any]]:
        results = []
        for i, on in enumerate(spikes, start):
            results.append(step(run, 1000 * data_rank + i, micro, spike if on else None, forward_backward))
            if prov is not None:
                rep = prov.report()
                results[-1]["resident"] = rep["resident_bytes"]
                results[-1]["arena_in_use"] = rep["arena_in_use_bytes"]
                results[-1]["counts"] = {str(k): v for k, v in prov.routing.counts.items() if k >= 0}
        return results

    prov = None
    traced, untrace = trace_schedule(run)
    plain = {"static": sequence(STATIC)}
    untrace()
    plain["spikes"] = sequence(SPIKES)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if len(run.chunks) > 1:
        derived = [[c, n] for c, _, n in adapter.interleaved_phases(
            stages, stage, micro, len(run.chunks), run.config.microbatch_group_size_per_vp_stage)]
    else:
        derived = [[0, n] for _, n in adapter.one_f_one_b_phases(stages, stage, micro)]
    # What stacked in Megatron's own run, against what enable_pipeline derives (one step's worth).
    found_schedule = {"megatron": stacked_in(traced), "derived": derived * len(STATIC)}
    found: Dict[str, Any] = {"gates": [], "policies": {}, "schedule": found_schedule}

    def record(name: str, results: List[Dict[str, Any]], report: Dict[str, Any]) -> None:
        reference = plain["spikes" if len(results) == len(plain["spikes"]) else "static"]
        found["policies"][name] = {
            "mismatches": [mismatches(a, b) for a, b in zip(reference, results)],
            "counted_mismatches": [counted_mismatches(a, b) for a, b in zip(reference, results)],
            "resident_after_steps": [r["resident"] for r in results],
            "arena_after_steps": [r["arena_in_use"] for r in results],
            "violations": report["violations"], "peak": report["peak_bytes_with_backward"],
            "budget": report["budget_bytes"], "by_choice": report["saved_bytes_by_choice"],
            "micro_batches": report["micro_batches"], "steps": report["steps"],
            "counts": [r.get("counts") for r in results]}

    for policy in ("keep_all", "offload_all", "recompute_all"):
        prov, fb = adapter.enable_pipeline(run.chunks, run.forward_backward, budget=None, policy=policy, min_bytes=0)
        results = sequence(STATIC, fb)
        found["gates"] = prov.report()["gates"]
        record(policy, results, prov.report())
        prov.disable()

    # A random plan over the operator keys a profiled step saved.
    prov, fb = adapter.enable_pipeline(run.chunks, run.forward_backward, budget=None,
                                       policy=bagualu2.Plan({}), min_bytes=0)
    first = sequence(STATIC[:1], fb)  # profiled, all kept
    pick = random.Random(case.get("plan_seed", 0))
    prov.policy = {key: pick.choice(list(bagualu2.Choice)) for key in prov.cost.order}
    record("random_plan", first + sequence(STATIC[1:], fb, start=1), prov.report())
    prov.disable()

    # Adaptive under a budget 5% above the calm peak of keep_all on this rank.
    prov, fb = adapter.enable_pipeline(run.chunks, run.forward_backward, budget=None, policy="keep_all", min_bytes=0)
    sequence([False] * 2, fb)
    calm = prov.report()["peak_bytes_with_backward"]
    prov.disable()
    if case.get("spiked_keep_all"):
        # The same budget under keep_all through the same spikes: what adaptive has to hold.
        prov, fb = adapter.enable_pipeline(run.chunks, run.forward_backward, budget=int(calm * 1.05),
                                           policy="keep_all", min_bytes=0)
        record("keep_all_spiked", sequence(SPIKES, fb), prov.report())
        prov.disable()
    prov, fb = adapter.enable_pipeline(run.chunks, run.forward_backward, budget=int(calm * 1.05),
                                       policy="adaptive", min_bytes=0)
    traced, untrace = trace_schedule(run, prov)
    record("adaptive", sequence(SPIKES, fb), prov.report())
    untrace()
    prov.disable()
    # What the provisioner was told before each forward, against what then stacked.
    found_schedule["told"] = [[e[1], e[2][1]] for e in traced if e[0] == "F"]
    found_schedule["phases"] = [e[2][0] for e in traced if e[0] == "F"]
    found_schedule["provisioned"] = stacked_in(traced)
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
