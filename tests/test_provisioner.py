"""bagualu2.enable: budget held through spikes, exactness, errors, safety net (invariants 1, 2, 5)."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import statistics
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bagualu2
from bagualu2.runtime import ActivationRuntime, Budget, Frame
from bagualu2.runtime.tracing import module_of
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.runtime.gates import counts_from_indices

BATCH = (2, 32)


def make_model(**overrides) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(dropout=0.1, **overrides))


def tokens_for(model: MoETransformer, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, model.cfg.vocab_size, BATCH, generator=g)


def step(model: MoETransformer, i: int, spike: float = 0.0) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(i)
    if spike:
        with model.routing_spike(spike, experts=(0,)):
            loss = model(tokens_for(model, i))
            loss.backward()
    else:
        loss = model(tokens_for(model, i))
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def keep_all_peak(model: MoETransformer, spike: float = 0.0) -> int:
    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    step(probe, 0, spike)
    return prov.report()["peak_bytes"]


def test_adaptive_is_bit_exact_and_holds_the_budget_through_spikes() -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    budget = int(keep_all_peak(model) * 0.7)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    trace = [0.0, 0.0, 0.0, 2.6, 0.0, 2.6, 2.6, 0.0]
    for i, spike in enumerate(trace):
        ref = step(plain, i, spike)
        got = step(model, i, spike)
        assert torch.equal(ref[0], got[0])
        assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    report = prov.report()
    assert report["violations"] == 0
    assert report["peak_bytes"] <= budget
    assert report["decisions"] > 0
    assert report["resident_bytes"] == 0 and report["arena_in_use_bytes"] == 0
    assert report["saved_bytes_by_choice"]["offload"] + report["saved_bytes_by_choice"]["recompute"] > 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.8, 2.6]), min_size=3, max_size=6),
       fraction=st.floats(min_value=0.45, max_value=0.95))
def test_budget_never_exceeded_on_random_spike_traces(trace: Sequence[float], fraction: float) -> None:
    model = make_model(ep_size=4)
    budget = int(keep_all_peak(model, spike=2.6) * fraction)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    for i, spike in enumerate(trace):
        step(model, i, spike)
        assert prov.runtime.ledger.peak <= budget, "through backward too"  # reset as each forward starts
    for mb in prov.telemetry.micro_batches:
        assert mb.peak_bytes <= budget, mb
        assert mb.violations == 0
    assert prov.report()["peak_bytes"] <= prov.report()["peak_bytes_with_backward"] <= budget
    assert prov.report()["resident_bytes"] == 0


def accumulate(model: MoETransformer, i: int, spikes: Sequence[float]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One step of gradient accumulation: a forward per entry of ``spikes`` (its routing
    spike, 0 for none), all of them before the backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(i)
    loss = torch.zeros(())
    for j, spike in enumerate(spikes):
        with model.routing_spike(spike, experts=(0,)) if spike else contextlib.nullcontext():
            loss = loss + model(tokens_for(model, 10 * i + j))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.lists(st.sampled_from([0.0, 0.0, 1.8, 2.6]), min_size=1, max_size=3), min_size=2, max_size=4),
       fraction=st.floats(min_value=0.45, max_value=0.95))
def test_budget_never_exceeded_with_micro_batches_in_flight(steps: Sequence[Sequence[float]], fraction: float) -> None:
    """Gradient accumulation of 1 to 3 micro-batches per step, with random spikes, under a
    budget that is a fraction of one spiked micro-batch's all-keep peak (what the micro-batches
    cannot release fits many times over): bit-exact, and never over the budget."""
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    budget = int(keep_all_peak(model, spike=2.6) * fraction)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    for i, spikes in enumerate(steps):
        ref, got = accumulate(plain, i, spikes), accumulate(model, i, spikes)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
        assert prov.runtime.ledger.peak <= budget, "the last forward and the backward"
    for mb in prov.telemetry.micro_batches:
        assert mb.peak_bytes <= budget and mb.violations == 0, mb
    assert prov.report()["resident_bytes"] == 0


def test_the_budget_has_one_owner_and_each_forward_carries_its_share() -> None:
    """The provisioner owns the budget; a forward never changes the runtime's (it hands its
    frame a ``Budget``: the limit, the reserve for micro-batches stacking behind it, the pin
    headroom), so nothing is restored after it, even when a forward raises."""
    model = make_model(ep_size=4)
    budget = int(keep_all_peak(model, spike=2.6) * 0.6)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    seen = []
    prov.runtime.frame_observer = lambda frame: seen.append((frame.budget, prov.runtime.budget_bytes))
    for i, spikes in enumerate([[0.0, 2.6, 0.0], [2.6]]):
        accumulate(model, i, spikes)
        assert prov.runtime.budget_bytes == budget
    assert all(b is not None and b.limit == budget and rt == budget for b, rt in seen)
    assert any(b.reserve > 0 for b, _ in seen), "micro-batches stacked behind the first ones"
    with pytest.raises(ValueError, match="budget=-1 bytes"):
        prov.budget = -1
    prov.budget = budget // 2
    assert prov.runtime.budget_bytes == budget // 2


@pytest.mark.parametrize("limit_over_bytes, reserve_over_bytes, violations",
                         [(2.0, 2.0, 0), (1.5, 0.0, 0), (0.5, 0.0, 1), (0.5, 1.0, 1)])
def test_a_forward_violates_only_its_limit_not_its_reserve(limit_over_bytes, reserve_over_bytes, violations) -> None:
    """Releases aim at the limit less the reserve; only crossing the limit itself is a violation
    (an input saved from outside the forward, which nothing can release, decides here)."""
    x = torch.randn(4096, requires_grad=True)
    nbytes = x.untyped_storage().nbytes()
    rt = ActivationRuntime(budget_bytes=None)
    frame = Frame()
    frame.budget = Budget(int(limit_over_bytes * nbytes), int(reserve_over_bytes * nbytes))
    with rt.frame(frame):
        y = (x * x).sum()
    assert frame.stats.violations == violations
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach())


@pytest.mark.parametrize("policy", ["recompute_all", "offload_all", "adaptive"])
def test_exact_under_autocast(policy: str) -> None:
    """Mixed precision as users train with it: replays run below autocast with the dtypes it
    chose in the forward, so bf16 losses and gradients stay bitwise those of plain PyTorch."""
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    budget = int(keep_all_peak(model) * 0.6) if policy == "adaptive" else None
    prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0)
    for i in range(4):
        out = []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(tokens_for(m, i))
            loss.float().backward()
            out.append((loss.detach(), [p.grad for p in m.parameters()]))
        assert torch.equal(out[0][0], out[1][0])
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    released = prov.report()["saved_bytes_by_choice"]
    assert released["offload"] + released["recompute"] > 0 and prov.report()["violations"] == 0


def test_forwards_without_grad_are_not_provisioned_and_teach_the_cost_model_nothing() -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    budget = int(keep_all_peak(model) * 0.6)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    with torch.no_grad():  # validation before training
        model(tokens_for(model, 0))
    with torch.inference_mode():
        model(tokens_for(model, 1))
    assert prov.cost.frames == 0 and not prov.telemetry.micro_batches
    for i, spike in enumerate([0.0, 0.0, 0.0, 0.0, 2.6, 0.0]):
        ref, got = step(plain, i, spike), step(model, i, spike)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    # profiled from training forwards (the second decides; then two measure replays)
    assert prov.cost.ops and prov.report()["decisions"] >= 2 * 2
    assert prov.report()["saved_bytes_by_choice"]["recompute"] > 0


@pytest.mark.parametrize("order", ["enable, then compile", "compile, then enable"])
def test_a_compiled_model_is_provisioned_eagerly_and_exactly(order: str) -> None:
    """torch.compile of an enabled model, or enable() of a compiled one (the module it wraps
    is provisioned): the provisioned forward runs eagerly (Dynamo would graph-break and
    recompile at every op of the tracing mode and hooks), still releasing."""
    import torch._dynamo

    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    if order == "enable, then compile":
        prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0)
        compiled = torch.compile(model, backend="eager")
    else:
        compiled = torch.compile(model, backend="eager")
        prov = bagualu2.enable(compiled, budget=None, policy="recompute_all", min_bytes=0)
        assert prov.model is model
    torch._dynamo.utils.counters.clear()
    for i in range(2):
        ref, got = step(plain, i), step(compiled, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert prov.report()["saved_bytes_by_choice"]["recompute"] > 0
    assert sum(torch._dynamo.utils.counters["frames"].values()) == 0
    torch._dynamo.reset()


def test_importing_bagualu2_leaves_torch_dynamo_unimported() -> None:
    """``import bagualu2`` stays fast (about 0.05 s): Dynamo (about 1 s to import) is loaded at
    the first enable(), where the provisioned forward is hidden from it."""
    import subprocess
    import sys

    code = "import sys, bagualu2, bagualu2.cli; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_an_enabled_model_is_a_plain_model_of_its_own(how: str) -> None:
    """An EMA or teacher copy (``copy.deepcopy``) or a saved whole module: it computes with its
    own parameters, not through the original's provisioner, and can be enabled itself."""
    model = make_model(ep_size=4)
    prov = bagualu2.enable(model, budget=int(keep_all_peak(model) * 0.7), min_bytes=0)
    step(model, 0)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    reference = copy.deepcopy(twin)  # a deep copy of the copy: plain as well
    seen = prov.report()["micro_batches"]
    got, want = step(twin, 1), step(reference, 1)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert not torch.equal(got[0], step(model, 1)[0])  # not the original's parameters
    assert prov.report()["micro_batches"] == seen + 1  # only the original's own step
    again = bagualu2.enable(twin, budget=None, policy="recompute_all", min_bytes=0)
    step(twin, 2)
    assert again.report()["saved_bytes_by_choice"]["recompute"] > 0
    again.disable()
    assert "forward" not in twin.__dict__


def test_keep_all_with_raise_reports_what_would_have_crashed() -> None:
    model = make_model(ep_size=4)
    budget = int(keep_all_peak(model) * 0.7)
    bagualu2.enable(model, budget=budget, policy="keep_all", on_exceed="raise", min_bytes=0)
    with pytest.raises(bagualu2.BudgetExceededError, match="exceed the budget") as info:
        step(model, 0)
    assert info.value.budget == budget and info.value.resident > budget


def test_recompute_all_reruns_its_blocks_and_keeps_what_the_model_saves_after_them() -> None:
    """recompute_all reruns each block whole in backward, as checkpointing every layer does:
    the blocks run untraced. Backward reads first what the model saves after its last block
    (the final norm's input, the logits, the loss's log-softmax): released, it would be
    rebuilt at once, rerunning the last block with it while everything else held is still
    resident. recompute_all keeps it, releases what is saved before the blocks (the embedding's
    dropout mask), and backward rebuilds nothing after the blocks."""
    model = make_model()
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0)
    frames: List = []
    prov.runtime.frame_observer = frames.append
    prov.runtime.backward_observer = None  # what backward rebuilt is read here
    for i in range(2):  # the first traces the blocks: a block is rerun once known to issue no collective
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    first, frame = frames
    assert first.stats.rerun_blocks == 0 and frame.stats.rerun_blocks == model.cfg.num_layers
    order = list(frame.keys_seen)  # first-save order
    assert not [k for k in order if k.startswith("layers.")]
    after = order[next(i for i, k in enumerate(order) if module_of(k) == "norm"):]
    assert {module_of(k) for k in after} == {"norm", ""}, after  # lm_head saves what norm made
    assert [k for k in order if frame.choice(k) == bagualu2.Choice.KEEP] == after
    before = [k for k in order if k not in after]
    assert any(k.startswith("drop:") for k in before)
    assert all(frame.choice(k) == bagualu2.Choice.RECOMPUTE for k in before)
    rebuilt = prov.runtime.take_replay_times()
    assert rebuilt and set(rebuilt) <= set(before)
    assert prov.report()["saved_bytes_by_choice"]["keep"] >= sum(frame.keys_seen[k] for k in after)
    report = prov.report()  # backward holds a block's rerun saves beside the blocks' inputs
    assert report["peak_bytes_with_backward"] > 2 * report["peak_bytes"]


