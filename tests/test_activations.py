"""Activation runtime: exactness, lifetimes, accounting and errors (docs/CONTRACTS.md invariants 1, 3, 4).

Every test compares against the same model run by plain PyTorch, bit for bit.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import gc
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

import bagualu2
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.runtime import activations, recipes
from bagualu2.runtime.recipes import call_key, module_of
from bagualu2.runtime.stores import OffloadStore
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.offload import CopyEngine, HostArena, OffloadHandle
from bagualu2.plan.planner import Choice

SEED = 1234


def make_model(dtype: torch.dtype = torch.float32, **cfg) -> Tuple[MoETransformer, torch.Tensor]:
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(dropout=0.1, **cfg)).to(dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24))
    return model, tokens


class Harness:
    """Runs one training micro-batch of ``model`` plainly or through a runtime frame.

    Offloaded storages are copied back in backward, as on a device, unless ``reload_in_place``
    (the cpu default of ``bagualu2.enable``: backward reads them in the arena).
    """

    def __init__(self, model: torch.nn.Module, engine: Optional[CopyEngine], reload_in_place: bool = False) -> None:
        self.model = model
        self.runtime = ActivationRuntime(engine, reload_in_place=reload_in_place)
        self.runtime.residency.set_parameters(list(model.parameters()) + list(model.buffers()))
        self._hooks = self.runtime.attach(model)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def trace_blocks(self, inputs: torch.Tensor) -> None:
        """One traced forward (eval mode, no grad, so nothing changes): the runtime reruns only
        blocks it has seen traced, which it then knows issue no collective."""
        training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.runtime.frame(Frame()):
            self.model(inputs)
        self.model.train(training)

    def forward(self, inputs: torch.Tensor, frame: Optional[Frame]) -> torch.Tensor:
        torch.manual_seed(SEED)
        if frame is None:
            return self.model(inputs)
        with self.runtime.frame(frame):
            return self.model(inputs)


def loss_and_grads(model: torch.nn.Module, loss: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def assert_bitwise(a: Tuple[torch.Tensor, List[torch.Tensor]], b: Tuple[torch.Tensor, List[torch.Tensor]]) -> None:
    assert torch.equal(a[0], b[0]), f"loss differs: {a[0].item()} vs {b[0].item()}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert torch.equal(x, y), f"gradient {i} differs by {(x.float() - y.float()).abs().max().item()}"


@pytest.fixture
def engine() -> CopyEngine:
    return CopyEngine(HostArena(64 << 20))


@pytest.fixture(scope="module")
def keys() -> List[str]:
    model, tokens = make_model()
    h = Harness(model, None)
    frame = Frame()
    h.forward(tokens, frame)
    h.close()
    return sorted(frame.keys_seen)


@pytest.mark.parametrize("load_cap", [1.2, None])
def test_operator_keys_are_the_same_from_micro_batch_to_micro_batch(load_cap: Optional[float]) -> None:
    """Keys name ops by module path, op and occurrence: micro-batches whose routing differs
    (token counts, the router's load-cap rounds, forced spikes) save under the same keys."""
    model, _ = make_model(router_load_cap=load_cap)
    h = Harness(model, None)
    seen = []
    for i, spike in enumerate([0.0, 0.0, 2.0, 0.0, 3.0, 0.0]):
        tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(i))
        frame = Frame()
        with model.routing_spike(spike, experts=(i % 8,)) if spike else contextlib.nullcontext():
            h.forward(tokens, frame)
        seen.append((sorted(frame.keys_seen), [layer.moe.router.last_tokens_per_expert.tolist()
                                               for layer in model.layers]))
    h.close()
    assert len({str(routing) for _, routing in seen}) == len(seen)  # the routing really differed
    # the keys of expert ops depend on which experts got tokens; all other keys are the same
    shared = [{k for k in keys if ".experts." not in k} for keys, _ in seen]
    assert all(keys == shared[0] for keys in shared), [sorted(k ^ shared[0]) for k in shared]


class _Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sigmoid() * x


class _CallsTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Gated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner(x)).sum()


def test_operator_key_grammar_names_the_call_and_the_module() -> None:
    """``call_key`` maps every output of one op call to its first output's key; ``module_of``
    gives the module path of the call that ran the op, a module's second call included."""
    model, tokens = make_model()
    h = Harness(model, None)
    frame = Frame()
    h.forward(tokens, frame)
    h.close()
    indices = "layers.0.moe.router:aten.topk.default:0.1"  # topk's second output
    assert indices in frame.keys_seen
    assert call_key(indices) == call_key("layers.0.moe.router:aten.topk.default:0") == indices[:-2]
    assert module_of(indices) == "layers.0.moe.router"
    torch.manual_seed(0)
    h = Harness(_CallsTwice(), None)
    frame = Frame()
    h.forward(torch.randn(4, 8), frame)
    h.close()
    sigmoids = sorted(k for k in frame.keys_seen if "sigmoid" in k)
    assert sigmoids == ["inner#1:aten.sigmoid.default:0", "inner:aten.sigmoid.default:0"]
    assert {module_of(k) for k in sigmoids} == {"inner"}


# -- invariant 1: exactness -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("choice", list(Choice))
def test_exactness_uniform_plans(engine: CopyEngine, dtype: torch.dtype, choice: Choice) -> None:
    model, tokens = make_model(dtype)
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    frame = Frame(default=choice)
    result = loss_and_grads(model, h.forward(tokens, frame))
    assert_bitwise(reference, result)
    released = frame.stats.bytes_by_choice[choice.name.lower()]
    assert released > 0 and not [f for f in frame.stats.fallbacks if "arena" in f]


@pytest.mark.parametrize("reload_in_place", [False, True])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_exactness_random_per_operator_plans(engine: CopyEngine, keys: List[str], reload_in_place: bool,
                                             data: st.DataObject) -> None:
    model, tokens = make_model()
    h = Harness(model, engine, reload_in_place)
    reference = loss_and_grads(model, h.forward(tokens, None))
    plan = {k: data.draw(st.sampled_from(list(Choice)), label=k) for k in keys}
    result = loss_and_grads(model, h.forward(tokens, Frame(plan, strict=True)))
    assert_bitwise(reference, result)
    h.close()
    gc.collect()
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0


