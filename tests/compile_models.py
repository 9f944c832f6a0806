"""Models and steps the torch.compile tests share (tests/test_compile*.py, benchmarks read it too).

``DenseMoE``: an MoE model written outside bagualu2's reference model, in the style of Hugging
Face routers (a module at ``layers.<i>.mlp.gate`` with ``top_k`` and ``num_experts`` returning
``(logits, weights, indices)``), whose experts run on every token weighted by the routing, so
its blocks trace with ``fullgraph=True`` (the reference model's token split is data-dependent).
"""
from __future__ import annotations

import random
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * 0.1)
        self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)  # a spike shifts it

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        logits = x @ self.weight.t()
        weights, indices = (logits + self.bias).softmax(-1).topk(self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), indices


class DenseMoEBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = nn.Linear(hidden, hidden)
        self.mlp = nn.Module()
        self.mlp.gate = Router(hidden, num_experts, top_k)
        self.mlp.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(num_experts))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(torch.tanh(self.attn(self.norm(x))))
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.mlp.gate(flat)
        dense = torch.zeros(flat.shape[0], len(self.mlp.experts), dtype=x.dtype).scatter(1, indices, weights)
        out = sum(dense[:, e:e + 1] * expert(flat) for e, expert in enumerate(self.mlp.experts))
        return x + out.reshape(x.shape)


class DenseMoE(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16, layers: int = 2, num_experts: int = 4, top_k: int = 2,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DenseMoEBlock(hidden, num_experts, top_k, dropout) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, self.vocab), tokens.reshape(-1))

    def spike(self, on: bool) -> None:
        """Route most tokens to expert 0 (on) or back to the router's own choice."""
        for layer in self.layers:
            layer.mlp.gate.bias.fill_(0.0)
            if on:
                layer.mlp.gate.bias[0] = 8.0


def reference(ep_size: int = 4, dropout: float = 0.1) -> MoETransformer:
    """The reference model (single-process view of EP rank 0 with ``ep_size``: a spike on
    expert 0 grows this rank's expert activations)."""
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(dropout=dropout, ep_size=ep_size))


def dense(**kw: Any) -> DenseMoE:
    torch.manual_seed(0)
    return DenseMoE(**kw)


def compile_model(model: nn.Module, how: str, **options: Any) -> nn.Module:
    """``how``: "blocks" (each block ``torch.compile(block)``), "method" (``block.compile()``),
    "whole" (``torch.compile(model)``)."""
    if how == "whole":
        return torch.compile(model, **options)
    for i, block in enumerate(model.layers):
        if how == "blocks":
            model.layers[i] = torch.compile(block, **options)
        else:
            block.compile(**options)
    return model


def inner(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def tokens_for(model: nn.Module, i: int, shape: Tuple[int, int] = (2, 16)) -> Tensor:
    m = inner(model)
    vocab = m.cfg.vocab_size if hasattr(m, "cfg") else m.vocab
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(100 + i))


def step(model: nn.Module, i: int, spike: bool = False) -> Tuple[Tensor, List[Tensor]]:
    """One training step's loss and gradients (seeded by ``i``: dropout replays identically)."""
    m = inner(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(i)
    if isinstance(m, DenseMoE):
        with torch.no_grad():
            m.spike(spike)
        loss = model(tokens_for(model, i))
        loss.backward()
    else:
        ctx = m.routing_spike(2.6, experts=(0,)) if spike else _null()
        with ctx:
            loss = model(tokens_for(model, i))
            loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def mismatches(a: List[Tuple[Tensor, List[Tensor]]], b: List[Tuple[Tensor, List[Tensor]]]) -> List[int]:
    """Steps whose loss or any gradient differs bit for bit."""
    return [i for i, ((la, ga), (lb, gb)) in enumerate(zip(a, b))
            if not torch.equal(la, lb) or len(ga) != len(gb) or not all(torch.equal(x, y) for x, y in zip(ga, gb))]


def random_plan(keys: List[str], seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {k: rng.choice(list(bagualu2.Choice)) for k in keys}


def run_steps(model: nn.Module, spikes: List[bool], hook: Optional[Callable[[int], None]] = None
              ) -> List[Tuple[Tensor, List[Tensor]]]:
    out = []
    for i, spike in enumerate(spikes):
        out.append(step(model, i, spike))
        if hook is not None:
            hook(i)
    return out