@pytest.mark.parametrize("policy", ["recompute_all", "offload_all"])
def test_static_baselines_are_exact_and_release_everything(policy: str) -> None:
    """Everything but the head's saves, for recompute_all (the test above)."""
    model = make_model()
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy=policy, min_bytes=0)
    ref, got = step(plain, 0), step(model, 0)
    assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    mix = prov.report()["saved_bytes_by_choice"]
    released = "recompute" if policy == "recompute_all" else "offload"
    assert mix[released] > 5 * mix["keep"]  # the tiny model's head (its logits) is large


def test_fixed_plan_policy() -> None:
    model = make_model()
    probe = bagualu2.enable(copy.deepcopy(model), budget=10**9, min_bytes=0)
    key = "layers.0.moe.experts.0.gate_proj:aten.mm.default:0"
    plan = {key: bagualu2.Choice.RECOMPUTE}
    prov = bagualu2.enable(model, budget=None, policy=plan, min_bytes=0)
    step(model, 0)
    assert prov.report()["saved_bytes_by_choice"]["recompute"] > 0
    del probe


def test_impossible_budget_is_refused_before_the_micro_batch() -> None:
    model = make_model()
    tokens = tokens_for(model, 0)
    budget = tokens.untyped_storage().nbytes() // 2  # less than the input the recipes must hold
    prov = bagualu2.enable(model, budget=budget)
    step(model, 0)  # profiles; the runtime records what it could not release
    assert prov.report()["violations"] >= 1
    resident_before = prov.runtime.ledger.resident
    with pytest.raises(bagualu2.InfeasibleBudgetError, match="raise the budget to at least"):
        step(model, 1)
    assert prov.runtime.ledger.resident == resident_before


def test_a_tight_budget_is_not_refused_while_releasing_small_activations_meets_it() -> None:
    """min_bytes is a preference: small activations are kept unless the budget needs their
    room, so a budget that only releasing them can meet is met, not refused."""
    model = make_model()
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=4096, min_bytes=1 << 20)
    for i in range(3):
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    report = prov.report()
    assert report["violations"] == 0 and report["peak_bytes"] <= 4096


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(budget="lots"), ValueError, "use 'auto'"),
    (dict(budget=-5), ValueError, "must be positive"),
    (dict(budget=1.5), ValueError, r"fraction must be in \(0, 1\]"),
    (dict(budget=True), TypeError, "budget must be"),
    (dict(policy="fastest"), ValueError, "use one of"),
    (dict(on_exceed="explode"), ValueError, "on_exceed"),
    (dict(profile_frames=0), ValueError, "profile_frames"),
    (dict(calibrate_frames=-1), ValueError, "calibrate_frames=-1"),
    (dict(recalibrate_every=-5), ValueError, "recalibrate_every=-5"),
])
def test_bad_arguments_name_the_value(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        bagualu2.enable(make_model(), **kwargs)


def test_not_a_module_and_double_enable() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        bagualu2.enable(lambda x: x)  # type: ignore[arg-type]
    model = make_model()
    bagualu2.enable(model, budget=None)
    with pytest.raises(RuntimeError, match="already has bagualu2"):
        bagualu2.enable(model, budget=None)


def test_disable_restores_the_model() -> None:
    model = make_model()
    plain = copy.deepcopy(model)
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    prov = bagualu2.enable(model, budget=None)
    prov.disable()
    assert "forward" not in model.__dict__
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    ref, got = step(plain, 0), step(model, 0)
    assert torch.equal(ref[0], got[0])
    assert prov.report()["micro_batches"] == 0
    # A forward provisioned before disable still unpacks through the runtime in backward, and
    # the provisioner, gone, learns nothing from it.
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0)
    loss = model(tokens_for(model, 0))
    prov.disable()
    loss.backward()
    assert prov.runtime.take_replay_times() and prov.cost.learning_seconds("replays", 100) == 0.0