class ViewsCastsShared(torch.nn.Module):
    """Saved tensors that are views, dtype casts and one storage saved by several ops."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        a, b, c = h.split(16, dim=-1)            # views of one storage
        t = a.t()                                # a transposed view
        shared = torch.sigmoid(b)
        y = shared * shared.exp() + shared.sin()  # one storage saved by three ops
        z = c.to(torch.float64).tanh().to(torch.float32)  # casts
        w = c.to(torch.bfloat16).float()          # cast of an activation saved elsewhere
        return (t.t().relu() * y).sum() + z.sum() + (w * c).sum()


def views_casts_shared(engine: CopyEngine) -> Tuple[ViewsCastsShared, torch.Tensor, Harness]:
    torch.manual_seed(0)
    model = ViewsCastsShared()
    return model, torch.randn(32, 16), Harness(model, engine)


@pytest.mark.parametrize("choice", list(Choice))
def test_exactness_views_casts_shared_storage(engine: CopyEngine, choice: Choice) -> None:
    model, x, h = views_casts_shared(engine)
    reference = loss_and_grads(model, h.forward(x, None))
    frame = Frame(default=choice)
    assert_bitwise(reference, loss_and_grads(model, h.forward(x, frame)))
    if choice != Choice.KEEP:
        assert frame.stats.shared_bytes > 0  # `shared` saved three times, stored (or released) once
    census = sum(n for n, _ in _saved_storages(model, x).values())
    assert frame.stats.bytes_by_choice[choice.name.lower()] <= census  # each storage counted once


def test_shared_storage_is_offloaded_once(engine: CopyEngine) -> None:
    model, x, h = views_casts_shared(engine)
    frame = Frame(default=Choice.OFFLOAD)
    before = engine.arena.stats()["num_allocs"]
    loss = h.forward(x, frame)
    blocks = engine.arena.stats()["num_allocs"] - before
    # One arena block per offloaded storage; views and re-saves of a storage take none.
    assert blocks == frame.stats.offloaded_storages
    assert frame.stats.packed > blocks
    loss.backward()


@pytest.mark.parametrize("choice", [Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE])
def test_an_on_hook_subscriber_sees_every_saved_tensor_hook_and_what_it_handled(engine: CopyEngine, choice: Choice) -> None:
    """The benchmarks' timing switch: every pack and unpack of a frame started with an
    ``on_hook`` subscriber is reported once, with what it stored or restored; the frame stays
    exact, and a frame started after it unsubscribed is not reported."""
    model, tokens = make_model()
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    seen: List[Tuple[str, str, float]] = []
    timing = h.runtime.on_hook.subscribe(lambda hook, record, seconds: seen.append((hook, record, seconds)))
    frame = Frame(default=choice)
    assert_bitwise(reference, loss_and_grads(model, h.forward(tokens, frame)))
    packs = [r for hook, r, _ in seen if hook == "pack"]
    unpacks = [r for hook, r, _ in seen if hook == "unpack"]
    assert len(packs) >= frame.stats.packed > 0 and unpacks
    assert all(seconds >= 0.0 for *_, seconds in seen)
    released = {Choice.KEEP: "kept", Choice.OFFLOAD: "offloaded", Choice.RECOMPUTE: "recomputed"}[choice]
    assert released in packs and released in unpacks
    assert set(packs) <= {"kept", "tensor", released}
    timing.unsubscribe()
    seen.clear()
    loss_and_grads(model, h.forward(tokens, Frame(default=choice)))
    assert not seen


@pytest.mark.parametrize("passes", [1, 2])
def test_each_offloaded_storage_is_reloaded_once_per_backward_pass(engine: CopyEngine, passes: int) -> None:
    """The MoE layer's experts each save a slice of one permuted token buffer, attention saves
    q/k/v views of one projection, and casts are regenerated from stored sources: however many
    saved tensors read an offloaded storage, it is reloaded once per backward pass, and the
    copy held between its readers is charged to the ledger and released after the last one."""
    model, tokens = make_model()
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(tokens, frame)
    stores = frame.offload_stores()
    assert max(s.refs for s in stores) >= model.cfg.num_experts, "the token buffer is read by every expert"
    engine.start_trace()
    held_peak = [0]

    def observe(key: str) -> None:
        held_peak[0] = max(held_peak[0], sum(s.nbytes for s in stores if s.held is not None))

    watching = h.runtime.residency.on_released_unpack.subscribe(observe)
    for n in range(passes):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=n + 1 < passes)
        assert_bitwise(reference, (loss.detach(), [p.grad for p in model.parameters()]))
        assert all(s.held is None for s in stores), "a copy still held after its last reader"
    reloads: Dict[int, int] = {}
    for r in engine.trace():
        if r["direction"] == "h2d":
            reloads[r["host_ptr"]] = reloads.get(r["host_ptr"], 0) + 1
    assert sorted(reloads) == sorted(s.handle.host_ptr for s in stores)
    assert set(reloads.values()) == {passes}, f"reloads per storage: {sorted(reloads.values())}"
    assert held_peak[0] > 0
    watching.unsubscribe()
    del loss, frame, observe
    stores.clear()
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0


class Scale(torch.autograd.Function):
    """y = x * 2; its backward (wrongly) writes into the tensor it saved when ``write``."""

    write = True

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        if Scale.write:
            x.zero_()
        return grad * 2


class TwoReadersOneWrites(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        a, b = y[:, :8], y[:, 4:12]  # overlapping views of one storage
        # Backward runs a * a, then Scale (which zeroes b, half of it inside a), then sin.
        return (a.sin() * 3).sum() + Scale.apply(b).sum() + (a * a).sum()


def test_a_held_copy_written_in_place_is_not_handed_out_again(engine: CopyEngine) -> None:
    """A backward that writes into its unpacked tensor must not corrupt what the storage's
    later readers get: they receive the bytes saved in the forward. (Plain PyTorch refuses
    this backward with its version check; the offloaded storage's readers each get the saved
    bytes, so the gradient is the one computed without the stray write.)"""
    torch.manual_seed(0)
    model = TwoReadersOneWrites()
    x = torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(model(x), model.lin.weight)
    Scale.write = False
    try:
        expected = torch.autograd.grad(model(x), model.lin.weight)[0]
    finally:
        Scale.write = True
    h = Harness(model, engine)
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(x, frame)
    assert max(s.refs for s in frame.offload_stores()) == 4, "sin, Scale and a * a (twice) read one storage"
    (grad,) = torch.autograd.grad(loss, model.lin.weight)
    assert torch.equal(grad, expected)


class Transients(torch.nn.Module):
    """``lin(x)`` and ``a`` are saved by no op (freed after the forward); ``sin`` saves ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x) + 1.0
        b = a * 3.0
        return b.sin().sum()


def test_profile_names_the_unsaved_inputs_a_rebuild_must_rebuild_first(engine: CopyEngine) -> None:
    torch.manual_seed(0)
    model = Transients()
    h = Harness(model, engine)
    h.runtime.on_frame_start.subscribe(lambda f: None)  # frames then list their recomputed nodes
    frame = Frame(default=Choice.RECOMPUTE)
    frame.profile = True
    loss = h.forward(torch.randn(64, 16), frame)
    by_key = {key: node for key, node, _ in frame.recompute_nodes()}
    mul = next(k for k in frame.saved_profile if ":aten.mul.Tensor:" in k)
    add = by_key[mul].creator.args[0].node  # a = lin(x) + 1: not saved, so rebuilt first
    lin = add.creator.args[0].node  # lin(x): addmm saves its inputs, not its output
    assert add.key not in frame.keys_seen and lin.key not in frame.keys_seen
    nbytes, own, rebuildable, unsaved, reads = frame.saved_profile[mul]
    assert own == by_key[mul].creator.seconds > 0 and rebuildable
    assert set(unsaved) == {add.key, lin.key} and reads == ()
    assert frame.unsaved_seconds[add.key] == add.creator.seconds > 0
    assert frame.unsaved_seconds[lin.key] == lin.creator.seconds > 0
    h.runtime.residency.take_replay_times()
    loss.backward()
    replays = h.runtime.residency.take_replay_times()
    assert replays[mul][1] == 1 and replays[mul][0] > 0


