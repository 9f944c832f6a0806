"""Exactness against aliasing (invariant 1): a rebuild never reproduces a storage state that a
later read did not see, whoever wrote the storage and through whichever tensor.

The models here stash aliases of their activations (views, ``detach()``, module attributes,
buffers, closures, containers), write them in place traced and untraced, with and without grad,
and read them in later blocks. Every step is compared bit for bit with the same model run by
plain PyTorch: loss and every gradient. The adversary at the end generates such models and runs
them under every policy, random fixed plans and adaptive under a tight budget, eager (with every
block compiled: tests/test_compile.py, whose process is its own in CI).
"""
from __future__ import annotations

import copy
import gc
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.shared import Choice

B, W = 4, 16

# -- the generated models ---------------------------------------------------------------------
# An action of a block, applied to its running activation ``x``:
#   ("lin", act)                 x = act(x @ w) + x                       (saves)
#   ("stash", slot, alias, main) slot <- an alias of x (main) or of x * 1.0 (no op on x)
#   ("write", slot, how, grad)   the slot's tensor written in place       (under no_grad unless grad)
#   ("read", slot, how)          x = x * slot's tensor, or x + slot @ w    (saves the alias)
#                                or x + slot's tensor ("add": saves nothing of it)
#   ("inplace", grad)            x written in place                        (under no_grad unless grad)
SLOTS = ("attr", "dict", "closure", "buffer")
ALIASES = ("view", "detach", "whole", "reshape", "half")
ACTS = ("sigmoid", "tanh", "gelu")