class _OOMOnce(torch.nn.Module):
    """Fault injection: the first call raises the error a device raises when memory runs out."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fired:
            self.fired = True
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
        return x


def test_oom_safety_net_reruns_the_micro_batch_exactly() -> None:
    model = make_model()
    plain = copy.deepcopy(model)
    block = model.layers[1]
    injector = _OOMOnce()
    block.register_forward_pre_hook(lambda m, args: (injector(args[0]),))
    prov = bagualu2.enable(model, budget=None, min_bytes=0)
    ref, got = step(plain, 0), step(model, 0)
    assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    report = prov.report()
    assert report["oom_recoveries"] == 1
    assert prov.telemetry.micro_batches[-1].oom_recovered
    assert report["resident_bytes"] == 0


def test_a_rerun_block_is_called_again_with_the_arguments_before_its_pre_hooks() -> None:
    """A block rerun in backward (``recompute_all``) is called as the forward called it, so a
    pre-hook that changes its input runs once per call, whether registered before or after
    ``enable``."""
    def scaled(m: torch.nn.Module, args: tuple) -> tuple:
        return (args[0] * 1.5,)

    model = make_model()
    model.layers[0].register_forward_pre_hook(scaled)
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0)
    model.layers[1].register_forward_pre_hook(scaled)
    plain.layers[1].register_forward_pre_hook(scaled)
    for i in range(2):
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert prov.report()["saved_bytes_by_choice"]["recompute"] > 0


def test_gate_calls_during_checkpoint_recompute_are_ignored() -> None:
    model = make_model()
    original = model.layers[0].forward
    model.layers[0].forward = lambda x: torch.utils.checkpoint.checkpoint(original, x, use_reentrant=False)
    budget = int(keep_all_peak(make_model()) * 0.8)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    fired: List[bool] = []
    model.layers[0].moe.router.register_forward_hook(lambda *a: fired.append(bagualu2.is_recomputing()))
    step(model, 0)
    step(model, 1)
    assert fired.count(True) == 2  # the checkpoint reran the router in each backward
    decisions = [d for d in prov.telemetry.decisions if d.layer == 0]
    assert len(decisions) == 1  # micro-batch 1 only (0 profiles); recompute calls were skipped


class TinyMoE(torch.nn.Module):
    """A MoE layer the discovery does not know, reporting its own routing."""

    def __init__(self, use_on_gating: bool) -> None:
        super().__init__()
        self.use_on_gating = use_on_gating
        self.router = torch.nn.Linear(16, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def route(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x).argmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = self.route(x)
        if self.use_on_gating:
            bagualu2.on_gating(torch.bincount(idx, minlength=4), layer=0)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            out = out + expert(x * mask.unsqueeze(-1)).relu()
        return out.pow(2).mean()


@pytest.mark.parametrize("use_on_gating", [True, False])
def test_unknown_moe_layers_via_on_gating_or_register_gate(use_on_gating: bool) -> None:
    torch.manual_seed(0)
    model = TinyMoE(use_on_gating)
    x = torch.randn(64, 16)
    if use_on_gating:
        prov = bagualu2.enable(model, budget=10**6, min_bytes=0, gates=[])
    else:
        with pytest.warns(UserWarning, match="no MoE gate found"):
            prov = bagualu2.enable(model, budget=10**6, min_bytes=0)
        router = model.router
        prov.register_gate(router, num_experts=4,
                           counts_fn=lambda m, a, out: torch.bincount(out.argmax(-1), minlength=4))
    for _ in range(3):
        model(x).backward()
    assert prov._count_frames.get(0) == 3
    assert prov.mean_counts()[0] and sum(prov.mean_counts()[0]) == 64
    with pytest.raises(ValueError, match="num_experts"):
        prov.register_gate(model.router, num_experts=0, counts_fn=counts_from_indices(4))


def test_the_arena_is_reserved_for_offloads_once_profiling_shows_their_size(monkeypatch) -> None:
    """At enable the arena is small (how large activations get is not known yet); after the
    profiled micro-batches it holds the micro-batches in flight (two at least) at the worst
    routing less the budget, when the policy may offload, and is left alone when it never will
    or the user sized it."""
    start = 9 << 20  # the copy-cost probes at enable offload 8 MiB
    monkeypatch.setattr(bagualu2.provisioner, "_ARENA_START_BYTES", start)
    model = make_model(ep_size=4)
    tokens = torch.randint(0, model.cfg.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))

    def run(budget, policy="adaptive", stacked=None, **options) -> "bagualu2.Provisioner":
        own = copy.deepcopy(model)
        prov = bagualu2.enable(own, budget=budget, policy=policy, min_bytes=0, **options)
        assert prov.engine.arena.capacity == options.get("arena_bytes", start)
        if stacked is not None:  # a pipeline rank in warm-up: that many forwards stack on each
            prov.set_pipeline_phase("warmup", stacked)
        for _ in range(prov.profile_frames):
            own(tokens).backward()
        assert prov._worst_bytes is not None
        return prov

    ample = run(1 << 40)
    assert ample.engine.arena.capacity == start, "nothing to offload: nothing reserved"
    assert ample.report()["arena_capacity_bytes"] == start
    budget = int(ample.report()["peak_bytes"] * 0.6)
    need = 2 * ample._worst_bytes - budget
    assert need > start
    tight = run(budget)
    assert tight.engine.arena.capacity >= need and tight.report()["arena_capacity_bytes"] == tight.engine.arena.capacity
    four = 4 * ample._worst_bytes - budget  # three more micro-batches in flight on a pipeline rank
    assert run(budget, stacked=3).engine.arena.capacity >= four > need
    assert run(None, policy={}).engine.arena.capacity == start, "a fixed plan without offloads never offloads"
    offloads = {key: bagualu2.Choice.OFFLOAD for key in ample.cost.ops}
    assert run(None, policy=offloads).engine.arena.capacity >= 2 * ample._worst_bytes
    # An arena the user sized (large enough for what the profiled micro-batches offload) is
    # left as it is, though it is less than the reservation would be.
    assert run(budget, arena_bytes=start).engine.arena.capacity == start


def test_calm_micro_batches_count_the_inputs_they_save() -> None:
    """A micro-batch holds the inputs it saves besides its operators' activations: an untraced
    one's predicted high-water mark includes them (exactly, with one MoE layer, whose gate
    knows all the routing), and one whose activations fit only without them is not calm."""
    model = make_model(num_layers=1)
    prov = bagualu2.enable(model, budget=1 << 40, min_bytes=0)
    for i in range(4):
        step(model, i)
    calm = [m for m in prov.telemetry.micro_batches if not m.traced]
    assert calm and all(m.predicted_peak_bytes == m.peak_bytes for m in calm)
    inputs = prov._outside_held
    assert inputs == tokens_for(model, 0).nbytes  # the token ids the embedding saves
    # Room for the last routing's activations, but not with the inputs as well.
    recent = prov._last_bytes
    prov.budget = int((recent + inputs // 2) / (1 - prov.margin)) + 1
    assert prov._worst_bytes > recent + inputs
    step(model, 4)
    assert prov.telemetry.micro_batches[-1].traced, "taken for calm: the inputs were not counted"


def test_report_telemetry_and_plot(tmp_path) -> None:
    model = make_model(ep_size=4)
    budget = int(keep_all_peak(model) * 0.7)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, telemetry_path=tmp_path / "t.jsonl")
    for i, spike in enumerate([0.0, 0.0, 2.6]):
        step(model, i, spike)
    report = prov.report()
    for key in ("steps", "micro_batches", "peak_bytes", "budget_bytes", "saved_bytes_by_choice",
                "decision_latency_us", "violations"):
        assert key in report
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    kinds = {line["kind"] for line in lines}
    assert kinds == {"decision", "micro_batch"}
    decision = next(line for line in lines if line["kind"] == "decision")
    for key in ("step", "micro_batch", "layer", "imbalance", "predicted_bytes", "budget_bytes", "mix",
                "latency_us"):
        assert key in decision
    png = prov.plot(tmp_path / "memory.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_telemetry_keeps_a_bounded_window_in_memory_and_totals_of_the_whole_run(tmp_path) -> None:
    from bagualu2.telemetry import Decision, MicroBatch, Telemetry

    tel = Telemetry(tmp_path / "t.jsonl", keep=5)
    for i in range(23):
        tel.add(MicroBatch(step=i, micro_batch=i, peak_bytes=100 + i, predicted_peak_bytes=0, budget_bytes=None,
                           imbalance=1.0, bytes_by_choice={"keep": 1, "offload": 2, "recompute": 3},
                           violations=i % 2, fallbacks=1, forward_seconds=0.0, traced=i < 4, room_made_bytes=7))
        tel.add(Decision(step=i, micro_batch=i, layer=0, imbalance=1.0, resident_bytes=0, predicted_bytes=0,
                         planned_bytes=0, budget_bytes=None, mix={}, latency_us=float(i)))
    assert 5 <= len(tel.micro_batches) < 10 and tel.micro_batches[-1].step == 22
    assert 5 <= len(tel.decisions) < 10
    t = tel.totals
    assert (t.micro_batches, t.traced, t.peak_bytes, t.violations, t.fallbacks, t.room_made_bytes) == (
        23, 4, 122, 11, 23, 161)
    assert t.bytes_by_choice == {"keep": 23, "offload": 46, "recompute": 69}
    assert (t.decisions, t.latency_us_sum, t.latency_us_max) == (23, sum(range(23)), 22.0)
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 46  # the file has every record


def test_the_first_micro_batches_a_plan_may_release_from_measure_what_replays_cost() -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=int(keep_all_peak(model) * 0.7), min_bytes=0, recalibrate_every=2)
    frames: List[bagualu2.runtime.Frame] = []
    prov.runtime.frame_observer = frames.append
    taken: Dict[int, Dict[str, Tuple[float, int, int, float, int]]] = {}  # micro-batch -> its backward's op replays
    take = prov.runtime.take_op_replay_times

    def take_noting() -> Dict[str, Tuple[float, int, int, float, int]]:
        times = take()  # as the last frame's backward ends, or as the next forward begins
        taken.setdefault(len(frames) - 1, {}).update(times)
        return times

    prov.runtime.take_op_replay_times = take_noting  # type: ignore[method-assign]
    anchored: set = set()  # block inputs, held for the recipes: no plan releases them
    model.norm.register_forward_hook(lambda *a: anchored.update(n.key for n in frames[-1]._anchors))
    for i in range(9):
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    mbs = prov.telemetry.micro_batches
    # three after profiling, and one after every two that decided
    assert [m.calibrating for m in mbs] == [False, False, True, True, True, False, False, True, False]
    # They release all they can and decide nothing (micro-batch 1 decided at both gates): the
    # first three recompute, and the recalibrations offload and recompute in turn (the copy
    # engine's costs, too, are learned from a micro-batch that offloads everything).
    calibrating = [f for f, m in zip(frames, mbs) if m.calibrating]
    assert all(f.stats.bytes_by_choice["recompute"] > 0 and f.stats.bytes_by_choice["offload"] == 0
               and f.stats.violations == 0 for f in calibrating[:3])
    offloading = calibrating[3].stats
    assert offloading.bytes_by_choice["recompute"] == 0 and offloading.violations == 0
    assert offloading.offloaded_storages == len(frames[7].keys_seen)  # one storage per op here
    assert offloading.bytes_by_choice["keep"] < 0.01 * offloading.bytes_by_choice["offload"]
    assert {d.micro_batch for d in prov.telemetry.decisions} == {1, 5, 6, 8}
    # With none asked for, none does: micro-batch 2 decides.
    other = bagualu2.enable(make_model(ep_size=4), budget=prov.budget, min_bytes=0, calibrate_frames=0)
    for i in range(3):
        step(other.model, i)
    assert not any(m.calibrating for m in other.telemetry.micro_batches)
    assert {d.micro_batch for d in other.telemetry.decisions} == {1, 2}
    # Read as micro-batch 5 began: every op the third one's backward replayed (the call of each
    # recomputable key that is no block input among them), inside a chain or as a rebuild's
    # first, which the cost model now prices as measured: the median of each call's replays
    # but its first (cold), the plans' included; a call always a rebuild's first, at its
    # replays as such.
    cost = prov.cost

    def op_of(key: str) -> "bagualu2.plan.cost_model.OpCost":
        return cost.ops.get(key) or cost.unsaved[key]

    known = {i: {k: v for k, v in times.items() if k in cost.ops or k in cost.unsaved} for i, times in taken.items()}
    calls = {op_of(k).call for k, v in known[4].items() if v[1] or v[4]}
    releasable = [k for k, op in cost.ops.items() if op.recomputable and k not in anchored]
    released = {cost.ops[k].call for k in releasable}
    counts = prov.mean_counts()
    assert anchored and released <= calls
    chained: Dict[str, List[float]] = {}  # call -> seconds of each of its timed replays in a chain
    led: Dict[str, List[float]] = {}  # ... as a rebuild's first
    for times in known.values():
        for key, (seconds, n, _, lead_seconds, leads) in times.items():
            if n:
                chained.setdefault(op_of(key).call, []).append(seconds / n)
            if leads:
                led.setdefault(op_of(key).call, []).append(lead_seconds / leads)
    only_led = released - set(chained)
    assert only_led and len(only_led) <= len(cost.rebuilds(releasable, counts)) < len(released) // 4
    for key in known[4]:
        op = op_of(key)
        if op.layer is None:  # driven by the micro-batch's size, the same in every micro-batch here
            replays = chained.get(op.call) or led[op.call]
            assert len(replays) >= 2
            # (mean_counts rounds each expert's mean: the micro-batch's size within a token)
            warm = statistics.median(replays[1:])
            assert cost.op_replay_seconds(op, counts) == pytest.approx(warm, rel=1e-2)


def recalibrating(calibrate_frames: int) -> Tuple[MoETransformer, MoETransformer, "bagualu2.Provisioner",
                                                List["bagualu2.runtime.Frame"]]:
    """A model, its plain copy, and its provisioner under 70% of the all-keep peak that
    recalibrates after every micro-batch that may release, with the list its frames go to."""
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=int(keep_all_peak(model) * 0.7), min_bytes=0,
                           calibrate_frames=calibrate_frames, recalibrate_every=1)
    frames: List[bagualu2.runtime.Frame] = []
    prov.runtime.frame_observer = frames.append
    return plain, model, prov, frames


def test_every_other_recomputing_recalibration_recomputes_half_so_rebuilds_are_learned_at_two_sizes() -> None:
    """Recalibrations that recompute replay all they can, then half of it (every other key in
    save order, the two halves in turn), so that what rebuilds and learning from them cost is
    measured at two sizes of plan, not only at the largest, from which the smaller plans' part
    that does not shrink with them cannot be told."""
    plain, model, prov, frames = recalibrating(calibrate_frames=0)
    for i in range(18):
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    mbs = prov.telemetry.micro_batches
    calibrating = [f for f, m in zip(frames, mbs) if m.calibrating]
    assert len(calibrating) == 8 and all(f.stats.violations == 0 for f in calibrating)
    recomputing = calibrating[1::2]  # between the ones that offload everything
    assert all(f.default == bagualu2.Choice.RECOMPUTE and f.stats.bytes_by_choice["recompute"] > 0
               for f in recomputing)
    order = prov.cost.order
    kept = [{k for k, c in f.choices.items() if c == bagualu2.Choice.KEEP} for f in recomputing]
    assert kept == [set(), set(order[0::2]), set(), set(order[1::2])]
    assert all(f.stats.bytes_by_choice["keep"] > 0 for f in (recomputing[1], recomputing[3]))
    # Learning from their rebuilds was measured at both sizes.
    assert len({x for x, _ in prov.cost._learning["replays"].samples}) >= 2


def test_recalibrations_recompute_and_offload_all_they_can_in_turn_and_teach_the_copy_costs() -> None:
    """With a copy engine, every other recalibration offloads everything: the copy costs are
    learned from one micro-batch's many offloads of every size, not only from the plans' few."""
    plain, model, prov, frames = recalibrating(calibrate_frames=1)
    observed: List[Tuple[int, int]] = []
    observe = prov.cost.observe_copies
    prov.cost.observe_copies = lambda s, c, n: observed.append((c, n)) or observe(s, c, n)  # type: ignore[method-assign]
    for i in range(10):
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    mbs = prov.telemetry.micro_batches
    assert [m.calibrating for m in mbs] == [False, False] + [True, False] * 4
    released = [max(("offload", "recompute"), key=f.stats.bytes_by_choice.__getitem__)
                for f, m in zip(frames, mbs) if m.calibrating]
    assert released == ["recompute", "offload", "recompute", "offload"]
    for f, m in zip(frames, mbs):
        if m.calibrating:
            assert f.stats.violations == 0
            assert f.stats.bytes_by_choice["keep"] < 0.01 * sum(f.stats.bytes_by_choice.values())
    # Each offloading calibration's copies (and reloads) were observed, as its backward ended.
    offloading = [f.stats for f, m in zip(frames, mbs) if m.calibrating and f.stats.offloaded_storages > 0
                  and f.stats.bytes_by_choice["recompute"] == 0]
    assert len(offloading) == 2
    assert all((s.offloaded_storages, s.bytes_by_choice["offload"]) in observed for s in offloading)
    assert max(c for c, _ in observed) == max(s.offloaded_storages for s in offloading)


@pytest.mark.parametrize("fraction", [0.3, 0.8])
def test_rebuilds_that_replayed_a_call_again_to_stay_under_the_budget_teach_the_ops_not_the_rebuilds(fraction) -> None:
    """Recomputing all it can under 30% of the all-keep peak, backward cannot keep what a rebuild
    made until it is read, and replays some ops dozens of times over: what each op costs is
    learned, the rebuilds that replayed such an op (which the cost model prices at one replay
    per op) are not, the others are. Under 80% each op replays once per micro-batch and every
    rebuild is learned."""
    model = make_model(ep_size=4)
    prov = bagualu2.enable(model, budget=int(keep_all_peak(model) * fraction), min_bytes=0, calibrate_frames=2)
    cost = prov.cost
    observe_ops, observe_rebuilds = cost.observe_op_replays, cost.observe_replays
    backwards: List[Dict[str, Any]] = []  # what each backward replayed, and what was learned from it

    def ops(times: Dict[str, Tuple[float, int, int]], counts: Any) -> None:
        backwards.append({"ops": dict(times)})
        observe_ops(times, counts)

    def rebuilds(replays: Dict[str, Tuple[float, int]], counts: Any) -> None:
        last = {k: op.replays[-1] if op.replays else None for k, op in cost.ops.items()}
        known = {k: v for k, v in replays.items() if k in cost.ops and v[1] > 0}
        backwards[-1]["micro_batches"] = max(n for _, n in known.values())
        backwards[-1]["entered"] = {entry: members for entry, members, _, _ in cost.rebuilds(known, counts)}
        observe_rebuilds(replays, counts)
        backwards[-1]["learned"] = {k for k, op in cost.ops.items() if op.replays and op.replays[-1] is not last[k]}

    cost.observe_op_replays = ops  # type: ignore[method-assign]
    cost.observe_replays = rebuilds  # type: ignore[method-assign]
    for i in range(prov.profile_frames + prov.calibrate_frames):
        step(model, i)
    assert [m.calibrating for m in prov.telemetry.micro_batches] == [False, False, True, True]
    assert cost._op_replays  # the second (warm) calibrating backward's, observed as it ended
    warm = backwards[-1]  # its calls all replayed before (none cold)
    once = warm["micro_batches"]
    repeated = {(cost.ops.get(k) or cost.unsaved[k]).call for k, (*_, n) in warm["ops"].items()
                if n > once and (k in cost.ops or k in cost.unsaved)}

    def calls(members: List[str]) -> set:
        return {cost.ops[m].call for m in members} | {
            cost.unsaved[u].call for m in members for u in cost.ops[m].unsaved_inputs if u in cost.unsaved}

    clean = {entry for entry, members in warm["entered"].items() if not calls(members) & repeated}
    assert warm["learned"] == clean
    if fraction < 0.5:
        assert max(n for *_, n in warm["ops"].values()) > 10 * once
        assert clean != set(warm["entered"])  # some rebuilds replayed a call again
    else:
        assert not repeated and clean == set(warm["entered"]) and cost._replay_fit.observed


def test_last_plan_is_what_the_last_planning_micro_batch_ran() -> None:
    """The plan an adaptive micro-batch's gates left, run again as a static plan on the same
    batch, recomputes the same bytes and offloads what it offloaded but the storages the
    runtime offloaded beyond the plan to stay under the budget (its fallbacks). Before any
    micro-batch planned (the profiling and calibrating ones do not), there is none."""
    model = make_model(ep_size=4)
    prov = bagualu2.enable(model, budget=int(keep_all_peak(model) * 0.6), min_bytes=0, calibrate_frames=2)
    for i in range(prov.profile_frames + prov.calibrate_frames):
        step(model, i)
        assert prov.last_plan is None
    step(model, 7)
    planned = prov.telemetry.micro_batches[-1]
    plan = prov.last_plan
    assert plan is not None and planned.room_made_bytes == 0
    assert any(c != bagualu2.Choice.KEEP for c in plan.choices.values())
    again = bagualu2.enable(make_model(ep_size=4), budget=None, policy=plan, min_bytes=0)
    step(again.model, 7)
    got, ran = again.telemetry.micro_batches[-1].bytes_by_choice, planned.bytes_by_choice
    assert got["recompute"] == ran["recompute"] and sum(got.values()) == sum(ran.values())
    assert got["offload"] <= ran["offload"]
    if planned.fallbacks == 0:
        assert got == ran


def test_setting_the_policy_switches_a_fixed_plan_from_the_next_forward_and_refuses_other_policies() -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy=bagualu2.Plan({}), min_bytes=0)
    for i in range(prov.profile_frames):
        step(plain, i), step(model, i)
    cost = prov.cost
    offload = bagualu2.Plan({k: bagualu2.Choice.OFFLOAD for k in cost.ops})
    recompute = {k: bagualu2.Choice.RECOMPUTE for k, op in cost.ops.items() if op.recomputable}  # a mapping
    for i, (plan, released) in enumerate([(offload, "offload"), (recompute, "recompute"), ({}, None)], start=5):
        prov.policy = plan
        ref, got = step(plain, i), step(model, i)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
        ran = prov.telemetry.micro_batches[-1].bytes_by_choice
        assert {c for c in ("offload", "recompute") if ran[c] > 0} == ({released} if released else set())
    assert prov.report()["policy"] == "static"
    with pytest.raises(TypeError, match="'experts.0.fc1'.*not a bagualu2.Choice"):
        prov.policy = {"experts.0.fc1": "offload"}
    assert prov.policy.choices == {}  # a refused plan changes nothing
    for policy in ("adaptive", "keep_all"):
        other = bagualu2.enable(make_model(ep_size=4), budget=None, policy=policy)
        with pytest.raises(ValueError, match=f"only a fixed plan.*'{policy}'.*policy=bagualu2.Plan"):
            other.policy = offload
        assert other.policy == policy
        other.disable()


def test_ample_budget_skips_tracing_and_stays_exact() -> None:
    """Invariant 5: with a budget no routing can exceed, the plan is all-keep and untraced."""
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=1 << 40, min_bytes=0)
    for i, spike in enumerate([0.0, 0.0, 0.0, 2.6, 0.0]):
        ref, got = step(plain, i, spike), step(model, i, spike)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    mbs = prov.telemetry.micro_batches
    assert all(m.violations == 0 for m in mbs)
    # Frame 0 profiles, frame 1 profiles and decides at both gates; frames 2-4 are untraced, and
    # none recomputes to measure replays (no plan will need them).
    assert [d.micro_batch for d in prov.telemetry.decisions] == [1] * model.cfg.num_layers
    assert prov.report()["saved_bytes_by_choice"]["offload"] == 0
    assert prov.report()["saved_bytes_by_choice"]["recompute"] == 0 and not any(m.calibrating for m in mbs)


def test_keep_all_traces_only_its_profiling_forwards_and_counts_every_byte() -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    traced = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    ref = bagualu2.enable(traced, budget=None, policy={}, min_bytes=0)  # an all-keep plan, traced
    frames: List[bagualu2.runtime.Frame] = []
    prov.runtime.frame_observer = frames.append
    for i, spike in enumerate([0.0, 0.0, 2.6, 0.0]):
        a, b, c = step(plain, i, spike), step(model, i, spike), step(traced, i, spike)
        assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        assert torch.equal(a[0], c[0])
    assert [f.traced for f in frames] == [True, True, False, False]  # profile_frames=2
    # Untraced, the ledger still counts every saved byte: the same peaks as traced.
    assert [m.peak_bytes for m in prov.telemetry.micro_batches] == [m.peak_bytes for m in ref.telemetry.micro_batches]


def test_calm_forwards_go_untraced_and_an_unannounced_spike_is_offloaded_under_the_budget() -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    calm, spiked = keep_all_peak(model), keep_all_peak(model, spike=2.6)
    budget = (calm + spiked) // 2  # calm fits; a spike, and the worst routing, do not
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, margin=0.0)
    frames: List[bagualu2.runtime.Frame] = []
    pre_hooks: List[int] = []  # on the model's modules as each forward starts

    def observe(frame: bagualu2.runtime.Frame) -> None:
        frames.append(frame)
        pre_hooks.append(sum(len(m._forward_pre_hooks) for m in model.modules()))

    prov.runtime.frame_observer = observe
    trace = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.6, 0.0, 0.0]
    for i, spike in enumerate(trace):
        ref, got = step(plain, i, spike), step(model, i, spike)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    # An untraced forward calls the modules without bagualu2's hooks (torch's fast path); the
    # traced ones after it have them again, and name the operators as the profiled ones did.
    assert [n > 0 for n in pre_hooks] == [f.traced for f in frames]
    assert prov.report()["unplanned_keys"] == 0
    # Two profiling forwards, three recomputing all they can (the worst routing would not fit:
    # the cost model measures replays), a calm one untraced, the spike untraced too
    # (unannounced), the forward after it traced, ready to plan, and once that one routed within
    # the budget, the next untraced again.
    assert [f.traced for f in frames] == [True] * 5 + [False, False, True, False]
    mbs = prov.telemetry.micro_batches
    assert [m.traced for m in mbs] == [f.traced for f in frames]
    assert [m.calibrating for m in mbs] == [False, False, True, True, True, False, False, False, False]
    assert all(f.stats.bytes_by_choice["recompute"] > 0 and f.stats.bytes_by_choice["offload"] == 0
               for f in frames[2:5])
    assert prov.report()["traced_micro_batches"] == 6
    spike = frames[6].stats
    assert spike.violations == 0 and spike.peak_resident <= budget
    assert spike.bytes_by_choice["offload"] > 0 and any("untraced" in f for f in spike.fallbacks)
    assert frames[5].stats.bytes_by_choice["offload"] == 0
    assert prov.report()["violations"] == 0 and prov.report()["resident_bytes"] == 0
    # Untraced forwards are predicted too (the high-water mark at the first gate).
    assert all(m.predicted_peak_bytes > 0 for m in mbs[1:] if not m.calibrating)


def test_a_run_of_spikes_is_planned_from_its_second_micro_batch_on() -> None:
    """The first spike of a run arrives untraced (offloaded as it saves); the next is traced and
    planned at its gates; the micro-batch after the run is traced once more, routes within the
    budget, and the one after it is calm again."""
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    calm, spiked = keep_all_peak(model), keep_all_peak(model, spike=2.6)
    budget = (calm + spiked) // 2
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, margin=0.0)
    frames: List[bagualu2.runtime.Frame] = []
    prov.runtime.frame_observer = frames.append
    trace = [0.0] * 6 + [2.6, 2.6, 0.0, 0.0]
    for i, spike in enumerate(trace):
        ref, got = step(plain, i, spike), step(model, i, spike)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert [f.traced for f in frames[5:]] == [False, False, True, True, False]
    assert any("untraced" in f for f in frames[6].stats.fallbacks)
    planned = [d for d in prov.telemetry.decisions if d.micro_batch == 7]
    assert planned and planned[0].predicted_bytes > budget
    assert any(d.mix.get("offload", 0) + d.mix.get("recompute", 0) > 0 for d in planned)
    assert not any("untraced" in f for f in frames[7].stats.fallbacks)
    assert prov.report()["violations"] == 0 and all(m.peak_bytes <= budget for m in prov.telemetry.micro_batches)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.8, 2.6]), min_size=4, max_size=9),
       between=st.floats(min_value=0.1, max_value=0.9))
def test_untraced_and_traced_forwards_hold_a_budget_between_calm_and_spike(trace: Sequence[float],
                                                                           between: float) -> None:
    model = make_model(ep_size=4)
    plain = copy.deepcopy(model)
    calm, spiked = keep_all_peak(model), keep_all_peak(model, spike=2.6)
    budget = int(calm + between * (spiked - calm))
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, margin=0.0)
    for i, spike in enumerate(trace):
        ref, got = step(plain, i, spike), step(model, i, spike)
        assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    for mb in prov.telemetry.micro_batches:
        assert mb.peak_bytes <= budget and mb.violations == 0, mb
    assert prov.report()["resident_bytes"] == 0 and prov.report()["arena_in_use_bytes"] == 0


def test_without_a_copy_engine_only_the_worst_routing_makes_a_forward_calm() -> None:
    model = make_model(ep_size=4)
    budget = int(keep_all_peak(model) * 1.05)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, engine=None)
    prov.engine = None  # nothing could hold an untraced spike under the budget
    prov.runtime.engine = None
    frames: List[bagualu2.runtime.Frame] = []
    prov.runtime.frame_observer = frames.append
    for i in range(7):
        step(model, i)
    assert all(f.traced for f in frames)
    assert prov.report()["decisions"] >= 3 * 2  # frames 1, 5 and 6 decided at both gates (2-4 measured replays)


# -- cost model: what copies and recomputes really cost ------------------------------------------
def test_cost_model_copies_on_cpu_are_never_hidden_and_pay_a_fixed_cost() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({}, d2h_bandwidth=1e9, h2d_bandwidth=2e9, copy_fixed_s=(1e-4, 2e-4), copies_overlap=False)
    cost.observe({"a:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    (cand,), _ = cost.candidates(["a:op:0"], {}, min_bytes=0, can_offload=True)
    assert cand.offload_s == pytest.approx(1e-4 + 1e-3) and cand.reload_s == pytest.approx(2e-4 + 5e-4)
    assert cost.windows(1.0, stacked_forwards=3) == (0.0, 0.0)
    overlapping = CostModel({}, copies_overlap=True)
    overlapping.observe({"a:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    assert overlapping.windows(1.0) == (pytest.approx(0.05), pytest.approx(0.1))
    with pytest.raises(ValueError, match="copy_fixed_s"):
        CostModel({}, copy_fixed_s=(-1.0, 0.0))


def test_cost_model_floor_is_what_no_plan_can_release() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({0: "experts"})
    saved = {"small:op:0": (100, 1e-3, True, ()), "anchor:op:0": (4000, 1e-3, True, ()),
             "rng:op:0": (2000, 1e-3, False, ()), "experts.0:mm:0": (800, 1e-3, True, ()),
             "empty:op:0": (0, 1e-3, True, ())}
    cost.observe(saved, {0: [8, 24]}, forward_seconds=0.01)
    keys = list(saved)
    routed = {0: [16, 16]}  # expert 0 gets twice the tokens; the micro-batch is as large
    for can_offload, floor in ((True, 100 + 4000), (False, 100 + 4000 + 2000)):
        cands, cand_floor = cost.candidates(keys, routed, 500, can_offload, fixed=["anchor:op:0"])
        assert cand_floor == floor
        released = {c.key: c.nbytes for c in cands}
        assert released == ({"rng:op:0": 2000, "experts.0:mm:0": 1600} if can_offload else {"experts.0:mm:0": 1600})
        # Without anchors: what no plan releases (small ones too), and what nothing can release
        # (the runtime releases small ones when the budget demands it; without a copy engine,
        # what cannot be recomputed stays).
        soft, hard = cost.floors(keys, routed, 500, can_offload)
        assert soft == cost.candidates(keys, routed, 500, can_offload)[1] == floor - 4000
        assert hard == (0 if can_offload else 2000)


def test_cost_model_sizes_non_expert_operators_by_the_micro_batch_not_by_rounded_loads() -> None:
    from bagualu2.plan.cost_model import SIZE, CostModel

    cost = CostModel({0: "experts"})
    cost.observe({"attn:op:0": (1000, 1e-3, True, ()), "experts.0:mm:0": (100, 1e-3, True, ())},
                 {0: [10, 10]}, forward_seconds=0.01)
    assert cost.predict_bytes("attn:op:0", {0: [20, 20]}) == 2000  # twice the tokens
    rounded = {0: [12, 12], SIZE: [10, 10]}  # planning rounds each load up; the size stays
    assert cost.predict_bytes("attn:op:0", rounded) == 1000
    assert cost.predict_bytes("experts.0:mm:0", rounded) == 120


def test_high_water_prediction_follows_the_sequence_length() -> None:
    """Attention, norms and routing buffers grow with the micro-batch's tokens: predicted at the
    first gate from the tokens it routes, the all-keep high-water mark stays within 3% when the
    sequence length changes from micro-batch to micro-batch (it was off by up to 80% when such
    ops were taken as constant). Without dropout, sdpa saves no seq x seq probabilities: every
    saved activation is linear in the tokens."""
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(dropout=0.0, ep_size=4))
    prov = bagualu2.enable(model, budget=1 << 40, min_bytes=0)
    lengths = [32, 32, 16, 48, 24, 40, 8, 32]
    for i, length in enumerate(lengths):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        model(torch.randint(0, model.cfg.vocab_size, (2, length))).backward()
    checked = [mb for mb in prov.telemetry.micro_batches if mb.predicted_peak_bytes]
    assert len(checked) >= 5
    for mb in checked:
        assert abs(mb.predicted_peak_bytes - mb.peak_bytes) <= 0.03 * mb.peak_bytes, mb


def test_cost_model_learns_recompute_cost_from_measured_replays() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    cost.observe({"a:op:0": (1000, 1e-3, True, ()), "b:op:0": (1000, 2e-3, True, ())}, {}, forward_seconds=0.01)
    assert cost.recompute_seconds("b:op:0", {}) == pytest.approx(2e-3)  # nothing measured: profiled time
    # Rebuilds that really cost 0.1 ms each plus twice their profiled time. One plan alone
    # cannot tell a fixed cost from a factor: the factor takes it all.
    cost.observe_replays({"a:op:0": (3 * (1e-4 + 2e-3), 3)}, {})  # a, rebuilt in 3 micro-batches
    assert (cost.replay_fixed_s, cost.replay_factor) == (0.0, pytest.approx(2.1))
    assert cost.recompute_seconds("b:op:0", {}) == pytest.approx(4.2e-3)
    # Plans that also rebuild b separate them (exact data: any weighting recovers them).
    cost.observe_replays({"a:op:0": (1e-4 + 2e-3, 1), "b:op:0": (1e-4 + 4e-3, 1)}, {})
    cost.observe_replays({"b:op:0": (2 * (1e-4 + 4e-3), 2)}, {})
    assert cost.replay_fixed_s == pytest.approx(1e-4) and cost.replay_factor == pytest.approx(2.0)
    assert cost.recompute_seconds("b:op:0", {}) == pytest.approx(1e-4 + 4e-3)
    cost.observe_replays({"unknown:op:0": (1.0, 1)}, {})  # keys the model does not know: ignored
    assert cost.replay_factor == pytest.approx(2.0)
    assert cost.replay_frame_s == 0.0


def test_cost_model_prices_an_op_s_replay_as_backward_measured_it() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({0: "experts"})
    profiled = {"a:op:0": (1e-3, ()), "b:op:0": (2e-3, ()), "c:op:0": (4e-3, ("u:op:0",)), "experts.0:op:0": (1e-3, ())}
    cost.observe({k: (1000, s, True, unsaved) for k, (s, unsaved) in profiled.items()}, {0: [10, 10]},
                 forward_seconds=0.01, unsaved={"u:op:0": 5e-4})
    assert cost.recompute_seconds("c:op:0", {0: [10, 10]}) == pytest.approx(4.5e-3)  # nothing replayed: profiled
    # a replayed twice at 3x its profiled time, b once at half of it, the expert's op at two loads
    # after a first, cold replay (which the next replaces); a key the model does not know is ignored.
    cost.observe_op_replays({"a:op:0": (2 * 3e-3, 2, 2, 0.0, 0), "b:op:0": (1e-3, 1, 1, 0.0, 0), "unknown:op:0": (1.0, 1, 1, 0.0, 0)}, {0: [10, 10]})
    cost.observe_op_replays({"experts.0:op:0": (9e-3, 1, 1, 0.0, 0)}, {0: [10, 10]})
    cost.observe_op_replays({"experts.0:op:0": (3e-3, 1, 1, 0.0, 0)}, {0: [10, 10]})
    cost.observe_op_replays({"experts.0:op:0": (5e-3, 1, 1, 0.0, 0)}, {0: [20, 0]})
    counts = {0: [15, 5]}
    assert cost.op_replay_seconds(cost.ops["a:op:0"], counts) == pytest.approx(3e-3)
    assert cost.recompute_seconds("a:op:0", counts) == pytest.approx(3e-3)
    assert cost.recompute_seconds("b:op:0", counts) == pytest.approx(1e-3)
    assert cost.recompute_seconds("experts.0:op:0", counts) == pytest.approx(4e-3)  # 1e-3 + 2e-4 per token
    # c and its unsaved input, never replayed: their profiled times at the median ratio measured
    # against the profiled times of the ops replayed (3, 0.5 and, at its last load, 2.5: 2.5).
    assert cost.recompute_seconds("c:op:0", counts) == pytest.approx(2.5 * 4.5e-3)
    # A rebuild that held an op's first replay is not learned from; the next one is.
    cost.observe_op_replays({"c:op:0": (1e-3, 1, 1, 0.0, 0), "u:op:0": (1e-3, 1, 1, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (1.0, 1)}, counts)
    assert not cost._replay_fit.observed
    cost.observe_op_replays({"c:op:0": (1e-3, 1, 1, 0.0, 0), "u:op:0": (1e-3, 1, 1, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (2.2e-3, 1)}, counts)
    assert cost._replay_fit.observed and cost.recompute_seconds("c:op:0", counts) == pytest.approx(2.2e-3)
    # Nor one that replayed a call three times for one micro-batch (it rebuilt again to stay
    # under the budget); its op times are still learned ...
    coef = list(cost._replay_fit.coef)
    cost.observe_op_replays({"c:op:0": (3e-3, 3, 3, 0.0, 0), "u:op:0": (1e-3, 1, 3, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (9e-3, 1)}, counts)
    assert cost._replay_fit.coef == coef and cost.recompute_seconds("c:op:0", counts) == pytest.approx(2.2e-3)
    # ... and a rebuild of the same backward that replayed its calls once is learned from.
    c_last, b_seen = cost.ops["c:op:0"].replays[-1], len(cost.ops["b:op:0"].replays)
    cost.observe_op_replays({"c:op:0": (3e-3, 3, 3, 0.0, 0), "u:op:0": (1e-3, 1, 3, 0.0, 0), "b:op:0": (1e-3, 1, 1, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (9e-3, 1), "b:op:0": (1.2e-3, 1)}, counts)
    assert cost.ops["c:op:0"].replays[-1] is c_last and len(cost.ops["b:op:0"].replays) == b_seen + 1
    assert cost._replay_fit.coef != coef


def test_the_per_micro_batch_rebuild_part_stays_near_zero_until_rebuilds_tell_it_apart() -> None:
    """Calibrating micro-batches alone: a first rebuild of 147 ops (30 us each beyond their
    replay time, 10 ms) and two of 3 ops, with noise. Per micro-batch and per op cannot be told
    apart there; without the prior the fit puts about 4 ms of the large rebuild on every
    micro-batch, and prices a plan of one small rebuild at 25x its cost. With it the part stays
    near 0 and the plan is priced right. Where first and later rebuilds of the same size show
    it (0.15 ms), it is learned."""
    from bagualu2.plan.cost_model import REPLAY_FACTOR_FLOOR, REPLAY_FACTOR_SD, REPLAY_FRAME_SD, _CostFit

    def fit(zero_sd: Dict[int, float], rows: List[Tuple[Tuple[float, ...], float]]) -> _CostFit:
        out = _CostFit(4, relative=False, prior_sd=REPLAY_FACTOR_SD, floor=REPLAY_FACTOR_FLOOR, zero_sd=zero_sd)
        for i in range(40):
            noise = (0.9, 1.0, 1.1)[i % 3]
            out.add([(x, y * noise) for x, y in rows], [int(x[1]).bit_length() for x, _ in rows])
        return out

    def cost(frame: float, ops: int, seconds: float) -> float:
        return frame + 30e-6 * ops + 20e-6 + seconds

    calibration = [((1.0, 147.0, 1.0, 10e-3), cost(0.0, 147, 10e-3)),
                   ((0.0, 3.0, 1.0, 0.2e-3), cost(0.0, 3, 0.2e-3)), ((0.0, 3.0, 1.0, 0.25e-3), cost(0.0, 3, 0.25e-3))]
    plan = (1.0, 2.0, 1.0, 0.1e-3)  # a plan's one rebuild, of two ops

    def predict(fitted: _CostFit) -> float:
        return sum(c * v for c, v in zip(fitted.coef, plan))

    free, anchored = fit({}, calibration), fit({0: REPLAY_FRAME_SD}, calibration)
    assert free.coef[0] > 1e-3 and predict(free) > 10 * cost(0.0, 2, 0.1e-3)
    assert anchored.coef[0] < 0.2 * REPLAY_FRAME_SD
    assert predict(anchored) == pytest.approx(cost(0.0, 2, 0.1e-3), rel=0.1)
    plans = [((1.0, 2.0, 1.0, 0.1e-3), cost(150e-6, 2, 0.1e-3)), ((0.0, 2.0, 1.0, 0.1e-3), cost(0.0, 2, 0.1e-3)),
             ((0.0, 4.0, 1.0, 0.3e-3), cost(0.0, 4, 0.3e-3))]
    assert fit({0: REPLAY_FRAME_SD}, plans).coef[0] == pytest.approx(150e-6, rel=0.3)


def test_a_call_only_ever_replayed_first_in_its_rebuild_is_priced_as_it_measured_there() -> None:
    """A call every plan so far replayed as its rebuild's first is timed there (apart from the
    walk that enters the rebuild), not priced from its profiled time: on the reference model a
    profiled time scaled as the other replays measured priced one 2.5x what it measured."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    cost.observe({"a:op:0": (1000, 1e-3, True, ()), "b:op:0": (1000, 1e-3, True, ())}, {}, forward_seconds=0.01)
    a, b = cost.ops["a:op:0"], cost.ops["b:op:0"]
    cost.observe_op_replays({"a:op:0": (0.0, 0, 1, 9e-3, 1), "b:op:0": (2e-3, 1, 1, 0.0, 0)}, {})
    assert cost.op_replay_seconds(a, {}) == pytest.approx(9e-3)  # its first, cold replay: all there is
    cost.observe_op_replays({"a:op:0": (0.0, 0, 1, 3e-3, 1), "b:op:0": (2e-3, 1, 1, 0.0, 0)}, {})
    assert cost.op_replay_seconds(a, {}) == pytest.approx(3e-3)  # the next replaced it
    assert cost.op_replay_seconds(b, {}) == pytest.approx(2e-3)
    # Once timed inside a chain, where plans that rebuild more replay it, that time prices it.
    cost.observe_op_replays({"a:op:0": (1e-3, 1, 2, 3e-3, 1)}, {})
    cost.observe_op_replays({"a:op:0": (1.5e-3, 1, 2, 3e-3, 1)}, {})
    assert cost.op_replay_seconds(a, {}) == pytest.approx(1.5e-3)