def test_op_replay_times_time_each_replayed_op_once_and_a_rebuild_s_first_apart(engine: CopyEngine) -> None:
    """Each op call a rebuild replays is timed once, its inputs at hand: inside the chain, or,
    for the rebuild's first (its inputs made before the rebuild), apart."""
    torch.manual_seed(0)
    h = Harness(Transients(), engine)
    h.runtime.on_frame_start.subscribe(lambda f: None)  # frames then list their recomputed nodes
    frame = Frame(default=Choice.RECOMPUTE)
    loss = h.forward(torch.randn(64, 16), frame)
    by_key = {key: node for key, node, _ in frame.recompute_nodes()}
    mul = next(k for k in by_key if ":aten.mul.Tensor:" in k)
    add = by_key[mul].creator.args[0].node
    lin = add.creator.args[0].node
    h.runtime.residency.take_replay_times()
    h.runtime.residency.take_op_replay_times()
    loss.backward()
    rebuilds = h.runtime.residency.take_replay_times()
    ops = h.runtime.residency.take_op_replay_times()
    # mul's rebuild replays lin and add first (saved by nothing), each once, inside the unpack;
    # lin, the first, reads only what the forward kept
    assert {mul, add.key, lin.key} <= set(ops) and ops[lin.key][:3] == (0.0, 0, 1) and ops[lin.key][4] == 1, ops
    assert all(ops[k][1] == ops[k][2] == 1 and ops[k][0] > 0 and ops[k][3:] == (0.0, 0) for k in (mul, add.key)), ops
    # every replay timed once, in a chain or as its rebuild's first (other rebuilds' too)
    assert all(r == 1 and n + leads == 1 and (s > 0) == (n == 1) and (lead > 0) == (leads == 1)
               for s, n, r, lead, leads in ops.values()), ops
    assert sum(s + lead for s, _, _, lead, _ in ops.values()) <= sum(s for s, _ in rebuilds.values())
    assert h.runtime.residency.take_op_replay_times() == {}  # taken: counting starts again


class Norm(torch.nn.Module):
    """RMSNorm as the reference model computes it: ``x * r`` is saved by ``* weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * self.weight).sin().sum()


def test_profile_names_the_saved_storages_a_rebuild_reads(engine: CopyEngine) -> None:
    torch.manual_seed(0)
    h = Harness(Norm(), engine)
    frame = Frame(default=Choice.RECOMPUTE)
    frame.profile = True
    h.forward(torch.randn(8, 16, requires_grad=True), frame).backward()
    profile = frame.saved_profile  # keys of the root module: ":<op>:<occurrence>"
    assert profile[":aten.mul.Tensor:1"][4] == (":aten.mul.Tensor:0",)  # (x * r) * weight reads x * r
    assert profile[":aten.mul.Tensor:0"][4] == (":aten.rsqrt.default:0",)  # x is the forward's input


def test_a_rebuild_s_reload_of_an_offloaded_input_counts_as_copy_time(
        engine: CopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``x * r`` recomputed reads ``r`` offloaded: the reload (made slow here) is the copies'
    time, not the rebuild's nor its op's."""
    torch.manual_seed(0)
    h = Harness(Norm(), engine)
    frame = Frame({":aten.rsqrt.default:0": Choice.OFFLOAD, ":aten.mul.Tensor:0": Choice.RECOMPUTE}, strict=True)
    loss = h.forward(torch.randn(8, 16, requires_grad=True), frame)
    assert frame.stats.bytes_by_choice["offload"] > 0 and frame.stats.bytes_by_choice["recompute"] > 0
    reload = CopyEngine.reload
    slow = 0.05

    def slow_reload(self: CopyEngine, *args, **kwargs) -> torch.Tensor:
        time.sleep(slow)
        return reload(self, *args, **kwargs)

    monkeypatch.setattr(CopyEngine, "reload", slow_reload)  # the Harness copies back (not in place)
    h.runtime.residency.take_copy_times()
    loss.backward()
    rebuilt = h.runtime.residency.take_replay_times()
    ops = h.runtime.residency.take_op_replay_times()
    assert rebuilt[":aten.mul.Tensor:0"][0] < slow and all(s < slow for s, *_ in ops.values()), (rebuilt, ops)
    assert h.runtime.residency.take_copy_times()[0] >= slow


