"""Collectives and sharded parameters inside a provisioned forward (docs/CONTRACTS.md invariants 1 and 6).

c10d's collectives write into tensors they were given without their schemas saying so, and
FSDP2 frees the parameters it unsharded once a module's forward is done. The tracer must know
what every op writes, never replay a collective in backward, stop a rebuild at what a collective
made (kept or offloaded, never rebuilt), and never rebuild from a parameter that backward will
not find unsharded. In-process tests use a one-rank gloo group (the ops run the same code paths);
the FSDP2 tests run two real ranks.
"""
from __future__ import annotations

import contextlib
import copy
import json
import random
import sys
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.runtime.op_effects import OpInfo
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.offload import CopyEngine, HostArena
from bagualu2.plan.planner import Choice

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

from pipeline_harness import CollectiveCounter, launch  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A one-rank gloo group: collectives run their real ops (and write their outputs)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in memory: no server thread
    try:
        yield
    finally:
        dist.destroy_process_group()


class AllToAllBlock(torch.nn.Module):
    """An expert-parallel-like block: the all-to-all writes into a buffer made by ``empty``, and
    an all-reduce updates a traced tensor in place."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.inp = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).relu()
        if self.functional:
            routed = funcol.wait_tensor(funcol.all_to_all_single_autograd(h, None, None, dist.group.WORLD))
        else:
            routed = _AllToAll.apply(h)
        total = h.detach() * 0.5
        dist.all_reduce(total)  # c10d::allreduce_ writes its argument
        return self.out(routed * h + total).tanh()  # mul saves what the collective wrote


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` into a fresh buffer, as hand-written EP layers do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous())
        return out


class Blocks(torch.nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(AllToAllBlock(functional) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _loss_and_grads(model: torch.nn.Module, loss: torch.Tensor, count: bool = False):
    model.zero_grad(set_to_none=True)
    counter = CollectiveCounter()
    with counter if count else contextlib.nullcontext():
        loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()], counter.count


def _assert_bitwise(ref, got) -> None:
    assert torch.equal(ref[0], got[0]), f"loss differs: {ref[0].item()} vs {got[0].item()}"
    for i, (a, b) in enumerate(zip(ref[1], got[1])):
        assert torch.equal(a, b), f"gradient {i} differs by {(a - b).abs().max().item()}"


def _setup(functional: bool, engine: bool = True):
    torch.manual_seed(0)
    model = Blocks(functional)
    runtime = ActivationRuntime(CopyEngine(HostArena(16 << 20)) if engine else None)
    runtime.residency.set_parameters(model.parameters())
    runtime.attach(model)
    return model, runtime, torch.randn(12, 16)


def _keys(model: torch.nn.Module, runtime: ActivationRuntime, x: torch.Tensor) -> List[str]:
    frame = Frame()
    with runtime.frame(frame):
        model(x)
    return sorted(frame.keys_seen)


# -- what an op writes ------------------------------------------------------------------------
def test_written_arguments_of_collectives_and_list_outputs() -> None:
    """c10d schemas declare no writes: what a collective writes is read from its arguments'
    names; a send only reads; ``Tensor(a!)[]`` arguments (foreach, out= lists) are writes too."""
    written = {op: OpInfo.of(op).written for op in (
        torch.ops.c10d.alltoall_base_.default, torch.ops.c10d._allgather_base_.default,
        torch.ops.c10d.allreduce_.default, torch.ops.c10d.send.default, torch.ops.c10d.recv_.default,
        torch.ops._c10d_functional.wait_tensor.default, torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops.aten._foreach_mul_.List, torch.ops.aten.add.Tensor,
    )}
    assert written == {
        torch.ops.c10d.alltoall_base_.default: (0,),
        torch.ops.c10d._allgather_base_.default: (0,),
        torch.ops.c10d.allreduce_.default: (0,),
        torch.ops.c10d.send.default: (),
        torch.ops.c10d.recv_.default: (0,),
        torch.ops._c10d_functional.wait_tensor.default: (0,),
        torch.ops._c10d_functional.all_to_all_single.default: (),
        torch.ops.aten._foreach_mul_.List: (0,),
        torch.ops.aten.add.Tensor: (),
    }
    assert not OpInfo.of(torch.ops._c10d_functional.all_to_all_single.default).replayable
    assert "collective" in OpInfo.of(torch.ops.c10d.alltoall_base_.default).why_not


class ForeachScale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lin(x) + 1.0, self.lin(x * 2) - 1.0
        torch._foreach_mul_([a, b], 3.0)  # writes both through a Tensor(a!)[] argument
        return (a.sin() + b.cos()).sum()


@pytest.mark.parametrize("choice", [Choice.RECOMPUTE, Choice.OFFLOAD])
def test_an_in_place_write_through_a_list_argument_is_replayed(choice: Choice) -> None:
    torch.manual_seed(0)
    model = ForeachScale()
    x = torch.randn(4, 8)
    ref = _loss_and_grads(model, model(x))
    runtime = ActivationRuntime(CopyEngine(HostArena(1 << 20)))
    runtime.residency.set_parameters(model.parameters())
    runtime.attach(model)
    with runtime.frame(Frame(default=choice)):
        loss = model(x)
    _assert_bitwise(ref, _loss_and_grads(model, loss))


# -- collectives ------------------------------------------------------------------------------
@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("choice", list(Choice))
def test_uniform_plans_over_collectives_are_exact(functional: bool, choice: Choice) -> None:
    model, runtime, x = _setup(functional)
    ref = _loss_and_grads(model, model(x), count=True)
    frame = Frame(default=choice)
    with runtime.frame(frame):
        loss = model(x)
    got = _loss_and_grads(model, loss, count=True)
    _assert_bitwise(ref, got)
    assert got[2] == ref[2], f"backward issued {got[2]} collectives, plain PyTorch {ref[2]}"
    if choice == Choice.RECOMPUTE:
        assert any("collective" in f for f in frame.stats.fallbacks), frame.stats.fallbacks


@pytest.mark.parametrize("functional", [False, True])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_per_operator_plans_over_collectives_are_exact(functional: bool, data: st.DataObject) -> None:
    model, runtime, x = _setup(functional)
    keys = _keys(model, runtime, x)
    plan = {k: data.draw(st.sampled_from(list(Choice)), label=k) for k in keys}
    ref = _loss_and_grads(model, model(x), count=True)
    with runtime.frame(Frame(plan, strict=True)):
        loss = model(x)
    got = _loss_and_grads(model, loss, count=True)
    _assert_bitwise(ref, got)
    assert got[2] == ref[2]
    del loss
    assert runtime.ledger.resident == 0


def test_a_block_that_issues_a_collective_is_never_rerun_whole() -> None:
    """``recompute_all`` reruns blocks in backward; one that issues a collective would issue it
    again there. Such blocks are traced and rebuilt op by op; the first frame traces every
    block, since until then nobody knows which ones issue collectives."""

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([AllToAllBlock(False), torch.nn.Sequential(torch.nn.Linear(16, 16),
                                                                                          torch.nn.GELU())])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    model = Mixed()
    runtime = ActivationRuntime(None)
    runtime.residency.set_parameters(model.parameters())
    runtime.attach(model)
    x = torch.randn(12, 16)
    ref = _loss_and_grads(model, model(x), count=True)
    reruns = []
    for _ in range(3):
        frame = Frame(default=Choice.RECOMPUTE)
        frame.rerun_blocks = True
        with runtime.frame(frame):
            loss = model(x)
        got = _loss_and_grads(model, loss, count=True)
        _assert_bitwise(ref, got)
        assert got[2] == ref[2]
        reruns.append(frame.stats.rerun_blocks)
    assert reruns == [0, 1, 1]  # the collective's block never; the other once it was traced
    assert runtime.mode.side_effect_modules == {"blocks.0"}


def test_enable_over_collectives_every_policy_exact() -> None:
    """Through ``bagualu2.enable``: every policy, no collective added to backward."""
    for policy in ("keep_all", "offload_all", "recompute_all", "adaptive"):
        torch.manual_seed(0)
        model = Blocks(False)
        plain = copy.deepcopy(model)
        prov = bagualu2.enable(model, budget=1 << 30, policy=policy, gates=[])
        for step in range(3):
            x = torch.randn(12, 16)
            ref = _loss_and_grads(plain, plain(x), count=True)
            got = _loss_and_grads(model, model(x), count=True)
            _assert_bitwise(ref, got)
            assert got[2] == ref[2], policy
        prov.disable()
        assert prov.runtime.ledger.resident == 0


def _fsdp2_tiny(shard: bool) -> MoETransformer:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny())
    if shard:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _micro_batches(model: MoETransformer, policy: str, budget, steps: int) -> list:
    prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0)
    for i in range(steps):
        tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(i))
        model(tokens).backward()
        prov.step()
    seen = [(mb.traced, mb.calibrating, mb.peak_bytes, dict(mb.bytes_by_choice)) for mb in prov.telemetry.micro_batches]
    prov.disable()
    return seen


def test_fsdp2_sharded_parameters_count_as_parameters_not_activations() -> None:
    """FSDP2's parameters are ``DTensor``s whose shards its all-gather reads inside every traced
    forward: they are weights, as the unsharded model's are, so every micro-batch counts the
    bytes the unsharded one does, and a calm adaptive run keeps everything once it calibrated
    (counted as pinned leaves, they would be a headroom that leaves no room to keep)."""
    keep_plain = _micro_batches(_fsdp2_tiny(False), "keep_all", None, 3)
    keep_sharded = _micro_batches(_fsdp2_tiny(True), "keep_all", None, 3)
    assert [mb[2] for mb in keep_sharded] == [mb[2] for mb in keep_plain]
    budget = int(max(mb[2] for mb in keep_plain) * 1.05)
    adaptive = _micro_batches(_fsdp2_tiny(True), "adaptive", budget, 8)
    calm = [mb for mb in adaptive if not mb[1]][-3:]
    assert calm and all(mb[3]["offload"] == 0 and mb[3]["recompute"] == 0 for mb in calm), adaptive


# torch 2.13 renamed all_gather_into_tensor (deprecated there: a FutureWarning, an error here)
# to all_gather_single; torch 2.11 knows only the old name: the same collective.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FirstUnshard(torch.nn.Module):
    """FSDP2's unshard as its first forward in a process runs it: the all-gather's output, made
    in the forward and written by a collective, is copied into the unsharded parameters'
    buffers, allocated in that forward (later ones reuse them), by one op that writes them all."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.shard = torch.nn.Parameter(torch.randn(4096))
        self.unsharded: List[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = torch.empty(self.shard.numel())  # one rank's world
        all_gather_single(gathered, self.shard.detach())
        if not self.unsharded:
            self.unsharded = [torch.empty(1, 3072), torch.empty(1, 1024)]
        with torch.no_grad():
            torch.split_with_sizes_copy(gathered.view(1, -1), [3072, 1024], dim=1, out=self.unsharded)
        return self.proj(x).tanh().sum()


def test_a_write_into_buffers_the_forward_made_pins_nothing_no_recipe_keeps() -> None:
    """One op writing several storages is recorded without its arguments (no replay could
    write only one of them), so what it reads is neither held nor counted: FSDP2's first
    forward in a process (a resumed run's first, for one) holds what any later one does.
    Counted, the all-gather's output stayed in the most a forward held that no plan releases,
    and every later decision left room for it."""
    x = torch.randn(8, 16)

    def pinned(warm: bool) -> List[int]:
        torch.manual_seed(0)
        model = FirstUnshard()
        if warm:  # the buffers are there before bagualu2 sees a forward
            model(x).backward()
        prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
        seen = []
        for _ in range(3):
            model(x).backward()
            prov.step()
            seen.append(prov.footprint.pinned_bytes)
        prov.disable()
        return seen

    # Held from outside the forward in every one: its input, which the projection saves.
    assert pinned(False) == pinned(True) == [x.untyped_storage().nbytes()] * 3


# -- FSDP2: two real ranks --------------------------------------------------------------------
def _fsdp_rank(rank: int, world: int, out: str, order: str, seed: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cfg = MoEConfig.tiny()
    model = MoETransformer(cfg)
    plain = copy.deepcopy(model)

    def shard(m: torch.nn.Module) -> None:
        for layer in m.layers:
            fully_shard(layer)
        fully_shard(m)

    shard(plain)
    runtime = ActivationRuntime(CopyEngine(HostArena(16 << 20)))
    if order == "enable_first":
        runtime.residency.set_parameters(model.parameters())
        runtime.attach(model)
        shard(model)
    else:
        shard(model)
        runtime.residency.set_parameters(model.parameters())
        runtime.attach(model)

    def step(m: torch.nn.Module, frame=None, count=False):
        torch.manual_seed(100 + rank)
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        if frame is None:
            loss = m(x)
        else:
            with runtime.frame(frame):
                loss = m(x)
        for p in m.parameters():
            p.grad = None
        counter = CollectiveCounter()
        with counter:
            loss.backward()
        return loss.detach(), [p.grad.to_local().clone() for p in m.parameters()], counter.count

    for _ in range(2):  # both models take the same steps: FSDP2's first differs from the next
        keys_frame = Frame()
        step(model, keys_frame)
        step(plain)
    keys = sorted(keys_frame.keys_seen)
    rng = random.Random(seed)
    results = []
    for trial in range(5):
        if trial == 0:
            plan = {k: Choice.RECOMPUTE for k in keys}
        else:
            plan = {k: rng.choice(list(Choice)) for k in keys}
        # Odd trials: no room for anchors, so rebuild chains reach across blocks.
        runtime.residency.budget_bytes = 1 if trial % 2 else None
        ref = step(plain, count=True)
        frame = Frame(plan)
        got = step(model, frame, count=True)
        exact = torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
        results.append({"exact": exact, "collectives": [ref[2], got[2]],
                         "refused": sum("sharded parameters" in f for f in frame.stats.fallbacks)})
    runtime.residency.budget_bytes = None
    del frame, got
    import gc
    gc.collect()
    results.append({"resident": runtime.ledger.resident})
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["enable_first", "shard_first"])
def test_fsdp2_random_plans_are_exact_and_never_rebuild_from_a_resharded_parameter(tmp_path: Path,
                                                                                   order: str) -> None:
    launch(_fsdp_rank, 2, str(tmp_path), order, 7, timeout_s=240)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        *trials, end = results
        assert all(t["exact"] for t in trials), trials
        assert all(t["collectives"][0] == t["collectives"][1] for t in trials), trials
        assert any(t["refused"] for t in trials), "no rebuild crossed a resharded parameter: the test tests nothing"
        assert end["resident"] == 0
