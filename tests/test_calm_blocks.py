"""Trace scopes (bagualu2/runtime/calm_blocks.py): a fixed plan's traced forward traces only the
outermost blocks it may release from. Every test compares against the same model run by plain
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
from bagualu2.runtime.calm_blocks import trace_scope
from bagualu2.runtime.frame import released_modules
from bagualu2.shared import Choice

ROOT = ":aten.sin.default:0"  # the blocks' input: made outside every block, saved by the first block


class Link(torch.nn.Module):
    """``h = x @ w``, then ``h * sigmoid(h) + x`` (times ``skip`` when given); ``in_place``: doubles
    its input in place and returns a copy of it instead; ``fail`` raises halfway."""

    def __init__(self, width: int, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place
        self.fail = False
        if not in_place:
            self.w = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x: torch.Tensor, skip: Optional[torch.Tensor] = None, extra: Any = None) -> torch.Tensor:
        if self.in_place:
            return x.mul_(2) * 1.0
        h = x @ self.w
        if self.fail:
            raise RuntimeError("link failed")
        out = h * torch.sigmoid(h) + x
        return out if skip is None else out * skip


class Chain(torch.nn.Module):
    """Links in a ModuleList (the outermost blocks); block 2 also reads block 0's output."""

    def __init__(self, links: int, width: int = 16, in_place: Tuple[int, ...] = ()) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Link(width, i in in_place) for i in range(links))
        self.extra: Any = None  # passed to every block when set: an object, not a tensor or a value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sin(x)  # ROOT: the blocks' input is made inside the forward (a link writes its input)
        first = x
        for i, block in enumerate(self.blocks):
            skip = first if i == 2 else None
            x = block(x, skip, self.extra) if self.extra is not None else block(x, skip)
            if i == 0:
                first = x
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
        frame.released_modules = released_modules(plan)
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
    """A chain, its input, a runner on it (with a copy engine: ``engine``) that has run one
    frame (a traced one: the runtime has seen every block called inside a frame), and the plain
    step."""
    torch.manual_seed(0)
    model, x = Chain(links, in_place=in_place), torch.randn(8, 16)
    runner = Runner(model, CopyEngine(HostArena(16 << 20)) if engine else None)
    grads(model, runner.run(x, Frame()))
    return model, x, runner, grads(model, runner.run(x, None))


def hooked(model: Chain) -> List[bool]:
    """Which blocks carry module hooks now."""
    return [bool(b._forward_pre_hooks) for b in model.blocks]


def test_only_the_blocks_a_plan_releases_from_are_traced_and_the_step_is_exact() -> None:
    model, x, runner, reference = prepared(5, engine=True)
    plan = {"blocks.3:aten.sigmoid.default:0": Choice.RECOMPUTE, "blocks.3:aten.mm.default:0": Choice.OFFLOAD}
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 1 and hooked(model) == [False, False, False, True, False]
    assert {k.split(":")[0] for k in frame.keys_seen} == {"blocks.3"}, sorted(frame.keys_seen)
    assert frame.stats.bytes_by_choice["recompute"] > 0 and frame.stats.bytes_by_choice["offload"] > 0
    assert frame.stats.bytes_by_choice["keep"] > 0  # the untraced saves, counted by the C++ pack hook
    gc.collect()
    assert runner.runtime.ledger.resident == 0
    # Traced whole, the same plan gives the same step; the hooks go back on every block.
    whole = Frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, whole)))
    assert whole.stats.traced_blocks == 5 and hooked(model) == [True] * 5
    assert any(k.startswith("blocks.0:") for k in whole.keys_seen) and ROOT in whole.keys_seen
    # A plan releasing from every block is traced whole too: nothing to leave untraced but the
    # ops between blocks, and turning the mode on and off around each block would cost more.
    every = runner.frame({f"blocks.{i}:aten.sigmoid.default:0": Choice.RECOMPUTE for i in range(5)})
    assert_bitwise(reference, grads(model, runner.run(x, every)))
    assert every.stats.traced_blocks == 5 and ROOT in every.keys_seen


def test_a_release_outside_every_block_traces_all_but_the_blocks_it_keeps() -> None:
    model, x, runner, reference = prepared(5, engine=True)
    plan = {ROOT: Choice.OFFLOAD, "blocks.3:aten.sigmoid.default:0": Choice.RECOMPUTE}
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 1 and hooked(model) == [True] * 5  # the calm blocks' own hooks
    assert {k.split(":")[0] for k in frame.keys_seen} == {"", "blocks.3"}, sorted(frame.keys_seen)
    assert frame.stats.bytes_by_choice["offload"] > 0 and frame.stats.bytes_by_choice["recompute"] > 0