def test_releasing_a_host_copy_counts_as_copy_time(engine: CopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backward drops each offloaded storage's host copy (its arena block) as the last reader
    is done: the release (made slow here) is part of what the offload cost the thread, in
    the copies' time of the pass it ends in."""
    torch.manual_seed(0)
    h = Harness(Norm(), engine)
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(torch.randn(8, 16, requires_grad=True), frame)
    stores = frame.stats.offloaded_storages
    assert stores >= 2
    release = OffloadHandle.release
    slow = 0.02

    def slow_release(handle: OffloadHandle) -> None:
        time.sleep(slow)
        release(handle)

    monkeypatch.setattr(OffloadHandle, "release", slow_release)
    h.runtime.residency.take_copy_times()
    loss.backward()
    del loss
    seconds, copies, _ = h.runtime.residency.take_copy_times()
    assert copies == 0 and seconds >= stores * slow  # the counts were the forward's; the seconds are the release's


def test_rebuilt_storage_leaves_the_recompute_cache_after_its_last_released_view(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Backward drops a rebuilt storage once every saved view of it that was released has been
    unpacked in the pass, not when it leaves the block: the cache then holds less than a whole
    block's rebuilt storages, and still rebuilds each storage once per pass (retain_graph)."""
    model, tokens = make_model()
    h = Harness(model, None)
    reference = h.forward(tokens, None)
    reference.backward(retain_graph=True)
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    puts: Dict[Tuple[int, int], int] = {}
    live = {"high": 0}
    block_bytes: Dict[int, int] = {}
    put = recipes.RecomputeCache.put

    def observed_put(cache: recipes.RecomputeCache, position: int, state: int, storage: torch.UntypedStorage) -> None:
        put(cache, position, state, storage)
        puts[(position, state)] = puts.get((position, state), 0) + 1
        block = bisect.bisect_right(cache.anchors, position)
        block_bytes[block] = block_bytes.get(block, 0) + storage.nbytes()
        held = cache.nbytes
        live["high"] = max(live["high"], held)

    monkeypatch.setattr(recipes.RecomputeCache, "put", observed_put)
    loss = h.forward(tokens, Frame(default=Choice.RECOMPUTE))
    loss.backward(retain_graph=True)
    assert puts and set(puts.values()) == {1}, "each storage is rebuilt once in a pass"
    whole_block = max(block_bytes.values())
    loss.backward()
    assert torch.equal(loss, reference)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
    assert set(puts.values()) == {2}, "and once again in the second pass"
    assert live["high"] < 0.8 * whole_block, (live["high"], whole_block)


@pytest.mark.parametrize("rerun", [False, True], ids=["replayed", "rerun"])
def test_backward_rebuilds_are_charged_to_the_ledger_while_held(rerun: bool) -> None:
    """Storages backward rebuilds and holds for more readers are resident activations: the
    recompute cache's (op by op) and a rerun block's captured saves (until handed out). The
    first rebuild comes while the forward's holdings still are: the ledger rises above them."""
    model, tokens = make_model()
    h = Harness(model, None)
    h.trace_blocks(tokens)
    loss = h.forward(tokens, rerun_frame() if rerun else Frame(default=Choice.RECOMPUTE))
    after_forward = h.runtime.ledger.resident
    h.runtime.ledger.reset_peak()
    rebuilt = 2 * tokens.numel() * model.cfg.hidden_size * 4  # more than two hidden states
    loss.backward()
    assert h.runtime.ledger.peak > after_forward + rebuilt, (h.runtime.ledger.peak, after_forward)
    del loss
    assert h.runtime.ledger.resident == 0


@pytest.mark.parametrize("choice", [Choice.OFFLOAD, Choice.RECOMPUTE])
def test_backward_holds_nothing_over_the_budget(engine: CopyEngine, choice: Choice) -> None:
    """With the budget at what the forward left resident, backward holds no reloaded copy or
    rebuilt storage for later readers and prefetches nothing: each reader reloads or rebuilds
    its own, exactly, and the ledger never rises above the budget."""
    model, tokens = make_model()
    h = Harness(model, engine)  # reloads copy back, as on a device
    reference = loss_and_grads(model, h.forward(tokens, None))
    frame = Frame(default=choice)
    loss = h.forward(tokens, frame)
    h.runtime.residency.settle(wait=True)
    h.runtime.residency.budget_bytes = h.runtime.ledger.resident
    h.runtime.ledger.reset_peak()
    assert_bitwise(reference, loss_and_grads(model, loss))
    assert h.runtime.ledger.peak <= h.runtime.residency.budget_bytes
    h.runtime.residency.budget_bytes = None  # the same backward, unbounded, holds and prefetches above it
    loss = h.forward(tokens, Frame(default=choice))
    h.runtime.residency.settle(wait=True)
    resident = h.runtime.ledger.resident
    assert_bitwise(reference, loss_and_grads(model, loss))
    assert h.runtime.ledger.peak > resident


def test_settling_releases_every_completed_offload(engine: CopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloads complete in order, and settling stops at the first still copying: once the
    engine is idle, one settle releases every device source, past the stores that died
    meanwhile (here a first forward's, whose graph is dropped while its copies look
    unfinished: they are first in line)."""
    model, tokens = make_model()
    h = Harness(model, engine)
    copying = [True]
    done = OffloadHandle.done
    monkeypatch.setattr(OffloadHandle, "done", lambda handle: done(handle) and not copying[0])
    dropped = h.forward(tokens, Frame(default=Choice.OFFLOAD))
    first = h.runtime.residency.inflight_bytes
    loss = h.forward(tokens, Frame(default=Choice.OFFLOAD))
    assert 0 < first < h.runtime.residency.inflight_bytes  # both forwards' sources wait for their copies
    del dropped
    gc.collect()
    engine.synchronize()
    copying[0] = False
    assert h.runtime.residency.inflight_bytes > 0
    h.runtime.residency.settle()
    assert h.runtime.residency.inflight_bytes == 0
    held = h.runtime.ledger.resident
    loss_and_grads(model, loss)
    assert h.runtime.ledger.resident == 0 and held > 0
    h.close()


def test_replay_times_count_micro_batches_not_unpacks(engine: CopyEngine) -> None:
    model, x, h = views_casts_shared(engine)
    losses = [h.forward(x, Frame(default=Choice.RECOMPUTE)) for _ in range(2)]
    h.runtime.residency.take_replay_times()
    for loss in losses:
        loss.backward()
    replays = h.runtime.residency.take_replay_times()
    assert replays and {n for _, n in replays.values()} == {2}, replays


def test_cast_of_stored_activation_is_regenerated(engine: CopyEngine) -> None:
    model, x, h = views_casts_shared(engine)
    reference = loss_and_grads(model, h.forward(x, None))
    frame = Frame(default=Choice.KEEP)
    result = loss_and_grads(model, h.forward(x, frame))
    assert_bitwise(reference, result)
    assert frame.stats.regenerated_bytes > 0  # the bf16 copy of `c` is rebuilt, not stored


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = x * x
        ctx.save_for_backward(x, y)
        return y * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, y = ctx.saved_tensors
        return grad * (y + 2 * x * x)


class WithCustomFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Cube.apply(self.lin(x).tanh()).sum()


@pytest.mark.parametrize("choice", list(Choice))
def test_custom_autograd_function(engine: CopyEngine, choice: Choice) -> None:
    torch.manual_seed(0)
    model = WithCustomFunction()
    x = torch.randn(64, 8)
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(x, None))
    frame = Frame(default=choice)
    assert_bitwise(reference, loss_and_grads(model, h.forward(x, frame)))
    assert any(":aten.mul.Tensor:" in k for k in frame.keys_seen)


# -- reloading in place (cpu) ------------------------------------------------------------------
@pytest.mark.parametrize("model_kind", ["moe fp32", "moe bf16", "views, casts, shared"])
def test_reload_in_place_is_exact_and_copies_nothing_back(engine: CopyEngine, model_kind: str) -> None:
    """Backward reads offloaded cpu storages in the arena: the same bits as plain PyTorch, in a
    first and a retain_graph second pass, no reload copy, and everything returned after."""
    if model_kind == "views, casts, shared":
        model, x, _ = views_casts_shared(engine)
    else:
        model, x = make_model(torch.bfloat16 if "bf16" in model_kind else torch.float32)
    h = Harness(model, engine, reload_in_place=True)
    reference = loss_and_grads(model, h.forward(x, None))
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(x, frame)
    assert frame.stats.offloaded_storages > 0
    for retain in (True, False):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=retain)
        assert_bitwise(reference, (loss.detach(), [p.grad for p in model.parameters()]))
    engine.synchronize()
    assert engine.stats()["h2d_copies"] == 0 and engine.stats()["d2h_copies"] > 0
    del loss, frame
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0


class Stash(torch.autograd.Function):
    """y = x * 3; its backward keeps the tensor it saved (as user code may) in ``kept``."""

    kept: List[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        Stash.kept.append(ctx.saved_tensors[0])
        return grad * 3


def test_a_tensor_read_in_place_outlives_its_graph(engine: CopyEngine) -> None:
    """The arena block under a tensor backward was handed stays allocated, its bytes intact,
    until that tensor dies, although the graph that offloaded it died first."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64)
    h = Harness(torch.nn.Sequential(lin), engine, reload_in_place=True)
    with h.runtime.frame(Frame(default=Choice.OFFLOAD)):
        y = lin(x).relu()
        loss = Stash.apply(y).sum()
    expected = y.detach().clone()
    del y
    loss.backward()
    del loss
    gc.collect()
    (kept,) = Stash.kept
    Stash.kept.clear()
    assert engine.arena.stats()["in_use"] > 0 and torch.equal(kept, expected)
    del kept
    assert engine.arena.stats()["in_use"] == 0
    assert h.runtime.ledger.resident == 0


def test_a_write_into_bytes_read_in_place_is_refused_for_the_next_reader(engine: CopyEngine) -> None:
    """Read in place, a storage's readers share its bytes, as without offloading; a backward
    that writes into them makes the next reader fail as autograd's own version check does."""
    torch.manual_seed(0)
    model = TwoReadersOneWrites()
    x = torch.randn(32, 16)
    h = Harness(model, engine, reload_in_place=True)
    loss = h.forward(x, Frame(default=Choice.OFFLOAD))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, model.lin.weight)


class MaskedAttention(torch.nn.Module):
    """Attention with a mask built in the forward: sdpa takes it as a keyword-only argument."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(8, 8, dtype=torch.bool, device=x.device).tril()
        mask = torch.zeros(8, 8, device=x.device).masked_fill(~causal, float("-inf"))
        self.mask = StorageWeakRef(mask.untyped_storage())
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("choice", list(Choice))
def test_a_keyword_tensor_argument_is_recorded_like_a_positional_one(engine: CopyEngine, choice: Choice) -> None:
    """A released mask leaves the device (the recipe holds no tensor of it) and is rebuilt
    for the replay; the gradients stay exact."""
    torch.manual_seed(0)
    model = MaskedAttention()
    x = torch.randn(2, 8, 16)
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(x, None))
    loss = h.forward(x, Frame(default=choice))
    gc.collect()
    assert model.mask.expired() == (choice != Choice.KEEP)
    assert_bitwise(reference, loss_and_grads(model, loss))


# -- invariant 3: nothing lost, nothing leaked ------------------------------------------------
@pytest.mark.parametrize("choice", list(Choice))
def test_retain_graph_unpacks_twice(engine: CopyEngine, choice: Choice) -> None:
    model, tokens = make_model()
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    loss = h.forward(tokens, Frame(default=choice))
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert_bitwise(reference, (loss.detach(), first))
    assert_bitwise(reference, (loss.detach(), [p.grad for p in model.parameters()]))
    del loss
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0


@pytest.mark.parametrize("window_stores", [0, 3])
def test_backward_prefetch_stays_in_its_window_in_every_pass(engine: CopyEngine, window_stores: int) -> None:
    """Backward reloads at most ``prefetch_bytes`` ahead of the unpack (charged to the ledger),
    in the first pass and again in a retain_graph second pass; the results stay exact."""
    model, tokens = make_model()
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(tokens, frame)
    largest = max(s.nbytes for s in frame.offload_stores())
    h.runtime.residency.prefetch_bytes = window_stores * largest
    pending: List[Tuple[int, int]] = []  # (pass, bytes prefetched and not used) at each unpack
    passes = [0]
    h.runtime.residency.on_released_unpack.subscribe(lambda key, f=frame: pending.append((passes[0], f.prefetch_pending_bytes)))
    for passes[0] in (1, 2):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=passes[0] == 1)
        assert_bitwise(reference, (loss.detach(), [p.grad for p in model.parameters()]))
    assert len({p for p, _ in pending}) == 2
    assert all(b <= h.runtime.residency.prefetch_bytes for _, b in pending)
    for n in (1, 2):
        seen = [b for p, b in pending if p == n]
        assert (max(seen) > 0) == (window_stores > 0), f"pass {n}: pending bytes {seen[:10]}"
    del loss, frame
    assert h.runtime.ledger.resident == 0


def test_a_backward_prefetch_never_lifts_the_ledger_peak(engine: CopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch fills only room below the ledger's high-water mark since the forward began,
    less what the unpack itself reloads: backward's activation gradients sit beside the ledger,
    so a prefetch up to the budget would make a whole-memory peak the forward never showed. A
    wide window is still used (reloads run ahead), and the results stay exact."""
    model, tokens = make_model()
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    h.runtime.residency.prefetch_bytes = 1 << 40
    frame = Frame(default=Choice.OFFLOAD)
    loss = h.forward(tokens, frame)
    ledger, lifted, started = h.runtime.ledger, [], []
    prefetch = OffloadStore.prefetch

    def watched(store: OffloadStore, to: Any) -> bool:
        before = ledger.peak
        ok = prefetch(store, to)
        if ok:
            started.append(store.nbytes)
            if ledger.peak > before:
                lifted.append((store.key, before, ledger.peak))
        return ok

    monkeypatch.setattr(OffloadStore, "prefetch", watched)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert_bitwise(reference, (loss.detach(), [p.grad for p in model.parameters()]))
    assert started and not lifted, lifted[:5]
    del loss, frame
    assert ledger.resident == 0


@pytest.mark.parametrize("choice", list(Choice))
def test_graph_dropped_without_backward_frees_everything(engine: CopyEngine, choice: Choice) -> None:
    model, tokens = make_model()
    h = Harness(model, engine)
    loss = h.forward(tokens, Frame(default=choice))
    assert h.runtime.ledger.resident > 0 or choice != Choice.KEEP
    del loss
    h.runtime.residency.settle(wait=True)
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0


def test_many_micro_batches_in_flight(engine: CopyEngine) -> None:
    """Gradient accumulation with forward, forward, forward, backward, backward, backward."""
    model, tokens = make_model()
    batches = [tokens.roll(i, dims=1) for i in range(3)]
    h = Harness(model, engine)
    model.zero_grad(set_to_none=True)
    plain = [h.forward(b, None) for b in batches]
    for loss in reversed(plain):
        loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]

    model.zero_grad(set_to_none=True)
    plans = [Frame(default=Choice.OFFLOAD), Frame(default=Choice.RECOMPUTE), Frame(default=Choice.KEEP)]
    losses = [h.forward(b, f) for b, f in zip(batches, plans)]
    for loss in reversed(losses):
        loss.backward()
    for x, y in zip(reference, [p.grad for p in model.parameters()]):
        assert torch.equal(x, y)
    del losses, loss
    assert h.runtime.ledger.resident == 0
    assert engine.arena.stats()["in_use"] == 0


def test_arena_exhaustion_falls_back_without_loss() -> None:
    engine = CopyEngine(HostArena(4096))
    model, tokens = make_model()
    h = Harness(model, engine)
    reference = loss_and_grads(model, h.forward(tokens, None))
    frame = Frame(default=Choice.OFFLOAD)
    assert_bitwise(reference, loss_and_grads(model, h.forward(tokens, frame)))
    assert any("arena full" in f for f in frame.stats.fallbacks)
    assert engine.arena.stats()["num_failed"] > 0


def test_no_copy_engine_falls_back(keys: List[str]) -> None:
    model, tokens = make_model()
    h = Harness(model, None)
    reference = loss_and_grads(model, h.forward(tokens, None))
    frame = Frame(default=Choice.OFFLOAD)
    assert_bitwise(reference, loss_and_grads(model, h.forward(tokens, frame)))
    assert frame.stats.bytes_by_choice["offload"] == 0 and frame.stats.fallbacks


# -- accounting --------------------------------------------------------------------------------
def _saved_storages(model: torch.nn.Module, tokens: torch.Tensor) -> Dict[int, Tuple[int, Optional[str]]]:
    """Independent census: distinct non-parameter storages autograd saves in plain PyTorch."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Dict[int, Tuple[int, Optional[str]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = (s.nbytes(), None)
        return t

    torch.manual_seed(SEED)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens)
    loss.backward()
    return seen


def test_keep_all_high_water_equals_saved_bytes(engine: CopyEngine) -> None:
    model, tokens = make_model()
    expected = sum(n for n, _ in _saved_storages(model, tokens).values())
    h = Harness(model, engine)
    frame = Frame(default=Choice.KEEP)
    loss = h.forward(tokens, frame)
    assert frame.stats.peak_resident == expected
    assert h.runtime.ledger.resident == expected
    del loss
    assert h.runtime.ledger.resident == 0


class HandsEverySaveOver:
    """An untraced frame's pack hook (``CalmPack``'s signature) that keeps nothing itself."""

    packed = kept_bytes = shared_bytes = 0

    def __init__(self, ledger: object, residency: object, frame: Frame, fallback: Callable[[torch.Tensor], object]) -> None:
        self.fallback = fallback

    def __call__(self, t: torch.Tensor) -> object:
        return self.fallback(t)


@pytest.mark.parametrize("model_kind", ["moe", "views", "custom function"])
@pytest.mark.parametrize("budget_fraction", [None, 0.5])
def test_an_untraced_forward_counts_and_keeps_as_the_full_pack_does(
        engine: CopyEngine, model_kind: str, budget_fraction: Optional[float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An untraced frame's pack hook (``CalmPack``, C++) keeps what fits by a short way of its
    own; what it counts, keeps and (over the budget) offloads is what the full pack hook
    (``_pack``) does, bit for bit, and with no budget it never needs the full one. The one test
    that reaches the runtime's private steps: the short way is what it checks."""
    def build() -> Tuple[torch.nn.Module, torch.Tensor]:
        if model_kind == "moe":
            return make_model()
        torch.manual_seed(0)
        if model_kind == "views":
            return ViewsCastsShared(), torch.randn(32, 16)
        return WithCustomFunction(), torch.randn(64, 8)

    runs = []
    for full in (False, True):
        model, x = build()
        h = Harness(model, engine, reload_in_place=True)
        reference = loss_and_grads(model, h.forward(x, None))
        if budget_fraction is not None:
            probe = Frame(default=Choice.KEEP)
            h.forward(x, probe)
            h.runtime.residency.budget_bytes = int(probe.stats.peak_resident * budget_fraction)
        full_packs = [0]
        pack = h.runtime._pack

        def counted(t: torch.Tensor) -> object:
            full_packs[0] += 1
            return pack(t)

        # Looked up on the instance as a frame starts, and as the short way hands a save over.
        monkeypatch.setattr(h.runtime, "_pack", counted)
        if full:  # every save takes the full hook: the frame's pack hook hands each one over
            monkeypatch.setattr(activations, "CalmPack", HandsEverySaveOver)
        frame = Frame(default=Choice.KEEP)
        frame.traced = False
        loss = h.forward(x, frame)
        resident = h.runtime.ledger.resident
        assert_bitwise(reference, loss_and_grads(model, loss))
        del loss
        assert h.runtime.ledger.resident == 0
        stats = frame.stats
        runs.append((stats.packed, stats.bytes_by_choice, stats.shared_bytes, stats.peak_resident, stats.violations,
                     stats.fallbacks, resident))
        if budget_fraction is None and not full:
            assert full_packs[0] == 0
        h.close()
    assert runs[0] == runs[1]
    if budget_fraction is not None:
        assert runs[0][1]["offload"] > 0


