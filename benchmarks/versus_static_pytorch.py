"""The plain PyTorch engine of benchmarks/versus_static.py: the reference MoE model with
``torch.utils.checkpoint`` on every subset of blocks, and torch's selective checkpointing with
op-list policies."""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
from typing import Any, Dict, FrozenSet, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import bagualu2
from bagualu2.models import MoETransformer
from versus_static import KEEP, SEED, Engine, Run, Trace, _tokens


class _PyTorchRun(Run):
    def __init__(self, model: MoETransformer, args: argparse.Namespace, prov: Any = None) -> None:
        self.model, self.args, self.prov = model, args, prov

    def step(self, rank: int, trace: Trace, i: int) -> float:
        model = self.model
        expert, imbalance = trace.load(i)
        spike = model.routing_spike(imbalance, experts=[expert]) if expert is not None \
            else contextlib.nullcontext()
        model.zero_grad(set_to_none=True)
        with spike:  # backward inside: checkpointed blocks rerun the router
            loss = model(_tokens(model.cfg.vocab_size, rank, i, self.args.batch, self.args.seq))
            loss.backward()
        if self.prov is not None:
            self.prov.step()
        return float(loss.detach())


_MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
_ATTENTION = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default)


class PyTorchEngine(Engine):
    """Plain PyTorch on the reference model: ``torch.utils.checkpoint`` (non-reentrant) on every
    subset of blocks, and selective checkpointing of every block with op-list policies (what is
    saved; the rest is recomputed)."""

    name = "pytorch"
    process_modules = ("torch.distributed", "bagualu2.models")  # the reference model's module

    @property
    def full(self) -> str:  # type: ignore[override]
        return f"checkpoint blocks {','.join(map(str, range(self.args.layers)))}"

    def grid(self) -> Dict[str, Any]:
        layers = self.args.layers
        grid: Dict[str, Any] = {}
        for k in range(1, layers + 1):
            for blocks in itertools.combinations(range(layers), k):
                grid[f"checkpoint blocks {','.join(map(str, blocks))}"] = (blocks, None)
        everything = tuple(range(layers))
        grid["selective: save matmuls"] = (everything, _MM)
        grid["selective: save matmuls + attention"] = (everything, _MM + _ATTENTION)
        grid["selective: save attention"] = (everything, _ATTENTION)
        return grid

    def _recomputed(self, name: str) -> Tuple[FrozenSet[int], FrozenSet[Any]]:
        """The blocks an option checkpoints and the ops it saves in them (the rest recomputed)."""
        blocks, saved = ((), None) if name == KEEP else self.grid()[name]
        return frozenset(blocks), frozenset(saved or ())

    def recomputes_superset(self, a: str, b: str) -> bool:
        # In every block ``b`` checkpoints, ``a`` checkpoints it too and saves no op ``b`` does not:
        # "checkpoint blocks 0,1" over "checkpoint blocks 0", a whole block over any op list, "save
        # matmuls" over "save matmuls + attention".
        (blocks_a, saved_a), (blocks_b, saved_b) = self._recomputed(a), self._recomputed(b)
        return a != b and blocks_a >= blocks_b and (not blocks_b or saved_a <= saved_b)

    def _model(self) -> MoETransformer:
        torch.manual_seed(SEED)
        return MoETransformer(self.cfg, ep_group=dist.group.WORLD)

    def static(self, option: Any) -> Run:
        model = self._model()
        blocks, saved = option or ((), None)
        extra = {} if saved is None else {
            "context_fn": functools.partial(create_selective_checkpoint_contexts, list(saved))}
        for b in blocks:
            layer = model.layers[b]
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, **extra)
        return _PyTorchRun(model, self.args)

    def provisioned(self, policy: str, budget: Optional[int], allocator: Any = None) -> Run:
        model = self._model()
        prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0, allocator=allocator,
                               **self.releases_option())
        prov.runtime.residency.reload_in_place = False  # backward copies offloads back, as on a device
        return _PyTorchRun(model, self.args, prov)
