"""Calm blocks (bagualu2/runtime/calm_blocks.py): a traced frame runs the outermost blocks its
plan releases nothing from untraced. Every test compares against the same model run by plain
PyTorch, bit for bit."""
from __future__ import annotations

import copy
import gc
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.offload import CopyEngine, HostArena
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.runtime.frame import releasing
from bagualu2.shared import Choice


class Link(torch.nn.Module):
    """``x @ w``, then ``h * sigmoid(h) + x``; ``in_place``: doubles its input in place and returns
    it instead; ``fail`` raises halfway."""

    def __init__(self, width: int, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place
        if not in_place:
            self.w = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.fail = False

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        if self.in_place:
            return x.mul_(2)
        h = x @ self.w
        if self.fail:
            raise RuntimeError("link failed")
        return h * torch.sigmoid(h) + x


class Chain(torch.nn.Module):
    def __init__(self, links: int, width: int = 16, in_place: Tuple[int, ...] = ()) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Link(width, i in in_place) for i in range(links))
        self.extra: Any = None  # passed to every block: an object, not a tensor or a plain value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # the blocks' input is made inside the forward (a link writes its input)
        first = x
        for i, block in enumerate(self.blocks):
            x = block(x, self.extra) if self.extra is not None else block(x)
            if i == 0:
                first = x
            elif i == 1:  # outside every block: saves the first block's output as it is now
                x = x * first
        return x.square().sum()


def grads(model: torch.nn.Module, loss: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def assert_bitwise(a: Tuple[torch.Tensor, List[torch.Tensor]], b: Tuple[torch.Tensor, List[torch.Tensor]]) -> None:
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert torch.equal(x, y), f"gradient {i} differs by {(x - y).abs().max().item()}"


class Runner:
    """One runtime attached to ``model``, running frames of a fixed plan."""

    def __init__(self, model: torch.nn.Module, engine: Optional[CopyEngine] = None, **kwargs: Any) -> None:
        self.model = model
        self.runtime = ActivationRuntime(engine, reload_in_place=False, **kwargs)
        self.runtime.residency.set_parameters(list(model.parameters()))
        self.hooks = self.runtime.attach(model)

    def frame(self, plan: Dict[str, Choice], **flags: Any) -> Frame:
        frame = Frame(plan)
        frame.releasing_modules = releasing(plan)
        for name, value in flags.items():
            setattr(frame, name, value)
        return frame

    def run(self, x: torch.Tensor, frame: Optional[Frame]) -> torch.Tensor:
        if frame is None:
            return self.model(x)
        with self.runtime.frame(frame):
            return self.model(x)


def prepared(links: int, engine: bool = False, in_place: Tuple[int, ...] = ()
             ) -> Tuple[Chain, torch.Tensor, Runner, Tuple[torch.Tensor, List[torch.Tensor]]]:
    """A chain, its input, a runner on it (with a copy engine: ``engine``) and the plain step."""
    torch.manual_seed(0)
    model, x = Chain(links, in_place=in_place), torch.randn(8, 16)
    runner = Runner(model, CopyEngine(HostArena(16 << 20)) if engine else None)
    return model, x, runner, grads(model, runner.run(x, None))


def test_blocks_the_plan_keeps_run_untraced_and_the_step_is_exact() -> None:
    model, x, runner, reference = prepared(5, engine=True)
    plan = {"blocks.3:aten.sigmoid.default:0": Choice.RECOMPUTE, "blocks.3:aten.mm.default:0": Choice.OFFLOAD}
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.calm_blocks == 4
    assert {k.split(":")[0] for k in frame.keys_seen} <= {"", "blocks.3"}, sorted(frame.keys_seen)
    assert frame.stats.bytes_by_choice["recompute"] > 0 and frame.stats.bytes_by_choice["offload"] > 0
    # The calm blocks' saves were counted and given back like a traced block's.
    assert frame.stats.bytes_by_choice["keep"] > 0
    gc.collect()
    assert runner.runtime.ledger.resident == 0
    # Traced whole, the same plan gives the same step.
    whole = Frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, whole)))
    assert whole.stats.calm_blocks == 0 and any(k.startswith("blocks.0:") for k in whole.keys_seen)


