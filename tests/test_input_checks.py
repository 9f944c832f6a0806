"""Every public input is checked where it enters: the error names the argument, the gate or the
callback, and the bad value (docs/CONTRACTS.md)."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.plan.planner import Choice, Plan

BATCH = (2, 32)


def make_model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(dropout=0.1))


def tokens_for(model: MoETransformer, i: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, model.cfg.vocab_size, BATCH, generator=g)


class Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class TinyMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x * (idx == e).unsqueeze(-1))
        return out.pow(2).mean()


@pytest.mark.parametrize("result, error, match", [
    (None, TypeError, r"counts_fn of gate 'router' \(layer 0\) returned None"),
    (torch.tensor([1, 2, 3]), ValueError, r"returned 3 counts \[1, 2, 3\], the gate has 4 experts"),
    (torch.ones(2, 4, dtype=torch.long), ValueError, r"shape \(2, 4\)"),
    (torch.tensor([-1, 2, 3, 4]), ValueError, r"negative count \(-1\)"),
    (torch.tensor([1.0, 2.0, 3.0, 4.0]), TypeError, "torch.float32 tensor"),
    (torch.tensor([float("nan"), 2.0, 3.0, 4.0]), TypeError, "must be integers"),
    ([1.5, 2, 3, 4], TypeError, "got 1.5"),
    ([[1, 2], [3, 4]], TypeError, r"got \[1, 2\]"),
    (torch.tensor([10**12, 0, 0, 0]), ValueError, "1000000000000 token slots in all.*more than the 64"),
])
def test_a_bad_counts_fn_result_names_the_gate_and_the_value(result: Any, error: type, match: str) -> None:
    model = TinyMoE()
    prov = bagualu2.enable(model, budget=10**6, min_bytes=0, gates=[])
    spec = prov.register_gate(model.router, num_experts=4, counts_fn=lambda m, a, out: result)
    spec.top_k = 1  # what the gate's tokens bound the counts by
    with pytest.raises(error, match=match):
        model(torch.randn(64, 16))


@pytest.mark.parametrize("counts, layer, error, match", [
    ([1, -2], 0, ValueError, r"on_gating\(layer=0\) returned a negative count"),
    (torch.tensor([0.5, 1.0]), 0, TypeError, r"on_gating\(layer=0\).*float32"),
    (None, 0, TypeError, r"on_gating\(layer=0\) returned None"),
    ([1, 2], "0", TypeError, r"on_gating\(layer='0'\)"),
])
def test_bad_routing_reports_name_the_call_and_the_value(counts: Any, layer: Any, error: type, match: str) -> None:
    class Reporting(TinyMoE):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bagualu2.on_gating(counts, layer=layer)
            return super().forward(x)

    model = Reporting()
    bagualu2.enable(model, budget=10**6, min_bytes=0, gates=[])
    with pytest.raises(error, match=match):
        model(torch.randn(64, 16))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(policy=None), TypeError, "policy=None"),
    (dict(policy=3), TypeError, "policy=3"),
    (dict(profile_frames=1.5), TypeError, "profile_frames=1.5 must be an int"),
    (dict(profile_frames="2"), TypeError, "profile_frames='2'"),
    (dict(calibrate_frames=True), TypeError, "calibrate_frames=True"),
    (dict(min_bytes=-1), ValueError, "min_bytes=-1"),
    (dict(reserve_bytes=-1), ValueError, "reserve_bytes=-1"),
    (dict(arena_bytes=0), ValueError, "arena_bytes=0"),
    (dict(arena_bytes=1 << 20, arena_max_bytes=1 << 10), ValueError, "arena_max_bytes=1024 must be >= arena_bytes"),
    (dict(margin="x"), ValueError, "margin='x'"),
    (dict(budget=-5), ValueError, "budget=-5"),
])
def test_bad_options_name_the_argument_and_the_value(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        bagualu2.enable(make_model(), **kwargs)


@pytest.mark.parametrize("plan, error, match", [
    ({"layers.0.atn:aten.mm.default:0": Choice.KEEP}, ValueError, r"no module 'layers.0.atn' \(did you mean 'layers.0.attn'\?\)"),
    ({"layers.0.attn:aten.mmm.default:0": Choice.KEEP}, ValueError, "'aten.mmm.default' is not an op"),
    ({"recompute everything": Choice.RECOMPUTE}, ValueError, "is not an operator key"),
    ({"layers.0.attn:aten.mm.default:0": "recompute"}, TypeError, "'recompute' is not a bagualu2.Choice"),
    ({"layers.0.attn:aten.mm.default:0": 2}, TypeError, "2 is not a bagualu2.Choice"),
])
def test_a_bad_fixed_plan_names_the_key_or_the_choice(plan: dict, error: type, match: str) -> None:
    model = make_model()
    with pytest.raises(error, match=match):
        bagualu2.enable(model, budget=None, policy=plan)
    # refused before anything was put on the model: it is plain, and can be enabled
    assert "forward" not in model.__dict__
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    bagualu2.enable(model, budget=None).disable()
    with pytest.raises(error, match=match):
        bagualu2.enable(make_model(), budget=None, policy=Plan(plan) if error is ValueError else plan)


def test_a_plan_from_the_model_s_own_keys_is_accepted() -> None:
    model = make_model()
    prov = bagualu2.enable(model, budget=None, policy={})
    model(tokens_for(model)).backward()
    keys = list(prov.cost.order)
    prov.disable()
    bagualu2.enable(make_model(), budget=None, policy={k: Choice.RECOMPUTE for k in keys})


def test_a_meta_or_lazy_model_is_refused_before_anything_is_allocated() -> None:
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="weight is on the meta device"):
        bagualu2.enable(meta, budget=None)
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4))
    with pytest.raises(ValueError, match="0.weight is uninitialized"):
        bagualu2.enable(lazy, budget=None)


def test_eval_mode_with_grad_enabled_is_told_as_what_it_is() -> None:
    """A forward in eval mode with grad on runs other ops (no dropout): the warning said "a loop
    that stops early"; it says that eval mode changed the forward."""
    model = make_model()
    prov = bagualu2.enable(model, budget=None, policy={})
    for i in range(prov.profile_frames):
        model(tokens_for(model, i)).backward()
    # A plan that releases an op of every layer: their forwards are traced (a fixed plan's
    # forwards trace only the blocks it releases from).
    first = {k.split(":")[0].split(".")[1]: k for k in reversed(prov.cost.order) if k.startswith("layers.")}
    prov.policy = dict.fromkeys(first.values(), Choice.OFFLOAD)
    model.eval()
    with pytest.warns(UserWarning, match="ran in eval mode with grad enabled.*eval mode changed what the forward does"):
        model(tokens_for(model, 5)).backward()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(tokens_for(model, 6)).backward()
