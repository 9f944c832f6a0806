"""Block reruns (bagualu2/provision/block_reruns.py, ``enable(releases="reruns")``): under a budget
its saves would not fit, an adaptive micro-batch reruns whole blocks in backward instead of
being traced, and is exact, under the budget through backward.
Every model test compares against the same model run by plain PyTorch, bit for bit."""
from __future__ import annotations

import copy
import math
from typing import Any, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.provision.block_reruns import cheapest


def _step(model: torch.nn.Module, i: int, spike: float = 0.0) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    g = torch.Generator().manual_seed(7 + i)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=g)
    model.zero_grad(set_to_none=True)
    if spike:
        with model.routing_spike(spike, experts=[0]):
            loss = model(tokens)
            loss.backward()
    else:
        loss = model(tokens)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _keep_all_peak(model: MoETransformer) -> int:
    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    _step(probe, 0)
    return prov.report()["peak_bytes"]


def test_a_tight_budget_reruns_layers_untraced_and_is_exact() -> None:
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(num_layers=3))
    plain = copy.deepcopy(model)
    budget = int(_keep_all_peak(model) * 0.6)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)  # releases="reruns", the default
    for i, spike in enumerate([0, 0, 0, 0, 2.6, 0, 0]):
        ref, got = _step(plain, i, spike), _step(model, i, spike)
        assert torch.equal(ref[0], got[0]), f"loss differs at micro-batch {i}"
        assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1])), f"a gradient differs at micro-batch {i}"
    after = prov.telemetry.micro_batches[prov.profile_frames:]
    assert not any(m.traced for m in after), "a micro-batch after profiling was traced"
    assert all(m.bytes_by_choice["recompute"] > 0 for m in after), "a micro-batch released nothing by rerun"
    report = prov.report()
    assert report["violations"] == 0 and report["peak_bytes"] <= budget
    assert set(prov.runtime.rerunnable_blocks()) == {"layers.0", "layers.1", "layers.2"}


def test_a_block_whose_rerun_would_not_fit_is_not_rerun_and_backward_holds_the_budget() -> None:
    """Under 45% of a spike's keep-all peak, one layer's saves alone nearly fill the budget:
    backward rebuilding one would cross it beside what the forward kept before it, so such a
    layer is not rerun, the overflow is offloaded instead, and the ledger holds through
    backward (it crossed in backward before reruns were held to ``rerun_peaks``)."""
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(dropout=0.1, ep_size=4))
    probe = copy.deepcopy(model)
    keep = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    _step(probe, 0, spike=2.6)
    budget = int(keep.report()["peak_bytes"] * 0.45)
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)  # releases="reruns", the default
    for i in range(4):
        torch.manual_seed(i)  # the same dropout masks for both
        ref = _step(plain, i)
        torch.manual_seed(i)
        got = _step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
        assert prov.runtime.ledger.peak <= budget, f"micro-batch {i} crossed the budget in backward"
    room = prov.limits.target() - prov.footprint.outside_held
    peaks = prov.reruns.rerun_peaks(prov.runtime.rerunnable_blocks(), (), prov.routing.counts,
                                    prov.runtime.block_outputs)
    assert any(peak > room for peak in peaks.values()), "every layer's rerun fits: the case is not tested"
    assert prov.telemetry.micro_batches[-1].bytes_by_choice["offload"] > 0


def test_a_releases_option_that_is_not_one_names_the_two() -> None:
    with pytest.raises(ValueError, match="releases='blocks'.*'reruns'.*'operators'"):
        bagualu2.enable(MoETransformer(MoEConfig.tiny()), budget=1 << 20, releases="blocks")


class Inner(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * x


class Counted(torch.nn.Module):
    """A block that counts its calls in a buffer (an effect a rerun would repeat) and runs its
    two inner blocks, which a rerun may repeat."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.ModuleList(Inner(width) for _ in range(2))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        for layer in self.inner:
            x = layer(x)
        return x


class Stack(torch.nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Counted(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_block_with_an_effect_is_not_rerun_its_inner_blocks_are() -> None:
    torch.manual_seed(0)
    model = Stack()
    plain = copy.deepcopy(model)
    x = torch.randn(256, 64)
    probe = copy.deepcopy(model)
    keep = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    probe(x).backward()
    prov = bagualu2.enable(model, budget=int(keep.report()["peak_bytes"] * 0.6), min_bytes=0, gates=[],
                           releases="reruns")
    for i in range(6):
        xi = x * (1 + i)
        ref, got = plain(xi), model(xi)
        ref.backward()
        got.backward()
        assert torch.equal(ref, got)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), model.buffers())), "a rerun counted again"
        plain.zero_grad()
        model.zero_grad()
    rerunnable = prov.runtime.rerunnable_blocks()
    assert rerunnable and all(".inner." in b for b in rerunnable)
    assert sum(m.bytes_by_choice["recompute"] for m in prov.telemetry.micro_batches[prov.profile_frames:]) > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), st.floats(0.001, 1.0)), min_size=1, max_size=8),
       st.integers(1, 900), st.sampled_from([0.0, 0.001, 0.01, math.inf]))
def test_the_reruns_are_the_first_blocks_and_the_cheapest_such_choice(blocks: List[Tuple[int, float]], need: int,
                                                                      per_byte: float) -> None:
    names = [f"b{i}" for i in range(len(blocks))]
    sizes = dict(zip(names, blocks))
    order = [b for b in names if sizes[b][0] > 0]

    def offload(n: int) -> float:
        return 0.0 if n <= 0 else n * per_byte

    def cost(chosen: Any) -> Tuple[int, float]:
        rest = max(0, need - sum(sizes[b][0] for b in chosen))
        seconds = sum(sizes[b][1] for b in chosen)
        return (rest, seconds) if math.isinf(offload(rest)) else (0, seconds + offload(rest))

    chosen = cheapest(need, sizes, names, offload)
    k = len(chosen)
    assert chosen == frozenset(order[:k]), "not the first blocks"
    # no other number of first blocks is cheaper (seconds summed in another order: a tolerance)
    best = min(cost(order[:j]) for j in range(len(order) + 1))
    assert cost(chosen)[0] == best[0] and cost(chosen)[1] <= best[1] + 1e-9
    if math.isinf(per_byte):
        assert sum(sizes[b][0] for b in chosen) >= min(need, sum(n for n, _ in blocks))