def test_offloading_an_operator_lowers_resident_by_its_bytes(engine: CopyEngine, keys: List[str]) -> None:
    model, tokens = make_model()
    h = Harness(model, engine)
    frame = Frame(default=Choice.KEEP)
    loss = h.forward(tokens, frame)
    keep_all = h.runtime.ledger.resident
    del loss
    biggest = sorted(frame.keys_seen.items(), key=lambda kv: -kv[1])[:3]
    previous = keep_all
    chosen: Dict[str, Choice] = {}
    for key, nbytes in biggest:
        chosen[key] = Choice.OFFLOAD
        loss = h.forward(tokens, Frame(chosen))
        h.runtime.residency.settle(wait=True)
        assert h.runtime.ledger.resident == previous - nbytes, key
        previous = h.runtime.ledger.resident
        del loss
    assert previous < keep_all


def test_recompute_lowers_high_water(engine: CopyEngine) -> None:
    model, tokens = make_model()
    h = Harness(model, engine)
    peaks = {}
    for choice in Choice:
        frame = Frame(default=choice)
        loss = h.forward(tokens, frame)
        del loss
        peaks[choice] = frame.stats.peak_resident
    assert peaks[Choice.RECOMPUTE] < peaks[Choice.KEEP]
    assert peaks[Choice.OFFLOAD] < peaks[Choice.KEEP]


