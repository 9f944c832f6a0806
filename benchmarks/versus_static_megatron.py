"""The Megatron-Core 0.16.1 engine of benchmarks/versus_static.py.

A Megatron ``GPTModel`` of the reference model's sizes (every layer MoE, no shared expert, no
dropout), with expert parallelism over the ranks and the alltoall token dispatcher, built by the
Megatron tests' builder (tests/megatron_ranks.py, CPU shims in tests/megatron_shims.py) and
trained one micro-batch per call of Megatron's own schedule (``get_forward_backward_func()``;
with bagualu2, the schedule ``enable_pipeline`` wraps). Its static options are
``TransformerConfig`` fields: ``recompute_granularity='full'`` with each ``recompute_method``
and ``recompute_num_layers``, and ``'selective'`` with the ``recompute_modules`` sets that
apply to this model on this machine. Spikes lift the chosen expert's router logits
(``spike_logits``) by wrapping each router's ``gating``, which Megatron's recompute reruns too.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Dict, List, Optional

import torch

from versus_static import KEEP, SEED, Engine, Run, Trace, _tokens, spike_logits

# recompute_modules that apply to this model on this machine (the rest are in left_out).
_SELECTIVE = ("core_attn", "moe")


class _MegatronRun(Run):
    def __init__(self, engine: "MegatronEngine", run: Any, forward_backward: Any, prov: Any = None) -> None:
        self.engine, self.model, self.forward_backward, self.prov = engine, run.model, forward_backward, prov
        self.expert: Optional[int] = None
        self.imbalance = 1.0
        self.routers = [m for m in self.model.modules() if hasattr(m, "gating") and hasattr(m, "topk")]
        if not self.routers:
            raise RuntimeError("no TopKRouter in the Megatron model: nothing to spike")
        top_k = engine.cfg.top_k
        for router in self.routers:
            gating = router.gating

            def spiked(x: torch.Tensor, gating: Any = gating) -> torch.Tensor:
                return spike_logits(gating(x), self.expert, self.imbalance, top_k)

            router.gating = spiked

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple:
        tokens = next(data_iterator)
        batch, seq = tokens.shape[0], tokens.shape[1] - 1
        position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        output = model(tokens[:, :-1].contiguous(), position_ids, None, labels=tokens[:, 1:].contiguous())

        def loss_func(output: torch.Tensor) -> tuple:
            loss = output.float().sum()
            return loss, torch.tensor(output.numel(), dtype=torch.int), {"loss": loss.detach().clone()}

        return output, loss_func

    def step(self, rank: int, trace: Trace, i: int) -> float:
        import megatron_ranks

        args = self.engine.args
        tokens = _tokens(self.engine.cfg.vocab_size, rank, i, args.batch, args.seq + 1)
        # Set for the whole micro-batch: a recomputed layer reruns its router in backward.
        self.expert, self.imbalance = trace.load(i)
        megatron_ranks.reseed("cpu", SEED + i)
        losses = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iter([tokens]), model=[self.model],
            num_microbatches=1, seq_length=args.seq, micro_batch_size=args.batch, forward_only=False)
        self.expert = None
        for p in self.model.parameters():
            p.grad = None
        return float(losses[0]["loss"])  # the wrapped schedule ends bagualu2's step itself

    def close(self) -> None:
        super().close()
        for router in self.routers:
            router.__dict__.pop("gating", None)


class MegatronEngine(Engine):
    """Megatron's recompute options: ``full`` (``uniform`` / ``block``, 1..L layers) and
    ``selective`` with sets of ``recompute_modules``."""

    name = "megatron"
    full = "full, uniform, recompute_num_layers=1"
    process_modules = ("megatron.core.models.gpt", "megatron.core.pipeline_parallel")

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        # Expected from Megatron 0.16.1 on this machine: selective core_attn recompute may be
        # redundant with Transformer Engine's fused attention (not used here); its own default
        # cuda_graph_scope is deprecated; its schedule calls a deprecated torch collective; Apex is
        # missing (torch norms).
        warnings.filterwarnings("ignore", message="If you are using transformer_engine")
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        warnings.filterwarnings("ignore", message="Apex is not installed")
        warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated")

    def grid(self) -> Dict[str, Any]:
        layers = self.args.layers
        grid: Dict[str, Any] = {}
        for n in (n for n in range(1, layers + 1) if layers % n == 0):  # uniform chunks must divide the layers
            grid[f"full, uniform, recompute_num_layers={n}"] = dict(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=n)
        for n in range(1, layers):  # block with every layer is uniform with one
            grid[f"full, block, recompute_num_layers={n}"] = dict(
                recompute_granularity="full", recompute_method="block", recompute_num_layers=n)
        for k in range(1, len(_SELECTIVE) + 1):
            for modules in itertools.combinations(_SELECTIVE, k):
                grid[f"selective, recompute_modules={'+'.join(modules)}"] = dict(
                    recompute_granularity="selective", recompute_modules=list(modules))
        return grid

    def recomputes_superset(self, a: str, b: str) -> bool:
        # Every full, uniform option recomputes every layer whole (chunks of N layers differ in
        # what a rerun holds at once, not in what is recomputed: none is a superset of another);
        # full, block, N recomputes the first N layers whole, so more layers recompute more; a
        # selective set recomputes what its subsets do. Full over every layer recomputes all a
        # selective set does; full over some layers does not (selective reaches every layer).
        if a == b or a == KEEP:
            return False
        if b == KEEP:
            return True
        kind_a, kind_b = a.split(", ")[:2], b.split(", ")[:2]
        if kind_a == ["full", "uniform"]:
            return kind_b != ["full", "uniform"]
        if kind_a == kind_b == ["full", "block"]:
            return int(a.rsplit("=", 1)[1]) > int(b.rsplit("=", 1)[1])
        if a.startswith("selective") and b.startswith("selective"):
            return set(a.rsplit("=", 1)[1].split("+")) > set(b.rsplit("=", 1)[1].split("+"))
        return False

    def left_out(self) -> Dict[str, str]:
        return {
            "recompute_modules=moe_act": "Megatron takes it only with moe_grouped_gemm, which needs a GPU "
                                         "(Transformer Engine or the grouped_gemm kernels)",
            "recompute_modules=layernorm": "Megatron's CheckpointWithoutOutput, which it runs under, needs "
                                           "Transformer Engine (FP8GlobalStateManager)",
            "recompute_modules=mlp, shared_experts, mla_up_proj": "this model has no dense MLP, no shared "
                                                                  "expert and no multi-latent attention",
            "fine_grained_activation_offloading": "needs a GPU: Megatron's offloader copies on CUDA streams "
                                                  "with CUDA events into a pool on 'cuda'",
        }

    def _build(self, options: Optional[Dict[str, Any]]) -> Any:
        import torch.distributed as dist
        import megatron_ranks

        cfg = self.cfg
        return megatron_ranks.build(
            ep=dist.get_world_size(), shared_expert=False, dropout=0.0, vocab=cfg.vocab_size,
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
            ffn_hidden_size=cfg.expert_hidden_size, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.top_k,
            moe_ffn_hidden_size=cfg.expert_hidden_size, moe_router_enable_expert_bias=False, **(options or {}))

    def static(self, option: Any) -> Run:
        run = self._build(option)
        return _MegatronRun(self, run, run.forward_backward)

    def provisioned(self, policy: str, budget: Optional[int], allocator: Any = None) -> Run:
        from bagualu2.integrations import megatron as adapter

        run = self._build(None)
        prov, forward_backward = adapter.enable_pipeline(run.chunks, run.forward_backward, budget=budget,
                                                         policy=policy, min_bytes=0, allocator=allocator,
                                                         **self.releases_option())
        prov.runtime.residency.reload_in_place = False  # backward copies offloads back, as on a device
        return _MegatronRun(self, run, forward_backward, prov)


__all__: List[str] = ["MegatronEngine"]