def test_a_rebuild_far_slower_than_its_last_ones_counts_as_a_bounded_one() -> None:
    """A one-op rebuild that measured 1 to 1.2 ms five times, then 50 ms once (a preempted
    thread): the fit learns it as one of OUTLIER_RATIO times their median, as if it had measured
    that. Before three alike were seen, a rebuild is taken as it measured."""
    from bagualu2.plan.cost_model import OUTLIER_RATIO, CostModel

    def learned(times: List[float]) -> List[float]:
        cost = CostModel({})
        cost.observe({"a:op:0": (1000, 1e-3, True, ())}, {}, forward_seconds=0.01)
        for seconds in times:
            cost.observe_op_replays({"a:op:0": (0.0, 0, 1, 0.0, 0)}, {})  # untimed: priced as profiled
            cost.observe_replays({"a:op:0": (seconds, 1)}, {})
        return list(cost._replay_fit.coef)

    usual = [1e-3, 1.2e-3, 1e-3, 1.1e-3, 1e-3]
    bound = OUTLIER_RATIO * statistics.median(usual)
    assert learned(usual + [50e-3]) == pytest.approx(learned(usual + [bound]))
    assert learned(usual + [0.9 * bound]) != pytest.approx(learned(usual + [bound]))
    assert learned(usual[:2] + [50e-3]) != pytest.approx(learned(usual[:2] + [bound]))