class Block(torch.nn.Module):
    """A block of actions. Each block stashes into slots of its own (its attribute ``kept``, its
    buffer ``stashed``, its entries in the root's dict and closure) and reads and writes the
    latest stash of the blocks before it: what a block reads depends on earlier blocks only, as
    in a model that hands tensors forward (a rerun of the block in backward reads the same)."""

    def __init__(self, actions: Sequence[tuple], root: "Program", index: int) -> None:
        super().__init__()
        self.actions = list(actions)
        self.index = index
        self.w = torch.nn.Parameter(torch.randn(W, W) / W ** 0.5)
        self.v = torch.nn.Parameter(torch.randn(W, W) / W ** 0.5)
        self._root = [root]  # not a submodule: the blocks share the root's slots
        self.register_buffer("stashed", None, persistent=False)
        self.kept: Optional[torch.Tensor] = None

    def _slot(self, slot: str, j: int) -> Optional[torch.Tensor]:
        root = self._root[0]
        if slot == "attr":
            return root.blocks[j].kept
        if slot == "buffer":
            return root.blocks[j].stashed
        return (root.slots if slot == "dict" else root.closure).get(j)

    def _get(self, slot: str) -> Optional[torch.Tensor]:
        return next((t for t in (self._slot(slot, j) for j in reversed(range(self.index))) if t is not None), None)

    def _set(self, slot: str, t: torch.Tensor) -> None:
        root = self._root[0]
        if slot == "attr":
            self.kept = t
        elif slot == "buffer":
            self.stashed = t
        else:
            (root.slots if slot == "dict" else root.closure)[self.index] = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for action in self.actions:
            kind = action[0]
            if kind == "lin":
                x = getattr(torch.nn.functional, action[1])(x @ self.w) + x
            elif kind == "stash":
                # A storage of the block's own (made by a traced op when the block is traced),
                # which nothing but the slot holds (``x * 1.0`` saves neither operand), or the
                # running activation itself (``main``), which later ops save.
                s = x if action[3] else x * 1.0
                t = {"view": lambda: s[:], "detach": lambda: s.detach(), "whole": lambda: s,
                     "reshape": lambda: s.view(-1).view(B, W), "half": lambda: s[:, : W // 2]}[action[2]]()
                self._set(action[1], t)
            elif kind == "write":
                t = self._get(action[1])
                if t is None or self._root[0].writes_from > self._root[0].steps:
                    continue
                with torch.set_grad_enabled(action[3] and torch.is_grad_enabled()):
                    {"mul": lambda: t.mul_(1.5), "add": lambda: t.add_(0.25),
                     "part": lambda: t[..., :2].add_(1.0)}[action[2]]()
            elif kind == "read":
                t = self._get(action[1])
                if t is None:
                    continue
                if t.shape[-1] != W:
                    t = torch.cat([t, t], dim=-1)
                x = x * t if action[2] == "mul" else x + t if action[2] == "add" else x + t @ self.v
            elif kind == "inplace":
                x = x * 1.0
                with torch.set_grad_enabled(action[1] and torch.is_grad_enabled()):
                    x.mul_(0.75)
        return x


class Program(torch.nn.Module):
    def __init__(self, blocks: Sequence[Sequence[tuple]]) -> None:
        super().__init__()
        self.slots: Dict[int, torch.Tensor] = {}
        self.closure: Dict[int, torch.Tensor] = {}
        self.steps = 0  # forwards run so far
        self.writes_from = 0  # the first forward whose "write" actions run (a write that starts late)
        self.blocks = torch.nn.ModuleList()
        for i, actions in enumerate(blocks):
            self.blocks.append(Block(actions, self, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.slots.clear()
        self.closure.clear()
        for block in self.blocks:
            block.kept = block.stashed = None
        x = torch.sin(x)
        for block in self.blocks:
            x = block(x)
        self.steps += 1
        return x.square().mean()


def step(model: torch.nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() if p.grad is not None else torch.zeros(()) for p in model.parameters()]


def assert_bitwise(a: Tuple[torch.Tensor, List[torch.Tensor]], b: Tuple[torch.Tensor, List[torch.Tensor]],
                   what: str) -> None:
    assert torch.equal(a[0], b[0]), f"{what}: loss {a[0].item()} != {b[0].item()}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert torch.equal(x, y), f"{what}: gradient {i} differs by {(x - y).abs().max().item()}"


def keys_of(model: torch.nn.Module, x: torch.Tensor) -> Tuple[List[str], int]:
    """The operator keys a traced forward of a copy of ``model`` saves, and its keep-all peak."""
    probe = copy.deepcopy(model)
    seen: List[str] = []
    prov = bagualu2.enable(probe, budget=None, policy={}, gates=[])
    prov.runtime.on_frame_end.subscribe(lambda f: seen.extend(k for k in f.keys_seen if k not in seen))
    step(probe, x)
    peak = prov.report()["peak_bytes"]
    prov.disable()
    return seen, peak


def run_against_plain(model: torch.nn.Module, x: torch.Tensor, policy: Any, *, steps: int = 4,
                      budget: Optional[int] = None, compile_blocks: bool = False, **options: Any
                      ) -> bagualu2.Provisioner:
    """``steps`` steps of ``model`` under bagualu2 (``policy``), each compared with a plain copy's."""
    plain = copy.deepcopy(model)
    if compile_blocks:
        for m in (model, plain):
            for block in m.blocks:
                block.compile(backend="eager")
    reference = step(plain, x)
    prov = bagualu2.enable(model, budget=budget, policy=policy, gates=[], min_bytes=0, **options)
    try:
        for i in range(steps):
            if i:
                reference = step(plain, x)
            assert_bitwise(reference, step(model, x), f"step {i} under {policy!r}")
    finally:
        prov.disable()
    return prov


def the_issue_model(slot: str, alias: str) -> Program:
    """Block 0 stashes an alias of an activation it made; block 1 (the plan releases nothing
    from it) writes it in place under no_grad after block 0's output is gone; block 2 reads it
    and saves it."""
    torch.manual_seed(0)
    return Program([
        [("lin", "sigmoid"), ("stash", slot, alias, False), ("lin", "tanh")],
        [("lin", "gelu"), ("write", slot, "mul", False), ("lin", "sigmoid")],
        [("read", slot, "mul"), ("lin", "tanh"), ("read", slot, "mm")],
    ])


def run_plan_against_plain(model: Program, x: torch.Tensor, released: Tuple[str, ...], steps: int
                           ) -> Tuple[bagualu2.Provisioner, List[Any]]:
    """``steps`` steps of ``model`` under a fixed plan recomputing every key of the blocks
    ``released`` names, each compared with a plain copy's; the provisioner and its frames."""
    keys, _ = keys_of(model, x)
    plan = {k: Choice.RECOMPUTE for k in keys if k.startswith(released)}
    frames: List[Any] = []
    model.steps = 0
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy=plan, gates=[], min_bytes=0)
    prov.runtime.on_frame_end.subscribe(frames.append)
    for i in range(steps):
        assert_bitwise(step(plain, x), step(model, x), f"step {i}")
    prov.disable()
    return prov, frames


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("slot", SLOTS)
def test_an_alias_written_untraced_in_a_kept_block_is_never_rebuilt_as_it_was(slot: str, alias: str) -> None:
    """A fixed plan recomputing blocks 0 and 2 traces only those blocks from the third step on.
    Block 1 starts writing only then (had a traced forward seen it write across blocks, every
    forward would be traced whole): the write is seen through the storage's version counter as
    block 2 reads it, so what block 2 saves of it is held, not rebuilt, and every step matches
    plain PyTorch."""
    model, x = the_issue_model(slot, alias), torch.randn(B, W)
    model.writes_from = 3
    _, frames = run_plan_against_plain(model, x, ("blocks.0", "blocks.2"), steps=5)
    scoped = [f for f in frames if f.runtime_state.scope is not None and not f.runtime_state.scope.whole]
    assert len(scoped) >= 2, "no step traced only the releasing blocks"
    if alias == "half":  # read through a cat, which saves nothing: its rebuild holds the written storage
        return
    written = [f for f in scoped if model.writes_from <= frames.index(f)]
    assert written and all(any("did not trace it" in why for why in f.stats.fallbacks) for f in written), \
        [f.stats.fallbacks for f in scoped]


def test_a_write_across_blocks_seen_traced_traces_every_later_forward_whole() -> None:
    """Block 1 reads its input (block 0 stashed a view of it) into a storage block 2 saves, and
    block 2 then writes the input through the stash: the profiled (traced) forwards see a
    storage written after another block read it, and every later forward is traced whole.
    Traced only in block 1, the input (made untraced) would be a leaf of the recipe block 2's
    save is rebuilt from, written by the time backward rebuilds it."""
    torch.manual_seed(0)
    model = Program([[("stash", "attr", "view", True)],
                     [("stash", "dict", "view", False), ("inplace", False)],
                     [("read", "dict", "mul"), ("write", "attr", "mul", False), ("lin", "tanh")]])
    prov, frames = run_plan_against_plain(model, torch.randn(B, W), ("blocks.1",), steps=4)
    assert prov.runtime.mode.writes_across_blocks
    assert all(f.runtime_state.scope is None for f in frames)


def test_a_write_through_data_moves_no_counter_and_is_documented_as_such() -> None:
    """``.data`` is an alias with a version counter of its own: autograd does not see writes
    through it, and neither do bagualu2's checks (docs/CONTRACTS.md, "Exactness"). The write
    leaves the counter the check reads where it was."""
    x = torch.randn(3, requires_grad=True) * 1
    before = x._version
    x.data.mul_(2)
    assert x._version == before


# -- the adversary ----------------------------------------------------------------------------
_action = st.one_of(
    st.tuples(st.just("lin"), st.sampled_from(ACTS)),
    st.tuples(st.just("stash"), st.sampled_from(SLOTS), st.sampled_from(ALIASES), st.booleans()),
    st.tuples(st.just("write"), st.sampled_from(SLOTS), st.sampled_from(("mul", "add", "part")), st.booleans()),
    st.tuples(st.just("read"), st.sampled_from(SLOTS), st.sampled_from(("mul", "mm"))),
    st.tuples(st.just("inplace"), st.booleans()),
)


@st.composite
def _program(draw: Any) -> List[List[tuple]]:
    """Random blocks, with one stash, an in-place write and a read of it planted in blocks
    ``a <= b < c`` (so that every program aliases; the rest of its actions are random)."""
    blocks = draw(st.lists(st.lists(_action, max_size=4), min_size=3, max_size=4))
    slot = draw(st.sampled_from(SLOTS))
    a = draw(st.integers(0, len(blocks) - 2))
    b = draw(st.integers(a, len(blocks) - 2))
    c = draw(st.integers(b + 1, len(blocks) - 1))
    blocks[a].insert(draw(st.integers(0, len(blocks[a]))), ("stash", slot, draw(st.sampled_from(ALIASES)), draw(st.booleans())))
    at = len(blocks[b]) if a == b else draw(st.integers(0, len(blocks[b])))
    blocks[b].insert(at, ("write", slot, draw(st.sampled_from(("mul", "add", "part"))), draw(st.booleans())))
    blocks[c].insert(draw(st.integers(0, len(blocks[c]))), ("read", slot, draw(st.sampled_from(("mul", "mm")))))
    return [blk or [("lin", "tanh")] for blk in blocks]

_POLICIES = ("keep_all", "recompute_all", "offload_all", "random", "adaptive")


def _adversary(data: st.DataObject, blocks: List[List[tuple]], policy: str, compile_blocks: bool) -> None:
    torch.manual_seed(data.draw(st.integers(0, 3), label="seed"))
    model, x = Program(blocks), torch.randn(B, W)
    try:
        step(copy.deepcopy(model), x)
    except RuntimeError:
        reject()  # plain PyTorch refuses the program (an in-place write autograd needs): nothing to match
    budget = None
    if policy == "random":
        keys, _ = keys_of(model, x)
        # Mostly keeps, so that the plan releases from some blocks and not others (trace scopes)
        choices = st.sampled_from([Choice.KEEP, Choice.KEEP, Choice.RECOMPUTE, Choice.OFFLOAD])
        plan: Any = {k: data.draw(choices, label=k) for k in keys}
    elif policy == "adaptive":
        _, peak = keys_of(model, x)
        budget = max(1, int(peak * data.draw(st.sampled_from([0.5, 0.8]), label="budget fraction")))
        plan = "adaptive"
    else:
        plan = policy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # budget crossings under adaptive are counted, not judged, here
        try:
            run_against_plain(model, x, plan, budget=budget, compile_blocks=compile_blocks)
        except bagualu2.InfeasibleBudgetError:
            reject()  # a budget no plan meets is refused before anything is allocated: nothing to compare
    gc.collect()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), blocks=_program(), policy=st.sampled_from(_POLICIES))
def test_adversary_aliases_written_anywhere_are_exact_under_every_policy(data: st.DataObject, blocks: List[List[tuple]],
                                                                          policy: str) -> None:
    _adversary(data, blocks, policy, compile_blocks=False)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), blocks=_program(), policy=st.sampled_from(_POLICIES))
