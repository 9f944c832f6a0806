"""The torchtitan 0.3.0 engine of benchmarks/versus_static.py.

A qwen3-flavoured torchtitan MoE decoder of the reference model's sizes, parallelized by
torchtitan's own ``parallelize_qwen3`` with expert parallelism over the ranks (no FSDP: the
dense weights are replicated, as in the reference model), built by the torchtitan tests'
builder (tests/torchtitan_ranks.py, CPU shims in tests/torchtitan_shims.py). Its static options
are torchtitan's ``activation_checkpoint`` modes, applied by its ``parallelize`` as its Trainer
does: ``full`` (every block under ``FullAC``) and ``selective`` (its op-list SAC on every
block, with and without its default forced recompute of the router's matmul). torchtitan
0.3.0 has no per-layer frequency any more (it wraps every block); the per-layer subsets are its
``FullAC`` block wrapper on the chosen blocks, which is what the frequency did. Spikes lift the
chosen expert's router logits (``spike_logits``), through a forward hook on each router's gate
that also fires when a checkpointed block reruns it.
"""
from __future__ import annotations

import itertools
import os
import warnings
from typing import Any, Dict, List, Optional

import torch

import bagualu2
from versus_static import Engine, Run, Trace, _tokens, spike_logits


class _TorchtitanRun(Run):
    def __init__(self, engine: "TorchtitanEngine", model: torch.nn.Module, prov: Any = None) -> None:
        self.engine, self.model, self.prov = engine, model, prov
        self.expert: Optional[int] = None
        self.imbalance = 1.0
        top_k = engine.cfg.top_k
        self.handles = [m.gate.register_forward_hook(
            lambda module, args, out: spike_logits(out, self.expert, self.imbalance, top_k))
            for m in model.modules() if type(m).__name__ == "TokenChoiceTopKRouter"]
        if not self.handles:
            raise RuntimeError("no TokenChoiceTopKRouter in the torchtitan model: nothing to spike")

    def step(self, rank: int, trace: Trace, i: int) -> float:
        import torchtitan_ranks

        args = self.engine.args
        tokens = _tokens(self.engine.cfg.vocab_size, rank, i, args.batch, args.seq + 1)
        # Set for the whole micro-batch: a checkpointed block reruns its router in backward.
        self.expert, self.imbalance = trace.load(i)
        self.model.zero_grad(set_to_none=True)
        loss = torchtitan_ranks.loss_fn(self.model(tokens[:, :-1].contiguous()), tokens[:, 1:].contiguous())
        loss.backward()
        self.expert = None
        if self.prov is not None:
            self.prov.step()
        return float(loss.detach())

    def close(self) -> None:
        super().close()
        for h in self.handles:
            h.remove()


class TorchtitanEngine(Engine):
    """torchtitan's activation checkpointing: ``full``, ``selective`` (op list), and ``FullAC``
    on per-layer subsets of blocks."""

    name = "torchtitan"
    full = "activation_checkpoint=full"
    selective = "activation_checkpoint=selective (op list)"
    selective_router_saved = "activation_checkpoint=selective (op list, router matmul saved too)"
    process_modules = ("torchtitan.distributed", "torchtitan.models.qwen3")
    checkpointing = "torch.distributed.checkpoint (DCP) save / load of the model's state_dict"

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        # Expected on a CPU run: torchtitan's router asks autocast for fp32 (CPU autocast
        # declines), and DTensor warns that its random ops are not complete on a cpu mesh (the
        # model has no random ops).
        warnings.filterwarnings("ignore", message="In CPU autocast")
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")

    def grid(self) -> Dict[str, Any]:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        layers = self.args.layers
        grid: Dict[str, Any] = {
            self.full: FullAC.Config(),
            self.selective: SelectiveAC.Config(),
            self.selective_router_saved: SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[]),
        }
        for k in range(1, layers):
            for blocks in itertools.combinations(range(layers), k):
                grid[f"full AC on blocks {','.join(map(str, blocks))}"] = blocks
        return grid

    def left_out(self) -> Dict[str, str]:
        return {"activation_checkpoint=memory-budget": (
            "it sets the compiler partitioner's activation_memory_budget, which only a torch.compile'd "
            "model reads (eager runs it as keep-all); this grid runs torchtitan eager, and a like-for-like "
            "comparison needs every contender compiled (bagualu2 provisions torchtitan's compiled "
            "blocks: tests/test_torchtitan_compile.py)")}

    def recomputes_superset(self, a: str, b: str) -> bool:
        # Its default selective recompute forces the router's matmul into the recompute; FullAC on
        # a set of blocks recomputes all it does on a subset of them (by name: no torchtitan needed).
        prefix = "full AC on blocks "
        if a.startswith(prefix) and b.startswith(prefix):
            return a != b and set(a[len(prefix):].split(",")) >= set(b[len(prefix):].split(","))
        return super().recomputes_superset(a, b) or (a, b) == (self.selective, self.selective_router_saved)

    def save_checkpoint(self, run: Run, directory: str, rank: int) -> None:
        import torch.distributed.checkpoint as dcp

        try:  # torchtitan's own checkpointing is DCP (its experts are DTensors sharded over the ranks)
            dcp.save(run.model.state_dict(), checkpoint_id=os.path.join(directory, "dcp"))
        except Exception as error:  # DCP raises on every rank alike (it gathers the ranks' errors)
            self.checkpointing = (f"torch.save / torch.load of the model's state_dict (DCP failed here: "
                                  f"{type(error).__name__}: {error})")
            super().save_checkpoint(run, directory, rank)

    def load_checkpoint(self, run: Run, directory: str, rank: int) -> None:
        if not self.checkpointing.startswith("torch.distributed.checkpoint"):
            return super().load_checkpoint(run, directory, rank)
        import torch.distributed.checkpoint as dcp

        state = run.model.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))  # in place
        run.model.load_state_dict(state)

    def _build(self, ac_config: Any = None) -> torch.nn.Module:
        import torch.distributed as dist
        import torchtitan_ranks

        cfg = self.cfg
        run = torchtitan_ranks.build(
            dist.get_world_size(), ep=dist.get_world_size(), fsdp=False, layers=cfg.num_layers,
            ac_config=ac_config, experts=cfg.num_experts, top_k=cfg.top_k, vocab=cfg.vocab_size,
            dim=cfg.hidden_size, heads=cfg.num_heads, head_dim=cfg.hidden_size // cfg.num_heads,
            moe_hidden=cfg.expert_hidden_size, max_seq=max(cfg.max_seq_len, self.args.seq))
        return run.parts[0]

    def static(self, option: Any) -> Run:
        from torchtitan.distributed.activation_checkpoint import FullAC

        if not isinstance(option, tuple):  # a torchtitan activation_checkpoint config, or none
            return _TorchtitanRun(self, self._build(option))
        model = self._build()
        policy = FullAC(FullAC.Config())
        layers = model.get_submodule("layers")
        for b in option:
            # What torchtitan's apply does for every block, on the chosen ones.
            layers.register_module(str(b), policy._wrap_block(layers.get_submodule(str(b)),
                                                              base_fqn=f"layers.{b}"))
        return _TorchtitanRun(self, model)

    def provisioned(self, policy: str, budget: Optional[int], allocator: Any = None) -> Run:
        model = self._build()
        prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0, allocator=allocator,
                               **self.releases_option())
        prov.runtime.residency.reload_in_place = False  # backward copies offloads back, as on a device
        return _TorchtitanRun(self, model, prov)


__all__: List[str] = ["TorchtitanEngine"]