def test_cost_model_learns_a_cost_per_micro_batch_that_rebuilds() -> None:
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    profiled = {"a:op:0": 1e-3, "b:op:0": 2e-3, "c:op:0": 4e-3}
    cost.observe({k: (1000, v, True, ()) for k, v in profiled.items()}, {}, forward_seconds=0.01)
    # Backward pays 0.2 ms once per micro-batch that rebuilds anything, plus 1.5x the ops' time.
    # The 0.2 ms lands in the first rebuild backward enters: the latest key's.
    plans = [("a:op:0",), ("a:op:0", "b:op:0"), ("b:op:0", "c:op:0"), ("a:op:0", "b:op:0", "c:op:0")]
    for frames, keys in enumerate(plans, start=1):
        per_frame = {k: 1.5 * profiled[k] + (2e-4 if k == keys[-1] else 0.0) for k in keys}
        cost.observe_replays({k: (frames * v, frames) for k, v in per_frame.items()}, {})
    assert (cost.replay_frame_s, cost.replay_fixed_s, cost.replay_factor) == (
        pytest.approx(2e-4), pytest.approx(0.0, abs=1e-12), pytest.approx(1.5))
    plan = {"b:op:0": Choice.RECOMPUTE, "c:op:0": Choice.RECOMPUTE, "a:op:0": Choice.KEEP}
    assert cost.plan_seconds(plan, {}) == pytest.approx(2e-4 + 1.5 * 6e-3)  # the per-micro-batch part once
    assert cost.recompute_seconds("c:op:0", {}) == pytest.approx(1.5 * 4e-3)  # a key's own part
    assert cost.plan_seconds({"a:op:0": Choice.KEEP}, {}) == 0.0