def test_adversary_at_length(data: st.DataObject, blocks: List[List[tuple]], policy: str) -> None:
    _adversary(data, blocks, policy, compile_blocks=False)


def test_a_storage_read_then_written_by_a_later_block_is_never_a_leaf_of_a_rebuild() -> None:
    """Block 1's output is read by block 3 (into what block 3 saves) and then written in place by
    it. Rerun whole, block 1 would run untraced and its output would be a leaf of block 3's
    recipes, written by the time backward rebuilds from it: the traced forwards see the write,
    so no block is rerun whole and every forward is traced, and every step matches plain
    PyTorch (the shape the adversary found)."""
    torch.manual_seed(0)
    model = Program([[("stash", "attr", "view", False)], [("lin", "tanh")],
                     [("stash", "closure", "view", True), ("write", "closure", "mul", False)],
                     [("read", "attr", "mul"), ("write", "closure", "mul", False), ("read", "closure", "mul")]])
    x = torch.randn(B, W)
    frames: List[Any] = []
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", gates=[], min_bytes=0, verify="all")
    prov.runtime.on_frame_end.subscribe(frames.append)
    for i in range(4):
        assert_bitwise(step(plain, x), step(model, x), f"step {i}")
    assert prov.runtime.mode.writes_across_blocks and all(f.stats.rerun_blocks == 0 for f in frames)
    assert prov.report()["verify"]["mismatches"] == 0
    prov.disable()