# -- errors and flags --------------------------------------------------------------------------
def test_plan_with_unknown_key_is_refused(keys: List[str]) -> None:
    model, tokens = make_model()
    h = Harness(model, None)
    typo = keys[0].replace(":0", ":7")
    with pytest.raises(ValueError, match="did you mean"):
        h.forward(tokens, Frame({typo: Choice.OFFLOAD}, strict=True))


def test_plan_with_non_choice_value_is_refused(keys: List[str]) -> None:
    with pytest.raises(TypeError, match="not a bagualu2.Choice"):
        Frame({keys[0]: "offload"})  # type: ignore[dict-item]


def test_recipe_input_modified_in_place_is_reported() -> None:
    weight = torch.randn(8, 8)  # a plain tensor from outside the traced forward

    class Uses(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ weight).exp().sum()

    x = torch.randn(4, 8, requires_grad=True)
    h = Harness(Uses(), None)
    loss = h.forward(x, Frame(default=Choice.RECOMPUTE))
    weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        loss.backward()


def test_saved_tensor_modified_in_place_is_refused() -> None:
    class Mutates(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            out = y.sum()
            y.mul_(2)
            return out + y.sum()

    x = torch.randn(4, 8, requires_grad=True)
    h = Harness(Mutates(), None)
    loss = h.forward(x, Frame(default=Choice.RECOMPUTE))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_block_input_written_in_place_after_it_was_read_is_rebuilt_as_read() -> None:
    """A block reads its input, then writes it in place; the read's result is recomputed. The
    input's anchor holds the storage as written: the rebuild must not take it for what was read."""
    class Writes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = x + 1  # recomputed: reads x as it entered
            x.add_(1)
            return (b @ self.w) * x.sigmoid()

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Writes(), Writes()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 1.0
            for block in self.blocks:
                x = block(x)
            return x.square().sum()

    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(4, 8)
    h = Harness(model, None)
    reference = loss_and_grads(model, h.forward(x, None))
    frame = Frame({"blocks.1:aten.add.Tensor:0": Choice.RECOMPUTE})
    assert_bitwise(reference, loss_and_grads(model, h.forward(x, frame)))
    assert frame.stats.bytes_by_choice["recompute"] > 0


def test_a_long_chain_without_blocks_is_rebuilt_without_deep_recursion(engine: CopyEngine) -> None:
    """No ModuleList, so no block input bounds a recompute chain: rebuilding the last storage
    replays 1,500 ops, far past Python's recursion limit were it done recursively."""
    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(500):
                x = (x * 1.0001 + 0.5).sin()
            return x.sum()

    model = Chain()
    x = torch.randn(8, 8, requires_grad=True)
    ref = torch.autograd.grad(model(x), x)[0]
    h = Harness(model, engine)
    got = torch.autograd.grad(h.forward(x, Frame(default=Choice.RECOMPUTE)), x)[0]
    assert torch.equal(ref, got)
    assert h.runtime.ledger.resident == 0


class Stack(torch.nn.Module):
    """``blocks`` (a ModuleList) applied in turn, then a scalar loss."""

    def __init__(self, *blocks: torch.nn.Module) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("choice", [Choice.RECOMPUTE, Choice.OFFLOAD])
def test_batch_norm_running_statistics_are_updated_once(engine: CopyEngine, choice: Choice) -> None:
    """``aten.native_batch_norm`` updates running_mean / running_var in place without its schema
    saying so: its outputs are never replayed (a replay would update the statistics again), and a
    recipe that reads one holds it instead."""
    torch.manual_seed(0)
    model = Stack(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2),
                                        torch.nn.GELU()) for _ in range(3)))
    plain = copy.deepcopy(model)
    h = Harness(model, engine)
    for i in range(3):
        x = torch.randn(8, 16)
        torch.manual_seed(SEED)  # as Harness.forward does: the same dropout masks
        ref = loss_and_grads(plain, plain(x))
        frame = Frame(default=choice)
        got = loss_and_grads(model, h.forward(x, frame))
        assert_bitwise(ref, got)
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), model.buffers()))
    if choice == Choice.RECOMPUTE:
        assert any("running statistics" in f for f in frame.stats.fallbacks)
    assert h.runtime.ledger.resident == 0