def test_cost_model_learns_a_cost_per_rebuild_entered_and_none_for_a_key_rebuilt_inside_another() -> None:
    """RMSNorm's ``x * r`` then ``* weight``: with both recomputed, backward meets the second
    first and rebuilds the first inside it, so the plan enters one rebuild, not two."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    profiled = {"a:op:0": 1e-3, "b:op:0": 2e-3, "c:op:0": 4e-3}
    cost.observe({"a:op:0": (1000, 1e-3, True, (), ()), "b:op:0": (1000, 2e-3, True, (), ("a:op:0",)),
                  "c:op:0": (1000, 4e-3, True, (), ())}, {}, forward_seconds=0.01)
    assert cost.rebuild_profile(["a:op:0", "b:op:0"], {}) == (2, 1, pytest.approx(3e-3))
    assert cost.rebuild_profile(["a:op:0", "c:op:0"], {}) == (2, 2, pytest.approx(5e-3))

    def measured(keys: tuple) -> Dict[str, float]:  # 10 us per op, 200 us per rebuild entered, 1.5x the ops
        own = {k: 1e-5 + 1.5 * profiled[k] for k in keys}
        if "b:op:0" in keys and "a:op:0" in keys:  # b's rebuild makes a; a's unpack finds it made
            own["b:op:0"] += own.pop("a:op:0")
            own["a:op:0"] = 0.0
        return {k: v + (2e-4 if v else 0.0) for k, v in own.items()}

    def truth(keys: tuple) -> float:
        return sum(measured(keys).values())

    for keys in [("a:op:0",), ("a:op:0", "b:op:0"), ("b:op:0",), ("a:op:0", "c:op:0"), ("c:op:0",),
                 ("a:op:0", "b:op:0", "c:op:0")]:
        cost.observe_replays({k: (v, 1) for k, v in measured(keys).items()}, {})
    assert (cost.replay_frame_s, cost.replay_fixed_s, cost.replay_entry_s, cost.replay_factor) == (
        pytest.approx(0.0, abs=1e-12), pytest.approx(1e-5), pytest.approx(2e-4), pytest.approx(1.5))
    both = {"a:op:0": Choice.RECOMPUTE, "b:op:0": Choice.RECOMPUTE, "c:op:0": Choice.KEEP}
    assert cost.plan_seconds(both, {}) == pytest.approx(truth(("a:op:0", "b:op:0")))


def test_cost_model_runs_an_op_call_once_for_all_its_recomputed_outputs() -> None:
    """Attention saves its output and its log-sum-exp, two outputs of one call: recomputing
    both replays the call once (the runtime caches every output of a replayed call)."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    cost.observe({"attn:sdpa:0": (1000, 3e-3, True, (), ()), "attn:sdpa:0.1": (100, 3e-3, True, (), ()),
                  "attn:sdpa:1": (1000, 5e-3, True, (), ()), "o:mm:0": (1000, 1e-3, True, (), ())},
                 {}, forward_seconds=0.01)
    assert cost.rebuild_profile(["attn:sdpa:0", "attn:sdpa:0.1"], {}) == (1, 2, pytest.approx(3e-3))
    # another call of the same op (occurrence 1) is another call
    assert cost.rebuild_profile(["attn:sdpa:0.1", "attn:sdpa:1", "o:mm:0"], {}) == (3, 3, pytest.approx(9e-3))
    assert cost.rebuild_profile(["attn:sdpa:0.1"], {}) == (1, 1, pytest.approx(3e-3))


def test_cost_model_tells_a_cost_per_rebuild_from_a_factor_within_one_plan() -> None:
    """Rebuilds of one plan differ in size, so the same plan observed again and again tells a
    fixed cost per rebuild (40 us) from a factor on the ops' time (1x) and predicts a key it has
    never rebuilt; the plan's total alone would put everything in the factor."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    profiled = {"a:op:0": 1e-5, "c:op:0": 9e-5, "d:op:0": 3e-5}
    cost.observe({k: (1000, v, True, (), ()) for k, v in profiled.items()}, {}, forward_seconds=0.01)
    for _ in range(3):
        cost.observe_replays({k: (4e-5 + profiled[k], 1) for k in ("a:op:0", "c:op:0")}, {})
    assert cost.replay_fixed_s + cost.replay_entry_s == pytest.approx(4e-5)
    assert cost.replay_factor == pytest.approx(1.0)
    assert cost.recompute_seconds("d:op:0", {}) == pytest.approx(7e-5)


def test_replay_fit_reproduces_the_large_rebuilds_a_plan_s_cost_is_made_of() -> None:
    """Many one-op rebuilds with noisy timings (cold Python in backward) and one large rebuild
    per micro-batch: the shared fit is on the absolute error, so it reproduces the large one,
    which dominates a plan's total; a fit on the relative error lets the small ones decide."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})

    def fitted(x):
        return sum(c * v for c, v in zip(cost._replay_fit.coef, x))

    noise = [0.7, 1.3, 0.9, 1.2, 0.8, 1.1, 1.0, 1.25, 0.75]
    small = [((0.0, 1.0, 1.0, p), (26e-6 + p) * n * (3.0 if i % 3 == 0 else 1.0))
             for i, (p, n) in enumerate(zip([5e-6, 7e-6, 9e-6, 6e-6, 8e-6, 10e-6, 5e-6, 7e-6, 9e-6], noise))]
    large = ((0.0, 8.0, 1.0, 270e-6), 15e-6 + 8 * 11e-6 + 270e-6)
    for _ in range(5):
        cost._replay_fit.add(small + [large])
    assert fitted(large[0]) == pytest.approx(large[1], rel=0.05)


def test_replay_fit_learned_from_small_rebuilds_predicts_a_large_one() -> None:
    """Rebuilds of one or two small ops (5-45 us profiled), whose measured time is mostly the
    replay's own overhead plus noise, tell little about the factor on the ops' time; fitted
    freely it came out anywhere from 0.5 to 1.5 and a 500 us op was predicted at 318 to 764 us.
    With the prior on the factor (1 unless the observations say otherwise), 513 to 566 us."""
    import random

    from bagualu2.plan.cost_model import CostModel

    rng = random.Random(0)
    for _ in range(20):
        cost = CostModel({})
        for _ in range(12):  # micro-batches
            rows = []
            for i in range(rng.randint(1, 3)):
                ops, profiled, first = rng.randint(1, 2), rng.uniform(5e-6, 45e-6), float(i == 0)
                measured = 40e-6 * first + 25e-6 + 10e-6 * ops + profiled + rng.gauss(0, 15e-6)
                rows.append(((first, float(ops), 1.0, profiled), max(1e-6, measured)))
            cost._replay_fit.add(rows)
        assert cost._fitted(1, 500e-6) == pytest.approx(25e-6 + 10e-6 + 500e-6, rel=0.1)