@pytest.mark.parametrize("whole", [False, True])
def test_a_traced_storage_written_in_place_untraced_is_never_rebuilt_as_it_was(whole: bool) -> None:
    """Block 1 runs untraced and doubles block 0's output in place; block 2 reads and saves it
    (as ``skip``: no anchor holds it). Rebuilt from its recipe as block 0 left it (the plan
    recomputes it), it would be half what was read. Seen by the storage's version counter as
    block 2 saves it, whether block 1 ran untraced because only the releasing blocks are traced
    or because its own hooks turned tracing off (a release outside the blocks)."""
    model, x, runner, reference = prepared(3, engine=True, in_place=(1,))
    plan = {"blocks.0:aten.add.Tensor:0": Choice.RECOMPUTE, "blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}
    if whole:
        plan[ROOT] = Choice.OFFLOAD
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 2
    why = "written in place where bagualu2 did not trace it (its version counter moved from 0 to 1)"
    assert any(f.startswith("blocks.0:aten.add.Tensor:0: recompute -> offload") and why in f
               for f in frame.stats.fallbacks), frame.stats.fallbacks


def test_a_block_called_before_its_frame_begins_leaves_the_forward_traced() -> None:
    """A pipeline's model chunks in a container's ModuleList (the outermost blocks) are called
    from outside it: each chunk's module call begins before the provisioned forward, so no
    frame ever sees it begin, and the plan's releases inside it are traced all the same."""
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.chunks = torch.nn.ModuleList([Chain(3)])
    chunk, x = root.chunks[0], torch.randn(8, 16)
    runner = Runner(root)
    reference = grads(chunk, chunk(x))
    own = chunk.forward
    frames: List[Frame] = []

    def provisioned(x: torch.Tensor) -> torch.Tensor:
        with runner.runtime.frame(frames[-1]):
            return own(x)

    chunk.forward = provisioned
    plan = {"chunks.0.blocks.1:aten.sigmoid.default:0": Choice.RECOMPUTE}
    for frame in (Frame(), runner.frame(plan), runner.frame(plan)):
        frames.append(frame)
        assert_bitwise(reference, grads(chunk, chunk(x)))
    assert frames[-1].stats.bytes_by_choice["recompute"] > 0
    assert any(k.startswith("chunks.0.blocks.0:") for k in frames[-1].keys_seen)


def test_profiled_strict_and_followed_frames_are_traced_whole() -> None:
    model, x, runner, reference = prepared(3)
    plan = {"blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}
    followed = runner.frame(plan)
    followed.on_saved.subscribe(lambda key: None)  # an overlap driver follows the first saves
    for frame in (runner.frame(plan, profile=True), runner.frame(plan, strict=True), followed):
        assert_bitwise(reference, grads(model, runner.run(x, frame)))
        assert frame.stats.traced_blocks == 3 and any(k.startswith("blocks.0:") for k in frame.keys_seen)
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 1
    # As an overlap driver follows them: from each frame's start.
    heard: List[str] = []
    follow = runner.runtime.on_frame_start.subscribe(lambda f: f.on_saved.subscribe(heard.append))
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 3 and hooked(model) == [True] * 3 and heard == list(frame.keys_seen)
    follow.unsubscribe()


def test_a_block_given_an_object_is_traced_where_blocks_are_untraced_by_their_hooks() -> None:
    """A calm block's hooks (a release outside the blocks) trace a call with an object argument
    (it could write into it unseen); with only the releasing blocks hooked, no hook sees it."""
    model, x, runner, reference = prepared(3)
    model.extra = object()
    reference = grads(model, runner.run(x, None))
    for plan, traced in (({ROOT: Choice.OFFLOAD, "blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}, 3),
                         ({"blocks.2:aten.sigmoid.default:0": Choice.RECOMPUTE}, 1)):
        frame = runner.frame(plan)
        assert_bitwise(reference, grads(model, runner.run(x, frame)))
        assert frame.stats.traced_blocks == traced


@pytest.mark.parametrize("failing", [1, 3])
@pytest.mark.parametrize("whole", [False, True])
def test_an_error_inside_a_block_leaves_the_runtime_whole(failing: int, whole: bool) -> None:
    """Block 1 runs untraced, block 3 traced; either raises."""
    model, x, runner, reference = prepared(5)
    plan = {"blocks.3:aten.sigmoid.default:0": Choice.RECOMPUTE, **({ROOT: Choice.RECOMPUTE} if whole else {})}
    model.blocks[failing].fail = True
    with pytest.raises(RuntimeError, match="link failed"):
        runner.run(x, runner.frame(plan))
    model.blocks[failing].fail = False
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    gc.collect()
    assert runner.runtime.ledger.resident == 0 and runner.runtime.active_frame is None
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 1


def test_untraced_saves_over_the_budget_are_offloaded() -> None:
    torch.manual_seed(0)
    model, x = Chain(6, width=64), torch.randn(64, 64)
    plain = Runner(model)
    reference = grads(model, plain.run(x, None))
    plan = {"blocks.5:aten.sigmoid.default:0": Choice.RECOMPUTE}
    whole = Frame(plan)
    grads(model, plain.run(x, whole))
    budget = whole.stats.peak_resident // 2
    runner = Runner(model, CopyEngine(HostArena(16 << 20)), budget_bytes=budget)
    frame = runner.frame(plan)
    assert_bitwise(reference, grads(model, runner.run(x, frame)))
    assert frame.stats.traced_blocks == 1 and frame.stats.violations == 0
    assert frame.stats.peak_resident <= budget and frame.stats.bytes_by_choice["offload"] > 0
    assert any(f.startswith("untraced save over budget") for f in frame.stats.fallbacks)


def test_a_provisioned_fixed_plan_traces_only_the_layer_it_releases_from_with_dropout() -> None:
    """The reference MoE model (dropout on, so the RNG must line up) under ``enable`` with a
    fixed plan naming the second layer's operators: after the profiled micro-batches, only that
    layer is traced, every step bit for bit plain PyTorch's."""
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
    second = [k for k in keys if k.startswith(("layers.1.", "layers.1:"))]
    assert second and model.cfg.num_layers > 1
    plan = {k: (Choice.RECOMPUTE if i % 2 else Choice.OFFLOAD) for i, k in enumerate(second)}
    prov = bagualu2.enable(model, budget=None, policy=plan, min_bytes=0)
    frames: List[Frame] = []
    prov.runtime.on_frame_end.subscribe(frames.append)
    for step in range(4):
        torch.manual_seed(step)
        a = grads(model, model(tokens))
        torch.manual_seed(step)
        assert_bitwise(grads(plain, plain(tokens)), a)
    traced = [f.stats.traced_blocks for f in frames]
    assert traced == [model.cfg.num_layers if f.profile else 1 for f in frames] and not frames[-1].profile, traced
    assert all(k.startswith(("layers.1.", "layers.1:")) for k in frames[-1].keys_seen)
    assert frames[-1].stats.bytes_by_choice["recompute"] > 0


_PATHS = ["", "a", "a.b", "a.b.c", "a.bc", "ab", "x.0", "x.0.y", "x.1", "x.10"]


@settings(max_examples=200, deadline=None)
@given(released=st.sets(st.sampled_from(_PATHS), max_size=5), outermost=st.sets(st.sampled_from(_PATHS[1:]), max_size=4),
       unframed=st.sets(st.sampled_from(_PATHS[1:]), max_size=2))
def test_a_trace_scope_is_the_outermost_blocks_holding_a_released_module(released: set, outermost: set,
                                                                         unframed: set) -> None:
    outermost = {p for p in outermost if not any(p.startswith(q + ".") for q in outermost)}  # none nested
    scope = trace_scope(released, outermost, outermost - unframed)
    holders = [[b for b in outermost if p == b or p.startswith(b + ".")] for p in released]
    assert scope.blocks == {b for h in holders for b in h}
    # Traced whole but for the blocks holding none: a released module outside every block, or
    # in one not seen called inside a frame.
    assert scope.whole == any(not h or h[0] in unframed for h in holders)


@settings(max_examples=100, deadline=None)
@given(entries=st.lists(st.tuples(st.sampled_from(_PATHS), st.sampled_from(["", "#1"]),
                                  st.sampled_from(["aten.mm.default:0", "aten.split.Tensor:0.1", "compiled"]),
                                  st.sampled_from(list(Choice))), max_size=8),
       default=st.sampled_from(list(Choice)))
def test_released_modules_are_the_modules_of_the_released_operators(entries: list, default: Choice) -> None:
    plan = {f"{path}{call}:{op}": choice for path, call, op, choice in entries}
    got = released_modules(plan, default)
    if default != Choice.KEEP:
        assert got is None
    else:
        assert got == {key.partition(":")[0].partition("#")[0] for key, c in plan.items() if c != Choice.KEEP}