def test_profiling_a_long_chain_of_unsaved_storages_needs_no_deep_recursion() -> None:
    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(800):
                x = x * 1.0001 + 0.5  # ops with a scalar save nothing
            return x.sin().sum()

    h = Harness(Chain(), None)
    frame = Frame()
    frame.profile = True
    h.forward(torch.randn(4, 8, requires_grad=True), frame).backward()
    (key,) = frame.saved_profile  # sin saves its input, the last add's output
    assert key == ":aten.add.Tensor:799"
    assert len(frame.saved_profile[key][3]) == 1599  # every mul and add before it: rebuilt first
    assert len(frame.unsaved_seconds) == 1599


def untraced() -> Frame:
    frame = Frame()
    frame.traced = False
    return frame


def test_untraced_forward_over_budget_offloads_exactly_within_the_budget(engine: CopyEngine) -> None:
    model, tokens = make_model()
    plain = Harness(model, engine)
    ref = loss_and_grads(model, plain.forward(tokens, None))
    keep = untraced()
    plain.forward(tokens, keep)
    peak = keep.stats.peak_resident
    plain.close()
    h = Harness(model, engine)
    h.runtime.residency.budget_bytes = peak // 2
    frame = untraced()
    got = loss_and_grads(model, h.forward(tokens, frame))
    assert_bitwise(ref, got)
    assert frame.stats.violations == 0 and frame.stats.peak_resident <= peak // 2
    assert frame.stats.bytes_by_choice["offload"] > 0 and frame.stats.bytes_by_choice["recompute"] == 0
    assert any("untraced" in f for f in frame.stats.fallbacks)
    assert h.runtime.ledger.resident == 0 and engine.arena.stats()["in_use"] == 0


class TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu()).sin().sum()


@pytest.mark.parametrize("with_engine", [True, False])
def test_what_nothing_can_release_makes_room_by_offloading_an_earlier_micro_batch_s_keeps(with_engine: bool) -> None:
    """Two micro-batches in flight (gradient accumulation): the first kept everything, and the
    second's input, saved as it is (nothing can release it), does not fit. The first's kept
    storages are offloaded to make room: no violation, the high-water mark within the budget,
    the gradients exact. Without a copy engine the same input is a violation."""
    torch.manual_seed(0)
    model = TwoLinears()
    xs = [torch.randn(256, 64) for _ in range(2)]
    plain = copy.deepcopy(model)
    sum(plain(x) for x in xs).backward()
    engine = CopyEngine(HostArena(16 << 20)) if with_engine else None
    h = Harness(model, engine)
    h.runtime.residency.budget_bytes = 1 << 30
    first = Frame(default=Choice.KEEP)
    with h.runtime.frame(first):
        loss = model(xs[0])
    held = h.runtime.ledger.resident
    budget = held + xs[1].untyped_storage().nbytes() // 2
    h.runtime.residency.budget_bytes = budget
    h.runtime.ledger.reset_peak()
    second = Frame(default=Choice.OFFLOAD)
    with h.runtime.frame(second):
        loss = loss + model(xs[1])
    if not with_engine:
        assert second.stats.violations > 0
        return
    assert second.stats.violations == 0 and h.runtime.ledger.peak <= budget
    assert any("make room" in f for f in second.stats.fallbacks)
    loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
    del loss
    assert h.runtime.ledger.resident == 0 and engine.arena.stats()["in_use"] == 0