def test_cost_model_learns_what_each_key_s_rebuild_costs_beyond_the_shared_fit() -> None:
    """Two keys profiled alike whose rebuilds cost 100 us and 30 us: no shared fit tells them
    apart, each key's own correction does."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    cost.observe({"norm:mul:1": (1000, 1e-5, True, (), ()), "moe:index_select:0": (1000, 1e-5, True, (), ())},
                 {}, forward_seconds=0.01)
    true = {"norm:mul:1": 1e-4, "moe:index_select:0": 3e-5}
    for keys in [("norm:mul:1",), ("moe:index_select:0",), tuple(true)] * 3:
        cost.observe_replays({k: (true[k], 1) for k in keys}, {})
    for key, seconds in true.items():
        assert cost.recompute_seconds(key, {}) == pytest.approx(seconds)
    assert cost.plan_seconds({k: Choice.RECOMPUTE for k in true}, {}) == pytest.approx(1.3e-4)
    assert cost.replay_ratio("norm:mul:1") > 1.0 > cost.replay_ratio("moe:index_select:0")


def test_a_key_s_correction_holds_for_rebuilds_of_the_size_it_was_measured_at() -> None:
    """The LM head's loss, rebuilt alone, measured 3x what the shared fit predicts (its own
    small replay's overhead). In a plan that recomputes everything, backward enters one rebuild
    there that replays the body too: a rebuild of another size, priced by the shared fit, not
    at 3x. Its correction holds once it has measured CORRECTION_SAMPLES rebuilds of that size."""
    from bagualu2.plan.cost_model import CORRECTION_SAMPLES, CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    body = [f"body:op:{i}" for i in range(20)]
    saved = {k: (1000, 1e-4, True, (), ()) for k in body}
    saved["head:loss:0"] = (1000, 1e-4, True, (), tuple(body))
    cost.observe(saved, {}, forward_seconds=0.01)
    for keys in [body[:1], body[1:3], body[3:6]] * 3:  # the shared fit: 1x the profiled time
        cost.observe_replays({k: (1e-4, 1) for k in keys}, {})
    cost.observe_replays({"head:loss:0": (3e-4, 1)}, {})
    assert cost.replay_ratio("head:loss:0") == 1.0  # one rebuild of its size: not yet a correction
    for _ in range(CORRECTION_SAMPLES - 1):
        cost.observe_replays({"head:loss:0": (3e-4, 1)}, {})
    assert cost.replay_ratio("head:loss:0") > 2.0 and cost.replay_ratio("head:loss:0", ops=21) == 1.0
    assert cost.recompute_seconds("head:loss:0", {}) == pytest.approx(
        cost.replay_ratio("head:loss:0") * (cost.replay_entry_s + cost.replay_fixed_s + 1e-4 * cost.replay_factor))
    everything = {k: Choice.RECOMPUTE for k in saved}
    assert cost.rebuild_profile(everything, {}) == (21, 1, pytest.approx(2.1e-3))
    assert cost.plan_seconds(everything, {}) == pytest.approx(
        cost.replay_frame_s + cost.replay_entry_s + 21 * cost.replay_fixed_s + 2.1e-3 * cost.replay_factor)
    assert cost.plan_seconds(everything, {}) < 1.5 * 2.1e-3


def test_cost_model_counts_an_unsaved_input_once_per_plan() -> None:
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({}, copies_overlap=False)
    saved = {"q:op:0": (1000, 1e-3, True, ("proj:mm:0",)), "k:op:0": (1000, 2e-3, True, ("proj:mm:0",)),
             "o:op:0": (1000, 4e-3, True, ())}
    cost.observe(saved, {}, forward_seconds=0.1, unsaved={"proj:mm:0": 10e-3})
    assert cost.recompute_seconds("q:op:0", {}) == pytest.approx(11e-3)  # alone: pays for proj
    assert cost.recompute_seconds("k:op:0", {}) == pytest.approx(12e-3)
    both = {"q:op:0": Choice.RECOMPUTE, "k:op:0": Choice.RECOMPUTE, "o:op:0": Choice.KEEP}
    assert cost.plan_seconds(both, {}) == pytest.approx(13e-3)  # proj rebuilt once, for both
    # Replays are fitted against the same plan-level profile: backward unpacks k first, whose
    # rebuild makes proj.
    cost.observe_replays({"q:op:0": (1e-3, 1), "k:op:0": (12e-3, 1)}, {})
    assert cost.replay_factor == pytest.approx(1.0) and cost.replay_fixed_s == 0.0


def _theil_sen(samples: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(a, b) of the median line: the median of all pairwise slopes (each pair once), then the
    median intercept; for one token count, the median value through the origin (or flat)."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(samples) for x2, y2 in samples[i + 1:] if x2 != x1]
    if not slopes:
        x = samples[0][0]
        return (0.0, statistics.median(y for _, y in samples) / x) if x > 0 else (statistics.median(y for _, y in samples), 0.0)
    b = statistics.median(slopes)
    return statistics.median(y - b * x for x, y in samples), b


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0.0, 1.0)), min_size=1, max_size=60))
def test_a_timing_fit_is_the_theil_sen_line_of_its_window_refitted_once_an_eighth_is_new(samples) -> None:
    from bagualu2.plan.cost_model import FIT_WINDOW, _Fit

    fit = _Fit(robust=True)
    fitted: List[Tuple[float, float]] = []  # the window at the last refit
    new = 0
    for i, (tokens, seconds) in enumerate(samples):
        fit.add(float(tokens), seconds)
        window = [(float(x), y) for x, y in samples[max(0, i + 1 - FIT_WINDOW):i + 1]]
        new += 1
        if 8 * new >= len(window):
            fitted, new = window, 0
        a, b = _theil_sen(fitted)
        for x in (0.0, 3.0, 10.0):
            assert fit(x) == pytest.approx(max(0.0, a + b * x), abs=1e-12)


def test_cost_model_timings_drop_the_cold_first_micro_batch_and_outliers() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({0: "experts"})
    cost.observe({"attn:op:0": (100, 50e-3, True, ()), "experts.0:mm:0": (400, 40e-3, True, ())},
                 {0: [4, 8]}, forward_seconds=1.0)  # cold: first touches, allocator growth
    for seconds, tokens in ((1e-3, 4), (9e-3, 8), (1e-3, 2), (1e-3, 6)):  # one preempted run
        cost.observe({"attn:op:0": (100, seconds, True, ()), "experts.0:mm:0": (100 * tokens, tokens * 1e-3, True, ())},
                     {0: [tokens, 12 - tokens]}, forward_seconds=0.1)  # micro-batches of one size
    assert cost.recompute_seconds("attn:op:0", {0: [10, 2]}) == pytest.approx(1e-3)
    assert cost.recompute_seconds("experts.0:mm:0", {0: [10, 2]}) == pytest.approx(10e-3)
    assert cost.predict_bytes("experts.0:mm:0", {0: [10, 2]}) == 1000


def test_cost_model_learns_what_offloads_cost() -> None:
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    # A clock that stands still: refits take no time, all of learning is the per-offload part.
    cost = CostModel({}, d2h_bandwidth=1e9, h2d_bandwidth=1e9, copy_fixed_s=(1e-4, 1e-4), clock=lambda: 0.0)
    cost.observe({"a:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    (cand,), _ = cost.candidates(["a:op:0"], {}, min_bytes=0, can_offload=True)
    assert cand.offload_s == pytest.approx(1e-4 + 1e-3)  # nothing measured: the engine's figures
    # Offloads that really cost 0.3 ms per micro-batch (the first reload waits for a copy
    # nothing hid), 50 us each on the training thread, and 1.5x their copy time.
    def observed(copies: int, nbytes: int) -> float:
        return 3e-4 + copies * 5e-5 + 1.5 * (copies * 2e-4 + 2 * nbytes / 1e9)

    # One observation cannot tell the parts apart: the factor takes it all.
    cost.observe_copies(observed(2, 2 * 10**6), copies=2, nbytes=2 * 10**6)
    assert cost.copy_frame_s == cost.copy_overhead_s == 0.0
    assert cost.copy_factor == pytest.approx(observed(2, 2 * 10**6) / 4.4e-3)
    # Micro-batches with many small copies and with few large ones separate them (exact data:
    # any weighting recovers them).
    cost.observe_copies(observed(10, 10**5), copies=10, nbytes=10**5)
    cost.observe_copies(observed(1, 4 * 10**6), copies=1, nbytes=4 * 10**6)
    assert (cost.copy_frame_s, cost.copy_overhead_s, cost.copy_factor) == (
        pytest.approx(3e-4), pytest.approx(5e-5), pytest.approx(1.5))
    (cand,), _ = cost.candidates(["a:op:0"], {}, min_bytes=0, can_offload=True)
    assert cand.offload_s + cand.reload_s == pytest.approx(observed(1, 10**6) - 3e-4)  # the copy's own part
    # a plan pays the per-micro-batch part once, whatever it offloads
    cost.observe({"b:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    plan = {"a:op:0": Choice.OFFLOAD, "b:op:0": Choice.OFFLOAD}
    assert cost.plan_seconds(plan, {}) == pytest.approx(observed(2, 2 * 10**6))
    # ... and learning from its copies, as it took for micro-batches of as many offloads
    # (the last observed offloaded 1, and learning from it took 1.5e-4 s; before, 10: 6e-4 s)
    cost.observe_copies(observed(10, 10**5), copies=10, nbytes=10**5)
    cost.observe_learning("copies", 6e-4)
    cost.observe_copies(observed(1, 4 * 10**6), copies=1, nbytes=4 * 10**6)
    cost.observe_learning("copies", 1.5e-4)
    assert cost.learning_seconds("copies", 2) == pytest.approx(2e-4)
    assert cost.copy_setup_s == pytest.approx(3e-4 + 1e-4)
    assert cost.plan_seconds(plan, {}) == pytest.approx(observed(2, 2 * 10**6) + 2e-4)
    assert cost.plan_seconds({"a:op:0": Choice.RECOMPUTE}, {}) == pytest.approx(cost.recompute_seconds("a:op:0", {}))
    with pytest.raises(ValueError, match="kind='rebuilds' must be one of"):
        cost.observe_learning("rebuilds", 1e-4)
    cost.observe_copies(0.0, copies=3, nbytes=10)  # nothing measured: ignored
    assert cost.copy_factor == pytest.approx(1.5)


def test_many_small_offloading_plans_do_not_erase_what_offloading_everything_taught() -> None:
    """Plans offload a few storages every micro-batch, and calibrations 64 once in a while;
    each measurement is up to 10% off either way. Learned from the small plans alone, the parts
    are told apart by noise, and 64 offloads priced far from them: the fit forgets per offload
    count, so 100 small plans after the last calibration leave 64 priced as measured."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({}, d2h_bandwidth=1e9, h2d_bandwidth=1e9, clock=lambda: 0.0)

    def observed(copies: int, nbytes: int) -> float:
        return 3e-4 + copies * 5e-5 + 1.5 * 2 * nbytes / 1e9

    noise = [1.1, 0.9, 1.05, 0.95]
    for i in range(8):  # calibrations of everything, and plans of 5, in turn
        cost.observe_copies(observed(64, 10**7) * noise[i % 4], copies=64, nbytes=10**7)
        cost.observe_copies(observed(5, 2 * 10**6) * noise[(i + 1) % 4], copies=5, nbytes=2 * 10**6)
    for i in range(100):  # plans of 4 to 7 offloads, of 1 to 3 MB
        copies, nbytes = 4 + i % 4, 10**6 * (1 + i % 3)
        cost.observe_copies(observed(copies, nbytes) * noise[i % 4], copies=copies, nbytes=nbytes)

    def priced(copies: int, nbytes: int) -> float:
        return cost.copy_frame_s + copies * cost.copy_overhead_s + cost.copy_factor * 2 * nbytes / 1e9

    assert priced(64, 10**7) == pytest.approx(observed(64, 10**7), rel=0.05)
    assert priced(5, 2 * 10**6) == pytest.approx(observed(5, 2 * 10**6), rel=0.05)


def test_plans_pay_the_cost_a_micro_batch_s_first_offload_adds_once() -> None:
    """Copies measured nearly free each, but 1 s per micro-batch that offloads anything: the
    whole-micro-batch plan and the plans decided at the gates recompute instead."""
    model = make_model()
    prov = bagualu2.enable(model, budget=1 << 40, min_bytes=0)
    for i in range(prov.profile_frames):
        step(model, i)
    keep_peak = max(m.peak_bytes for m in prov.telemetry.micro_batches)
    prov.budget = int(0.6 * keep_peak)
    for i in range(prov.calibrate_frames):  # recompute all they can: the cost model measures replays
        step(model, 96 + i)
    assert all(m.calibrating for m in prov.telemetry.micro_batches[-3:])
    cost = prov.cost
    transfer = 1.0 / cost.d2h_bandwidth + 1.0 / cost.h2d_bandwidth
    for copies, nbytes in [(1, 10**6), (4, 10**5), (9, 3 * 10**6)]:
        fixed = copies * sum(cost.copy_fixed_s) + nbytes * transfer
        cost.observe_copies(1.0 + 1e-3 * fixed, copies, nbytes)
    assert cost.copy_frame_s == pytest.approx(1.0, rel=1e-6)
    counts = prov.mean_counts()
    plan = prov.plan_for(counts)
    Choice = bagualu2.Choice
    assert plan.feasible and plan.mix()[Choice.OFFLOAD] == 0 and plan.mix()[Choice.RECOMPUTE] > 0
    unpriced = prov.planner.solve(*cost.candidates(cost.order, counts, 0, True)[:1],
                                  cost.predict_total(cost.order, counts) - int(prov.budget * (1 - prov.margin)),
                                  0.0, 0.0)
    assert unpriced.mix()[Choice.OFFLOAD] > 0  # without the setup, copies looked nearly free
    step(model, 99)
    decided = [d for d in prov.telemetry.decisions if d.mix.get("offload", 0) + d.mix.get("recompute", 0)]
    assert decided and all(d.mix.get("offload", 0) == 0 for d in decided)


