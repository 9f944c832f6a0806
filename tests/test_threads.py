"""Threads: routing reports, gates and frames belong to the thread (and model) that runs them.

Two threads, each training its own enabled model, get exactly what each gets run alone: losses,
gradients, the counts each layer recorded and the micro-batches counted (docs/CONTRACTS.md,
"Threads"). One model driven from two threads at once is refused with a clear error.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer


class ReportingMoE(torch.nn.Module):
    """A MoE layer discovery does not know: it reports its routing with ``bagualu2.on_gating``.
    No random ops: the threads share torch's global RNG, which would make any run order-dependent."""

    def __init__(self, experts: int, hidden: int = 16) -> None:
        super().__init__()
        self.experts_n = experts
        self.router = torch.nn.Linear(hidden, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.router(x).argmax(-1)
        bagualu2.on_gating(torch.bincount(idx, minlength=self.experts_n), layer=0)
        h = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            h = h + expert(x * (idx == e).unsqueeze(-1)).relu()
        return self.out(h).pow(2).mean()


def _train(model: torch.nn.Module, prov: Any, inputs: List[torch.Tensor],
           barrier: Callable[[], None] = lambda: None) -> Tuple[List[torch.Tensor], List[List[torch.Tensor]]]:
    losses, grads = [], []
    for x in inputs:
        barrier()
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return losses, grads


def _record(prov: Any) -> Dict[str, Any]:
    report = prov.report()
    return {"counts": prov.mean_counts(), "sums": {k: list(v) for k, v in prov.routing.sums.items()},
            "frames": dict(prov.routing.frames), "micro_batches": report["micro_batches"],
            "resident": report["resident_bytes"], "violations": report["violations"]}


def _make(kind: str, seed: int) -> Tuple[torch.nn.Module, Any, List[torch.Tensor]]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if kind == "on_gating":
        model: torch.nn.Module = ReportingMoE(4 if seed % 2 else 8)
        inputs = [torch.randn(64, 16, generator=g) for _ in range(8)]
        prov = bagualu2.enable(model, budget=10**6, min_bytes=0, gates=[])
    else:
        cfg = MoEConfig.tiny(num_experts=4 if seed % 2 else 8)
        model = MoETransformer(cfg)
        inputs = [torch.randint(0, cfg.vocab_size, (2, 32), generator=g) for _ in range(6)]
        prov = bagualu2.enable(model, budget=None, min_bytes=0)
    return model, prov, inputs


def _compare(a: Tuple, b: Tuple) -> None:
    (la, ga), (lb, gb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(torch.equal(x, y) for gx, gy in zip(ga, gb) for x, y in zip(gx, gy))


@pytest.mark.parametrize("kind", ["on_gating", "gates"])
def test_two_threads_training_two_models_get_the_sequential_results(kind: str) -> None:
    alone = {}
    for seed in (1, 2):
        model, prov, inputs = _make(kind, seed)
        alone[seed] = (_train(model, prov, inputs), _record(prov))
    results: Dict[int, Any] = {}
    errors: List[BaseException] = []
    barrier = threading.Barrier(2)
    made = {seed: _make(kind, seed) for seed in (1, 2)}

    def run(seed: int) -> None:
        try:
            model, prov, inputs = made[seed]
            results[seed] = (_train(model, prov, inputs, lambda: barrier.wait(timeout=60)), _record(prov))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for seed in (1, 2):
        _compare(results[seed][0], alone[seed][0])
        assert results[seed][1] == alone[seed][1], seed
        experts = 4 if seed % 2 else 8
        assert all(len(v) == experts for v in results[seed][1]["counts"].values())
        assert results[seed][1]["resident"] == 0


def test_one_model_driven_from_two_threads_at_once_is_refused() -> None:
    model, prov, inputs = _make("on_gating", 2)
    entered, release = threading.Event(), threading.Event()
    original = model.out.forward

    def slow_out(x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(timeout=60)
        return original(x)

    model.out.forward = slow_out
    errors: List[BaseException] = []

    def other() -> None:
        try:
            model(inputs[0]).backward()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(timeout=60)
    try:
        with pytest.raises(RuntimeError, match="running on another thread"):
            model(inputs[1])
    finally:
        release.set()
        t.join(timeout=60)
    assert not errors, errors
    model(inputs[1]).backward()  # the other thread's forward ended: the model is whole
    assert prov.report()["resident_bytes"] == 0