def test_untraced_offload_stores_a_storage_once_and_refuses_in_place_changes(engine: CopyEngine) -> None:
    class Saves(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()
            return (y.sin() + y[1:].cos().sum() + y.t().log1p().sum()).sum(), y

    x = torch.randn(64, 64, requires_grad=True)
    h = Harness(Saves(), engine)
    h.runtime.residency.budget_bytes = 0  # every save crosses it
    frame = untraced()
    loss, y = h.forward(x, frame)
    assert frame.stats.offloaded_storages == 1  # y's storage, saved by four ops, copied once
    assert frame.stats.shared_bytes == 3 * y.untyped_storage().nbytes()
    loss.backward(retain_graph=True)
    y.mul_(2)  # the saved tensor is still alive: its version shows the change
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_sparse_saved_tensor_is_kept_and_reported() -> None:
    class Sparse(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(x, self.w).sum()

    x = torch.randn(6, 8).relu().to_sparse().requires_grad_()
    h = Harness(Sparse(), None)
    frame = Frame(default=Choice.RECOMPUTE)
    h.forward(x, frame).backward()
    assert any("not a plain strided tensor" in f for f in frame.stats.fallbacks)


def test_is_recomputing_is_true_only_in_backward() -> None:
    seen: List[bool] = []
    x = torch.randn(4, requires_grad=True)
    y = x.exp()
    seen.append(bagualu2.is_recomputing())
    y.register_hook(lambda g: seen.append(bagualu2.is_recomputing()))
    y.sum().backward()
    assert seen == [False, True]


def test_nested_frames_are_refused() -> None:
    rt = ActivationRuntime(None)
    with rt.frame(Frame()):
        with pytest.raises(RuntimeError, match="inside another"):
            with rt.frame(Frame()):
                pass


def test_a_traced_storage_is_held_weakly() -> None:
    rt = ActivationRuntime(None)
    x = torch.randn(64, 64, requires_grad=True)
    with rt.frame(Frame()):
        y = x.exp()
        node = rt.mode.nodes[y.untyped_storage()._cdata]
        watch = StorageWeakRef(y.untyped_storage())
        with pytest.raises(TypeError, match="cannot be copied"):
            copy.deepcopy(node)  # a copy would free the node's weak handle twice
        y = None  # the graph, and with it the saved output, dies
        assert watch.expired(), f"the trace kept {node} alive"



def test_an_in_place_write_no_recipe_keeps_pins_nothing_it_reads() -> None:
    """An in-place op on an older storage that reads a newer one is recorded without its
    arguments, so the tensor from outside the forward it also reads is neither pinned nor
    counted: a frame counts as pinned only what its recipes hold (here the written storage,
    which ``tanh``'s recipe reads as it is)."""
    torch.manual_seed(0)
    rt = ActivationRuntime(None)
    lin = torch.nn.Linear(16, 16)
    rt.residency.set_parameters(lin.parameters())
    scale = torch.randn(16)
    frame = Frame()
    with rt.frame(frame):
        acc = torch.zeros(8, 16)
        h = lin(torch.randn(8, 16))
        with torch.no_grad():  # nothing saves ``scale``
            acc.addcmul_(h, scale)
        loss = (acc.tanh() * h).sum()
        assert rt.mode.nodes[acc.untyped_storage()._cdata].why_not.endswith("created after it")
    assert frame.stats.leaf_bytes == acc.untyped_storage().nbytes() and frame.stats.outside_bytes == 0
    # ``acc`` was made inside the forward: an untraced forward would not hold it for a recipe.
    assert frame.stats.traced_pin_bytes == acc.untyped_storage().nbytes()
    loss.backward()
    del loss
    assert rt.ledger.resident == 0

# -- whole-block rerun (Frame.rerun_blocks) ------------------------------------------------------
def rerun_frame() -> Frame:
    frame = Frame(default=Choice.RECOMPUTE)
    frame.rerun_blocks = True
    return frame


def count_block_calls(model: MoETransformer) -> List[int]:
    """Calls of each outermost block's forward (pre-hooks: a rerun stops after its last save)."""
    calls = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rerun_blocks_are_exact_untraced_and_rerun_once_per_backward_pass(dtype: torch.dtype) -> None:
    """Dropout on: the rerun restores the forward's RNG state. The blocks' ops are not traced
    (no keys under ``layers.``); what is saved outside them is, and keeps its choices."""
    model, tokens = make_model(dtype)
    h = Harness(model, None)
    h.trace_blocks(tokens)
    reference = loss_and_grads(model, h.forward(tokens, None))
    calls = count_block_calls(model)
    frame = rerun_frame()
    loss = h.forward(tokens, frame)
    assert calls == [1, 1] and frame.stats.rerun_blocks == 2
    assert frame.keys_seen and not [k for k in frame.keys_seen if k.startswith("layers.")]
    assert frame.stats.bytes_by_choice["recompute"] > 0
    for n in (1, 2):  # retain_graph: the second pass reruns each block again
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=n == 1)
        assert_bitwise(reference, (loss.detach(), [p.grad for p in model.parameters()]))
        assert calls == [1 + n, 1 + n]
    del loss
    assert h.runtime.ledger.resident == 0


def test_rerun_blocks_hold_only_the_blocks_inputs() -> None:
    """The ledger's high-water mark: what the frame keeps outside the blocks plus each block's
    held input, far below keeping everything; a graph dropped unpacked frees it all."""
    model, tokens = make_model()
    h = Harness(model, None)
    h.trace_blocks(tokens)
    keep = Frame(default=Choice.KEEP)
    h.forward(tokens, keep)
    frame = rerun_frame()
    frame.after_blocks = Choice.KEEP
    loss = h.forward(tokens, frame)
    held = h.runtime.ledger.resident
    outside = frame.stats.bytes_by_choice["keep"]
    block_input_bytes = len(model.layers) * tokens.numel() * model.cfg.hidden_size * 4
    assert held <= outside + block_input_bytes + frame.stats.leaf_bytes
    assert frame.stats.peak_resident < keep.stats.peak_resident / 3
    del loss
    assert h.runtime.ledger.resident == 0


def test_rerun_blocks_with_other_frames_in_flight(engine: CopyEngine) -> None:
    """Forward, forward, forward, backward, backward, backward; rerun frames beside traced ones."""
    model, tokens = make_model()
    batches = [tokens.roll(i, dims=1) for i in range(3)]
    h = Harness(model, engine)
    h.trace_blocks(tokens)
    model.zero_grad(set_to_none=True)
    for loss in reversed([h.forward(b, None) for b in batches]):
        loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    frames = [rerun_frame(), Frame(default=Choice.OFFLOAD), rerun_frame()]
    losses = [h.forward(b, f) for b, f in zip(batches, frames)]
    for loss in reversed(losses):
        loss.backward()
    assert all(torch.equal(x, y) for x, y in zip(reference, [p.grad for p in model.parameters()]))
    del losses, loss
    assert h.runtime.ledger.resident == 0 and engine.arena.stats()["in_use"] == 0


def test_a_block_that_runs_differently_when_rerun_is_an_error() -> None:
    """A routing override left before backward: the rerun routes otherwise, saves tensors of
    other sizes, and the unpack says which block and what to do instead of returning them."""
    model, tokens = make_model()
    h = Harness(model, None)
    h.trace_blocks(tokens)
    with model.routing_spike(2.0, experts=(0,)):
        loss = h.forward(tokens, rerun_frame())
    with pytest.raises(RuntimeError, match=r"block layers\.1 saved .* when rerun in backward"):
        loss.backward()


def test_a_block_input_modified_in_place_is_refused() -> None:
    model, tokens = make_model()
    h = Harness(model, None)
    h.trace_blocks(tokens)
    inputs: List[torch.Tensor] = []
    model.layers[1].register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
    loss = h.forward(tokens, rerun_frame())
    with torch.no_grad():
        inputs[0].mul_(2)
    with pytest.raises(RuntimeError, match=r"input 0 of block layers\.1 .* modified|modified by an inplace"):
        loss.backward()


def test_a_block_holding_running_statistics_is_traced_not_rerun() -> None:
    """A rerun would update batch norm's running statistics twice: such blocks are recomputed
    op by op instead, and the statistics match plain PyTorch's."""
    torch.manual_seed(0)
    model = Stack(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU()),
                  torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.GELU()))
    plain = copy.deepcopy(model)
    h = Harness(model, None)
    x = torch.randn(8, 16)
    h.trace_blocks(x)
    torch.manual_seed(SEED)
    ref = loss_and_grads(plain, plain(x))
    frame = rerun_frame()
    got = loss_and_grads(model, h.forward(x, frame))
    assert_bitwise(ref, got)
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), model.buffers()))
    assert frame.stats.rerun_blocks == 1 and any(k.startswith("blocks.0.") for k in frame.keys_seen)


def test_gate_callbacks_see_the_rerun_as_a_recompute() -> None:
    model, tokens = make_model()
    h = Harness(model, None)
    h.trace_blocks(tokens)
    seen: List[bool] = []
    model.layers[0].moe.router.register_forward_hook(lambda *a: seen.append(recipes.is_recomputing()))
    loss_and_grads(model, h.forward(tokens, rerun_frame()))
    assert seen == [False, True]


def test_an_exception_inside_a_rerun_block_leaves_the_runtime_usable() -> None:
    model, tokens = make_model()
    h = Harness(model, None)
    h.trace_blocks(tokens)
    reference = loss_and_grads(model, h.forward(tokens, None))

    def fail(mod: torch.nn.Module, args: tuple) -> None:
        raise ValueError("injected")

    handle = model.layers[1].moe.register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="injected"):
        h.forward(tokens, rerun_frame())
    handle.remove()
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert_bitwise(reference, loss_and_grads(model, h.forward(tokens, rerun_frame())))
    assert h.runtime.ledger.resident == 0