class DataDependentLoop(torch.nn.Module):
    """Adds zero a number of times that depends on the data, then squares: the square saves a
    storage whose key (the last add's occurrence) moves from micro-batch to micro-batch."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(1 + int(x.detach().abs().sum() * 1000) % 3):
            x = x + 0.0
        return self.inner(x * x)


def test_keys_no_profiled_micro_batch_used_are_reported_and_told_once() -> None:
    model = make_model()
    stable = bagualu2.enable(model, budget=None, policy={}, min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reference model keeps its keys, spikes included
        for i in range(8):
            step(model, i, spike=2.0 if i % 3 == 2 else 0.0)
    assert stable.report()["unplanned_keys"] == 0
    stable.disable()

    model = make_model()
    model.norm = DataDependentLoop(model.norm)
    prov = bagualu2.enable(model, budget=None, policy={}, min_bytes=0)
    with pytest.warns(UserWarning, match=r"'norm:aten\.add\.Tensor:\d'.*loop that stops early") as told:
        for i in range(12):
            step(model, i)
    assert len(told) == 1
    assert prov.report()["unplanned_keys"] >= 1


def test_runtime_measures_rebuilds_and_copies_and_the_provisioner_feeds_the_cost_model() -> None:
    model = make_model()
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0)
    prov.runtime.backward_observer = None  # the measurements are read here, not learned from
    step(model, 0)
    replays = prov.runtime.take_replay_times()
    assert replays and all(s > 0 and n >= 1 for s, n in replays.values())
    assert prov.runtime.take_replay_times() == {}  # taken: counting starts again
    # Adaptive under a budget the worst routing would not fit recomputes (its calibrating
    # micro-batches all they can, whatever the timings: under 80% of the peak without
    # rebuilding anything twice); as each backward ends, the provisioner hands the measured
    # rebuilds to the cost model, and how long learning them took (the step pays for it).
    model = make_model()
    adaptive = bagualu2.enable(model, budget=int(keep_all_peak(model) * 0.8), min_bytes=0)
    for i in range(adaptive.profile_frames + adaptive.calibrate_frames):
        step(model, i)
        assert adaptive.runtime.take_replay_times() == {} and adaptive.runtime.take_copy_times()[1] == 0
    assert adaptive.report()["saved_bytes_by_choice"]["recompute"] > 0
    assert adaptive.cost._op_replays and adaptive.cost._replay_fit.observed
    assert adaptive.cost.learning_seconds("replays", 10) > 0
    offloading = bagualu2.enable(make_model(), budget=None, policy="offload_all", min_bytes=0)
    offloading.runtime.backward_observer = None
    step(offloading.model, 0)
    seconds, copies, nbytes = offloading.runtime.take_copy_times()
    assert seconds > 0 and copies > 0 and nbytes >= copies
    offloading.runtime.backward_observer = offloading._learn
    step(offloading.model, 1)
    assert offloading.runtime.take_copy_times()[1] == 0 and offloading.cost.learning_seconds("copies", copies) > 0


def test_learning_costs_its_refit_once_whatever_was_learned() -> None:
    """Learning from rebuilds of 100 op calls took 1.2 ms, of which refitting the shared fit
    (timed by the model's clock) took 0.1 ms: a plan whose rebuilds replay 10 op calls pays
    the refit whole and a tenth of the rest (0.21 ms), not a tenth of it all (0.12 ms)."""
    from bagualu2.plan.cost_model import CostModel

    now = [0.0]

    def clock() -> float:  # each reading 0.1 ms after the last: a refit between two takes 0.1 ms
        now[0] += 1e-4
        return now[0]

    cost = CostModel({}, clock=clock)
    assert cost.learning_seconds("replays", 10) == 0.0  # nothing learned yet
    cost.observe({"a:op:0": (1000, 1e-3, True, ())}, {}, forward_seconds=0.05)
    for _ in range(3):
        cost.observe_replays({"a:op:0": (1e-3, 1)}, {})
        cost._observed["replays"] = 100  # as if its rebuilds had replayed 100 op calls
        cost.observe_learning("replays", 1.2e-3)
    assert cost.learning_seconds("replays", 100) == pytest.approx(1.2e-3)
    assert cost.learning_seconds("replays", 10) == pytest.approx(1e-4 + 1.1e-3 / 10)
    # The refit is the part of what learning took that it measured, never more.
    cost.observe_copies(1e-3, copies=2, nbytes=10**6)
    cost.observe_learning("copies", 5e-5)
    assert cost.learning_seconds("copies", 2) == pytest.approx(5e-5)
    assert cost.learning_seconds("copies", 0) == pytest.approx(5e-5)


@settings(max_examples=200, deadline=None)
@given(coef=st.tuples(st.floats(0, 1e-2), st.floats(0, 1e-3), st.floats(0.05, 5.0)),
       obs=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 64), st.floats(1e-5, 1e-1)), min_size=1, max_size=12),
       noise=st.lists(st.floats(-0.5, 0.5), min_size=12, max_size=12))
def test_cost_fit_reproduces_exact_costs_and_never_goes_negative(coef, obs, noise) -> None:
    from bagualu2.plan.cost_model import _CostFit

    exact, noisy, anchored, bucketed = _CostFit(3), _CostFit(3), _CostFit(3, prior_sd=0.1), _CostFit(3)
    floored, noisy_floored = _CostFit(3, prior_sd=0.1, floor=0.5), _CostFit(3, floor=0.5)
    zeroed, noisy_zeroed = _CostFit(3, zero_sd={0: 1e-4}), _CostFit(3, prior_sd=0.1, zero_sd={0: 1e-4, 1: 1e-5})
    for x, e in zip(obs, noise):
        y = sum(c * v for c, v in zip(coef, x))
        exact.add([(x, y)])
        bucketed.add([(x, y)], [x[0]])
        anchored.add([(x, y)])
        floored.add([(x, y)])
        zeroed.add([(x, y)])
        noisy.add([(x, y * (1 + e))])
        noisy_floored.add([(x, y * (1 + e))])
        noisy_zeroed.add([(x, y * (1 + e))])
        assert min(noisy.coef) >= 0 and min(exact.coef) >= 0 and min(anchored.coef) >= 0 and min(noisy_zeroed.coef) >= 0
        for fit in (floored, noisy_floored):  # the factor never below its floor, the rest >= 0
            assert fit.coef[-1] >= 0.5 and min(fit.coef) >= 0
    # Whatever split it finds, exact observations are reproduced, with a prior on the factor too,
    # and with a floor the factor they were made with is above (at the floor itself, as at 0
    # without one, rounding can leave the exact fit's factor a hair below and out of reach).
    # A part too small to lower the residual by more than the fit's tie tolerance is left out
    # (a coefficient of 1e-6 on 5 items of a 0.07 s total: 4e-5 off), and a prior toward 0 on
    # another part then weighs that residual as noise (1.2e-4 off): 3e-4 leaves room for both.
    for x in obs:
        for fit in (exact, anchored, bucketed, zeroed) + ((floored,) if coef[-1] >= 0.55 else ()):
            assert sum(c * v for c, v in zip(fit.coef, x)) == pytest.approx(sum(c * v for c, v in zip(coef, x)), rel=3e-4)


def test_cost_fit_forgets_only_the_buckets_a_batch_observes() -> None:
    """Rebuilds of one op cost 20 us + 150 us each, and one of 128 ops 20 us per op + 150 us:
    observed once, then 300 batches of one-op rebuilds alone (as budget plans replay) that
    cannot tell the per-op part from the per-rebuild part. In one bucket the large rebuild is
    forgotten (and predicted at 3.4x its cost); in buckets by size it stays known."""
    from bagualu2.plan.cost_model import _CostFit

    def cost(ops: int, seconds: float) -> float:
        return 20e-6 * ops + 150e-6 + seconds

    large, small = (128.0, 1.0, 5e-3), (1.0, 1.0, 40e-6)
    shared, bucketed = _CostFit(3, relative=False), _CostFit(3, relative=False)
    for fit, buckets in ((shared, None), (bucketed, [8, 1])):
        fit.add([(large, cost(128, 5e-3)), (small, cost(1, 40e-6))], buckets)
        for i in range(300):
            noisy = cost(1, 40e-6) * (1.2 if i % 2 else 0.8)  # one-op rebuilds alone, noisy
            fit.add([((1.0, 1.0, 40e-6), noisy)], buckets and [1])

    def predict(fit: _CostFit) -> float:
        return sum(c * v for c, v in zip(fit.coef, large))

    assert predict(bucketed) == pytest.approx(cost(128, 5e-3), rel=0.05)
    assert abs(predict(shared) / cost(128, 5e-3) - 1) > 1.0


@pytest.mark.parametrize("spread", [0.2, 0.3])
def test_relative_cost_fit_is_not_biased_low_by_noise(spread: float) -> None:
    """Copy times of 1 ms + 2 ms per predicted ms, each observed low, on the mark and high by
    ``spread`` in turn (mean on the mark), none forgotten. Weighed by the observed totals, the
    fit would come out 5% (20% spread) to 12% (30%) low, as low totals weigh most; weighed by
    the totals it expected, it stays on the mark."""
    from bagualu2.plan.cost_model import _CostFit

    fit = _CostFit(2, memory=1.0)
    for i in range(300):
        predicted = (0.5e-3, 1e-3, 2e-3)[i % 3]
        noise = (1 - spread, 1.0, 1 + spread)[i // 3 % 3]
        fit.add([((1.0, predicted), (1e-3 + 2 * predicted) * noise)])
    for predicted in (0.5e-3, 1e-3, 2e-3):
        assert sum(c * v for c, v in zip(fit.coef, (1.0, predicted))) == pytest.approx(1e-3 + 2 * predicted, rel=0.02)


def test_replay_factor_keeps_its_floor_when_cheap_rebuilds_measure_flat() -> None:
    """Rebuilds of cheap ops that all measured about 300 us whatever their profiled time (as
    elementwise ops and gathers did on the benchmark model): fitted freely, the factor on the
    ops' time goes to 0.1 and a rebuild of every matmul (130 ms profiled) is predicted at a
    fraction of that; the replay fit's floor keeps it at half at least."""
    from bagualu2.plan.cost_model import REPLAY_FACTOR_FLOOR, REPLAY_FACTOR_SD, CostModel, _CostFit

    rows = [((0.0, 1.0, 1.0, p), 280e-6 + 0.1 * p) for p in (40e-6, 120e-6, 400e-6, 600e-6)]
    free = _CostFit(4, relative=False, prior_sd=REPLAY_FACTOR_SD)
    cost = CostModel({})
    for _ in range(4):
        free.add(rows)
        cost._replay_fit.add(rows)
    assert free.coef[-1] == pytest.approx(0.1, abs=0.02)  # the case the floor is for
    assert cost.replay_factor >= REPLAY_FACTOR_FLOOR == 0.5
    assert cost._fitted(249, 0.13) >= 0.5 * 0.13


def test_offloads_run_their_own_ops_past_the_dispatch_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's own ops on a plain saved tensor (here an offload's byte view of its storage
    and the engine's ops) skip the tracing mode: through it, even suspended, each costs 10 to
    20 us more."""
    model = make_model()
    prov = bagualu2.enable(model, budget=None, policy="offload_all", min_bytes=0)
    seen: List[Any] = []
    mode_type = type(prov.runtime.mode)
    through = mode_type.__torch_dispatch__

    def counting(self: Any, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        seen.append(func)
        return through(self, func, types, args, kwargs)

    monkeypatch.setattr(mode_type, "__torch_dispatch__", counting)
    step(model, 0)
    offloaded = prov.telemetry.micro_batches[-1]
    assert offloaded.bytes_by_choice["offload"] > 0 and offloaded.traced
    assert seen  # the model's ops went through the mode, ...
    assert torch.ops.aten.set_.source_Storage not in seen  # ... the offloads' views did not