def test_a_traced_storage_a_calm_block_writes_in_place_is_never_rebuilt_as_it_was() -> None:
    """Block 1 runs calm and doubles its input, block 0's output, in place; the forward saves it
    after block 1, outside every block (no anchor holds it). Rebuilt from its recipe as block 0
    left it (the plan recomputes it), it would be half what was read."""
    model, x, runner, reference = prepared(3, engine=True, in_place=(1,))
    plan = {"blocks.0:aten.add.Tensor:0": Choice.RECOMPUTE, "blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.calm_blocks == 1
    # The save of the written storage fell back from its plan's recompute: a replay would
    # rebuild it unwritten.
    assert any(f.startswith("blocks.0:aten.add.Tensor:0: recompute -> offload") and "blocks.1 wrote it in place" in f
               for f in frame.stats.fallbacks), frame.stats.fallbacks


def test_profiled_strict_and_followed_frames_and_blocks_given_objects_are_traced_whole() -> None:
    model, x, runner, reference = prepared(3)
    plan = {"blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}
    followed = runner.frame(plan)
    followed.on_saved.subscribe(lambda key: None)  # an overlap driver follows the first saves
    for frame in (runner.frame(plan, profile=True), runner.frame(plan, strict=True), followed):
        assert_bitwise(reference, grads(model, runner.run(x, frame)))
        assert frame.stats.calm_blocks == 0 and any(k.startswith("blocks.0:") for k in frame.keys_seen)
    model.extra = object()  # a block called with an object it could write into unseen
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.calm_blocks == 0
    model.extra = None
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.calm_blocks == 2


def test_an_error_inside_a_calm_block_leaves_the_runtime_whole() -> None:
    model, x, runner, reference = prepared(3)
    plan = {"blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}
    model.blocks[1].fail = True
    with pytest.raises(RuntimeError, match="link failed"):
        runner.run(x, runner.frame(plan))
    model.blocks[1].fail = False
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    gc.collect()
    assert runner.runtime.ledger.resident == 0 and runner.runtime.active_frame is None
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.calm_blocks == 2


def test_a_calm_blocks_saves_over_the_budget_are_offloaded() -> None:
    torch.manual_seed(0)
    model, x = Chain(6, width=64), torch.randn(64, 64)
    plain = Runner(model)
    reference = grads(model, plain.run(x, None))
    plan = {"blocks.5:aten.sigmoid.default:0": Choice.RECOMPUTE}
    whole = plain.frame(plan)
    grads(model, plain.run(x, whole))
    budget = whole.stats.peak_resident // 2
    runner = Runner(model, CopyEngine(HostArena(16 << 20)), budget_bytes=budget)
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.calm_blocks == 5 and frame.stats.violations == 0
    assert frame.stats.peak_resident <= budget and frame.stats.bytes_by_choice["offload"] > 0
    assert any(f.startswith("untraced save over budget") for f in frame.stats.fallbacks)


def test_a_provisioned_fixed_plan_runs_its_kept_blocks_calm_with_dropout() -> None:
    """The reference MoE model (dropout on, so the RNG must line up) under ``enable`` with a
    fixed plan naming the second layer's operators: after the profiled micro-batches, the first
    layer runs calm, every step bit for bit plain PyTorch's."""
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(dropout=0.1))
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24))
    probe = copy.deepcopy(model)
    keys: List[str] = []
    prov = bagualu2.enable(probe, budget=None, policy={})
    prov.runtime.on_frame_end.subscribe(lambda f: keys.extend(f.keys_seen))
    probe(tokens).backward()
    prov.disable()
    second = [k for k in keys if k.startswith("layers.1.")]
    assert second
    plan = {k: (Choice.RECOMPUTE if i % 2 else Choice.OFFLOAD) for i, k in enumerate(second)}
    prov = bagualu2.enable(model, budget=None, policy=plan, min_bytes=0)
    frames: List[Frame] = []
    prov.runtime.on_frame_end.subscribe(frames.append)
    for step in range(4):
        torch.manual_seed(step)
        a = grads(model, model(tokens))
        torch.manual_seed(step)
        assert_bitwise(grads(plain, plain(tokens)), a)
    calm = [f.stats.calm_blocks for f in frames]
    assert calm[-1] == 1 and calm == [0 if f.profile else 1 for f in frames], calm
    assert not any(k.startswith("layers.0.") for k in frames[-1].keys_seen)
    assert frames[-1].stats.bytes_by_choice["recompute"] > 0


_PATHS = ["", "a", "a.b", "a.b.c", "a.bc", "ab", "x.0", "x.0.y", "x.1"]
_OPS = ["aten.mm.default:0", "aten.add.Tensor:1", "aten.split.Tensor:0.1", "compiled"]


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(st.tuples(st.sampled_from(_PATHS), st.sampled_from(["", "#1"]), st.sampled_from(_OPS),
                                  st.sampled_from(list(Choice))), max_size=8),
       default=st.sampled_from(list(Choice)))
def test_releasing_names_exactly_the_modules_at_or_above_a_released_operator(entries: list, default: Choice) -> None:
    plan = {f"{path}{call}:{op}": choice for path, call, op, choice in entries}
    got = releasing(plan, default)
    if default != Choice.KEEP:
        assert got is None
        return
    released = [key.partition(":")[0].partition("#")[0] for key, c in plan.items() if c != Choice.KEEP]
    for path in _PATHS:
        under = any(r == path or r.startswith(path + ".") or not path for r in released)
        assert (path in got) == under, (path, plan, got)
