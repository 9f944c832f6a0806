"""torch.compile'd models: each compiled region is one unit of the plan (docs/CONTRACTS.md).

Invariants defended: exactness (loss and every gradient bit for bit against the same compiled
model without bagualu2, same compile options, for keep_all, offload_all, recompute_all, a
random fixed plan and adaptive through spikes; blocks compiled with ``torch.compile(block)``
and ``block.compile()``, and the whole model, ``fullgraph`` on and off); budget (adaptive under
a budget 5% above the calm keep-all peak holds it through a spike that pushes keep_all over);
compiled code stays compiled (no recompiles beyond the model's own, and the tracing mode never
reaches Dynamo); gates inside ``fullgraph=True`` blocks report the real routing at run time and
decide the region's choice before it is packed; CUDA-graph options are refused at ``enable``.

Fast lane: ``backend="aot_eager"`` on tiny models (Dynamo and AOT autograd, no C++ build). Slow
lane: the full matrix, and inductor (which compiles C++ here).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import bagualu2
from bagualu2 import Choice

sys.path.insert(0, str(Path(__file__).parent))
from compile_models import (  # noqa: E402
    compile_model, dense, inner, mismatches, random_plan, reference, run_steps,
)
from test_aliasing import _POLICIES as ALIASING_POLICIES, _adversary as aliasing_adversary  # noqa: E402
from test_aliasing import _program as aliasing_program, ALIASES, SLOTS as ALIASING_SLOTS  # noqa: E402

# Dynamo reads ``.grad`` of non-leaf inputs as it builds their fakes (torch's own filter for that
# warning does not hold under "error"); inductor imports torch.utils.mkldnn, which warns that
# torch.jit.script_method is deprecated.
pytestmark = [pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]

SPIKES = [False, False, False, False, True, False, True, False]
POLICIES = ("keep_all", "offload_all", "recompute_all", "random_plan", "adaptive")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _keys(model: torch.nn.Module, make: Any, how: str, options: Dict[str, Any]) -> List[str]:
    """The plan keys a forward of ``model``'s build saves (regions and traced operators)."""
    probe = compile_model(make(), how, **options)
    prov = bagualu2.enable(probe, budget=None, policy=bagualu2.Plan({}), min_bytes=0, profile_frames=1)
    run_steps(probe, [False])
    keys = sorted(prov.cost.order)
    prov.disable()
    return keys


def _calm_peak(make: Any, how: str, options: Dict[str, Any]) -> int:
    probe = compile_model(make(), how, **options)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    run_steps(probe, [False, False])
    return prov.report()["peak_bytes"]


def _check(make: Any, how: str, policy: str, **options: Any) -> Dict[str, Any]:
    """Run ``policy`` against the same compiled model without bagualu2; returns the report."""
    plain = compile_model(make(), how, **options)
    expected = run_steps(plain, SPIKES)
    plain_graphs = _graphs()
    torch._dynamo.reset()
    counters.clear()
    budget = None
    chosen: Any = policy
    if policy == "random_plan":
        keys = _keys(plain, make, how, options)
        assert any(k.endswith(":compiled") for k in keys), keys
        chosen = bagualu2.Plan(random_plan(keys, seed=3))
        torch._dynamo.reset()
        counters.clear()
    elif policy == "adaptive":
        budget = int(_calm_peak(make, how, options) * 1.05)
        torch._dynamo.reset()
        counters.clear()
    model = compile_model(make(), how, **options)
    prov = bagualu2.enable(model, budget=budget, policy=chosen, min_bytes=0)
    got = run_steps(model, SPIKES)
    assert mismatches(expected, got) == [], f"{how} {policy}: not bit-exact"
    assert _graphs() == plain_graphs, f"{how} {policy}: {_graphs()} graphs compiled, {plain_graphs} without bagualu2"
    report = prov.report()
    assert prov.runtime.ledger.resident == 0, "activations left counted after the last backward"
    if policy == "adaptive":
        assert report["violations"] == 0, report
        assert report["peak_bytes_with_backward"] <= budget, (report["peak_bytes_with_backward"], budget)
    return report


# -- fast lane (what compiles is in the slow lane: a few seconds each here at best) ------------------------------------------------------------------------------------
def tiny_dense() -> torch.nn.Module:
    return dense(hidden=8, layers=2, num_experts=2, top_k=1, vocab=16)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute_all", "offload_all"])
def test_fullgraph_compiled_blocks_are_bit_exact(policy: str) -> None:
    report = _check(tiny_dense, "blocks", policy, backend="aot_eager", fullgraph=True)
    if policy == "recompute_all":
        assert report["saved_bytes_by_choice"]["recompute"] > 0
    else:
        assert report["saved_bytes_by_choice"]["offload"] > 0


def test_gates_inside_fullgraph_blocks_report_the_real_routing() -> None:
    """The gate hook inside compiled code runs (through the report op) on every call with the
    routing of that micro-batch, calm or spiked, and the spike is seen."""
    model = compile_model(tiny_dense(), "blocks", backend="aot_eager", fullgraph=True)
    eager = tiny_dense()
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    seen = []
    for i, spike in enumerate([False, True, False]):
        run_steps(model, [spike])
        with torch.no_grad():
            eager.spike(spike)
            h = eager.embed(torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(100)))
            torch.manual_seed(0)
            block = eager.layers[0]
            x = h + block.drop(torch.tanh(block.attn(block.norm(h))))
            _, _, indices = block.mlp.gate(x.reshape(-1, x.shape[-1]))
        counts = torch.bincount(indices.reshape(-1), minlength=2).tolist()
        assert prov.routing.counts[0] == counts, (i, prov.routing.counts, counts)
        seen.append(counts[0])
    assert seen[1] == 32 and seen[0] < 32 and seen[2] < 32, seen  # the spike is seen, and only there
    assert prov.report()["micro_batches"] == 3


@pytest.mark.slow
def test_the_tracing_mode_never_reaches_dynamo() -> None:
    """A traced frame (offload_all) around compiled blocks: Dynamo compiles no frame of
    bagualu2's (the dispatch mode, the saved-tensor hooks, the gate callback)."""
    model = compile_model(tiny_dense(), "blocks", backend="aot_eager", fullgraph=True)
    bagualu2.enable(model, budget=None, policy="offload_all", min_bytes=0)
    seen: List[str] = []
    original = torch._dynamo.convert_frame.ConvertFrameAssert.__call__

    def spy(self: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(frame.f_code.co_filename)
        return original(self, frame, *args, **kwargs)

    torch._dynamo.convert_frame.ConvertFrameAssert.__call__ = spy
    try:
        run_steps(model, [False, True])
    finally:
        torch._dynamo.convert_frame.ConvertFrameAssert.__call__ = original
    assert seen and not [f for f in seen if "bagualu2" in f and "models" not in f], seen


@pytest.mark.parametrize("options, named", [
    (dict(mode="reduce-overhead"), "reduce-overhead"),
    (dict(options={"triton.cudagraphs": True}), "triton.cudagraphs"),
    (dict(backend="cudagraphs"), "cudagraphs"),
])
@pytest.mark.parametrize("how", ["blocks", "method", "whole"])
def test_cuda_graph_options_are_refused_at_enable(options: Dict[str, Any], named: str, how: str) -> None:
    model = compile_model(tiny_dense(), how, **options)
    with pytest.raises(ValueError, match=named):
        bagualu2.enable(model, budget=None)


def test_the_partitioners_memory_budget_is_refused_at_enable() -> None:
    model = compile_model(tiny_dense(), "blocks", backend="aot_eager")
    # torch's own patch: a monkeypatch of its config module deletes the entry on undo.
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        with pytest.raises(ValueError, match="activation_memory_budget=0.5"):
            bagualu2.enable(model, budget=None)


def test_region_keys_in_a_fixed_plan_are_checked() -> None:
    model = compile_model(tiny_dense(), "blocks", backend="aot_eager")
    bagualu2.enable(model, budget=None, policy=bagualu2.Plan({"layers.0:compiled": Choice.RECOMPUTE})).disable()
    with pytest.raises(ValueError, match="no compiled region"):
        bagualu2.enable(model, budget=None, policy=bagualu2.Plan({"embed:compiled": Choice.RECOMPUTE}))


class _Tally(torch.nn.Module):
    """Tokens per expert from the router's choices: a gate without parameters of its own."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(indices.reshape(-1), self.num_experts).sum(0)


def _tallied_dense() -> torch.torch.nn.Module:
    """``tiny_dense`` whose blocks also count their routing in a parameterless module."""
    model = tiny_dense()
    for block in model.layers:
        block.mlp.tally = _Tally(2)
        forward = block.forward

        def counted(x: torch.Tensor, _block: torch.nn.Module = block, _forward: Any = forward) -> torch.Tensor:
            _, _, indices = _block.mlp.gate(x.reshape(-1, x.shape[-1]))
            _block.mlp.tally(indices)
            return _forward(x)

        block.forward = counted
    return model


def test_a_gate_without_parameters_inside_fullgraph_blocks_reports_without_a_graph_break() -> None:
    """A gate module with no parameter of its own, inside ``fullgraph=True`` blocks, reports
    its counts through the region hook (alone, its eager hook broke the graph: an error under
    fullgraph); the steps stay bit-exact, and disable takes back the buffer that told it apart."""
    plain = compile_model(_tallied_dense(), "blocks", backend="aot_eager", fullgraph=True)
    expected = run_steps(plain, [False, True, False])
    torch._dynamo.reset()  # the blocks share their code: enable before it is compiled
    model = compile_model(_tallied_dense(), "blocks", backend="aot_eager", fullgraph=True)
    buffers = {name for name, _ in model.named_buffers()}
    state = set(model.state_dict())
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0, gates=[])
    tallies = [inner_block.mlp.tally for inner_block in (inner(b) for b in model.layers)]
    for layer, tally in enumerate(tallies):
        prov.register_gate(tally, 2, lambda module, args, out: out, layer=layer)
    reported: List[List[int]] = []
    got = run_steps(model, [False, True, False],
                    hook=lambda i: reported.append([sum(prov.routing.counts[layer]) for layer in (0, 1)]))
    assert mismatches(expected, got) == []
    assert reported == [[32, 32]] * 3, reported  # 2 x 16 tokens, top-1, each layer each micro-batch
    assert set(model.state_dict()) == state  # the anchor is not persistent
    prov.disable()
    assert {name for name, _ in model.named_buffers()} == buffers


def test_the_region_report_finds_each_gate_when_their_parameters_move() -> None:
    """FSDP2 frees and gathers a gate's parameters around every forward: an address a gate had
    may be another gate's by the next report. Each report reaches the gate whose anchor it
    carries, however their addresses moved, and a gate without parameters is told by its own."""
    from bagualu2.provision.region_gates import ANCHOR, RegionGates
    from bagualu2.runtime.gates import GateSpec
    from bagualu2.runtime.regions import report_gate

    heard: List[str] = []
    gates = RegionGates(lambda spec: lambda module, args, output: heard.append(spec.name))
    a, b, tally = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), _Tally(2)
    for layer, (name, module) in enumerate([("a", a), ("b", b), ("tally", tally)]):
        gates.add(GateSpec(module, name, layer, 2, lambda module, args, out: out))
    assert [name for name, _ in tally.named_buffers()] == [ANCHOR]
    x = torch.ones(2)
    for module in (a, b, tally, a):
        report_gate(gates.slot, next(iter(module.parameters(recurse=False)), None)
                    if module is not tally else getattr(tally, ANCHOR), (x,), x)
    old_b = b.weight
    b.weight = torch.nn.Parameter(torch.zeros(2, 2))
    a.weight = old_b  # a's anchor now sits where b's was
    report_gate(gates.slot, a.weight, (x,), x)
    report_gate(gates.slot, b.weight, (x,), x)
    assert heard == ["a", "b", "tally", "a", "a", "b"]
    gates.close()
    assert list(tally.named_buffers()) == []


def test_disable_gives_the_compiled_model_back() -> None:
    model = compile_model(tiny_dense(), "whole", backend="aot_eager", fullgraph=True)
    forward = model.forward
    prov = bagualu2.enable(model, budget=None, policy="recompute_all")
    assert model.forward is not forward
    prov.disable()
    assert model.forward is forward
    copy.deepcopy(inner(model))  # no hook of bagualu2's left behind that a copy would carry


@pytest.mark.parametrize("how", ["blocks", "method"])
def test_code_compiled_before_enable_is_named_at_the_first_forward(how: str) -> None:
    """Dynamo does not recompile for the gate hooks ``enable`` adds: blocks compiled by a
    forward before ``enable`` run without the gates' reports. The first provisioned forward
    says so, naming the gates; after ``torch._dynamo.reset()`` they report and nothing warns."""
    model = compile_model(tiny_dense(), how, backend="aot_eager", fullgraph=True)
    run_steps(model, [False])  # compiled here, before enable
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    gate = r"'layers\.{}\.(_orig_mod\.)?mlp\.gate'"  # torch.compile(block) puts _orig_mod in the path
    with pytest.warns(UserWarning, match=f"{gate.format(0)}, {gate.format(1)} inside compiled code did not report "
                                         r".* before bagualu2\.enable"):
        run_steps(model, [False])
    assert prov.routing.counts == {}  # what the warning is about: no gate decided
    run_steps(model, [False])  # told once
    prov.disable()

    torch._dynamo.reset()
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    run_steps(model, [False, True])  # filterwarnings=error: any warning fails here
    assert sorted(prov.routing.counts) == [0, 1]


# -- slow lane ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["blocks", "method", "whole"])
def test_reference_model_compiled_is_bit_exact(how: str, policy: str) -> None:
    """The reference model (graph breaks at its token split: fullgraph off), per policy. The
    whole model compiled is one region: recompute_all reruns it in backward without compiling
    anything again (the rerun's pack hook runs between its graphs, hidden from Dynamo);
    adaptive never reruns it (its rerun would bring back every save at once, so only moving
    the peak into backward), calibration included, and offloads it instead."""
    report = _check(reference, how, policy, backend="aot_eager")
    if how == "whole" and policy == "adaptive":
        assert report["saved_bytes_by_choice"]["recompute"] == 0, report["saved_bytes_by_choice"]
        assert report["saved_bytes_by_choice"]["offload"] > 0, report["saved_bytes_by_choice"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["blocks", "whole"])
def test_fullgraph_dense_moe_is_bit_exact(how: str, policy: str) -> None:
    _check(lambda: dense(), how, policy, backend="aot_eager", fullgraph=True)


@pytest.mark.slow
def test_a_gate_after_a_graph_break_plans_from_what_its_region_saved_already() -> None:
    """The reference model's router breaks its compiled block's graph before the gate reports,
    so the block has saved its first part (and read its choice) by then. The gate plans from
    that, not from the block's whole prediction on top of it: a calm micro-batch's first decision
    predicts about its keep-all peak and releases no block."""
    options = dict(backend="aot_eager")
    spikes = [False] * 4 + [True] + [False] * 3 + [True] + [False] * 3
    probe = compile_model(reference(), "blocks", **options)
    keep_all = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    run_steps(probe, spikes)
    keep = [mb.peak_bytes for mb in keep_all.telemetry.micro_batches]
    budget = int(max(k for k, spike in zip(keep, spikes) if not spike) * 1.05)
    torch._dynamo.reset()
    model = compile_model(reference(), "blocks", **options)
    prov = bagualu2.enable(model, budget=budget, policy="adaptive", min_bytes=0)
    run_steps(model, spikes)
    first: Dict[int, Any] = {}
    for decision in prov.telemetry.decisions:
        first.setdefault(decision.micro_batch, decision)
    planned = [mb for mb in prov.telemetry.micro_batches
               if mb.micro_batch in first and not spikes[mb.micro_batch] and not mb.calibrating]
    assert planned, "no calm micro-batch was planned at its gates"
    for mb in planned:
        i = mb.micro_batch
        assert first[i].predicted_bytes <= keep[i] * 1.05, (i, first[i].predicted_bytes, keep[i])
        released = mb.bytes_by_choice["offload"] + mb.bytes_by_choice["recompute"]
        assert released <= keep[i] * 0.1, (i, dict(mb.bytes_by_choice), keep[i])


@pytest.mark.slow
def test_adaptive_holds_a_budget_keep_all_crosses_in_a_spike() -> None:
    """5% above the calm keep-all peak: keep_all crosses it in the spike, adaptive does not."""
    options = dict(backend="aot_eager")
    budget = int(_calm_peak(reference, "blocks", options) * 1.05)
    model = compile_model(reference(), "blocks", **options)
    prov = bagualu2.enable(model, budget=budget, policy="keep_all", min_bytes=0)
    with pytest.warns(UserWarning, match="went over the activation budget"):
        run_steps(model, SPIKES)
    assert prov.report()["violations"] > 0, "the spike must push keep_all over the budget"
    report = _check(reference, "blocks", "adaptive", **options)
    assert report["saved_bytes_by_choice"]["offload"] + report["saved_bytes_by_choice"]["recompute"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute_all", "adaptive"])
@pytest.mark.parametrize("how", ["blocks", "whole"])
def test_inductor_is_bit_exact(how: str, policy: str) -> None:
    """Inductor's own kernels: the rerun in backward runs the same compiled code."""
    _check(lambda: dense(), how, policy, fullgraph=True)


@pytest.mark.slow
@pytest.mark.cuda_only
@pytest.mark.parametrize("policy", ["offload_all", "recompute_all"])
def test_inductor_on_a_gpu_is_bit_exact(policy: str) -> None:
    """Triton kernels, the CUDA copy engine and its prefetch around compiled blocks (needs a GPU)."""
    def make() -> torch.nn.Module:
        return dense().cuda()

    plain = compile_model(make(), "blocks", fullgraph=True)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16), device="cuda")
    expected = []
    for i in range(3):
        torch.manual_seed(i)
        loss = plain(tokens)
        loss.backward()
        expected.append((loss.detach(), [p.grad.clone() for p in inner(plain).parameters() if p.grad is not None]))
        plain.zero_grad(set_to_none=True)
    model = compile_model(make(), "blocks", fullgraph=True)
    bagualu2.enable(model, budget=None, policy=policy, min_bytes=0)
    got = []
    for i in range(3):
        torch.manual_seed(i)
        loss = model(tokens)
        loss.backward()
        got.append((loss.detach(), [p.grad.clone() for p in inner(model).parameters() if p.grad is not None]))
        model.zero_grad(set_to_none=True)
    assert mismatches(expected, got) == []


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["offload_all", "recompute_all", "adaptive"])
def test_hugging_face_qwen3_moe_with_compiled_layers_is_bit_exact(policy: str) -> None:
    """A transformers 5.x MoE family: every decoder layer ``torch.compile``d (aot_eager), its
    router found inside compiled code and reporting through the report op."""
    transformers = pytest.importorskip("transformers")

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=3, head_dim=8, use_cache=False))
        layers = model.model.layers
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i], backend="aot_eager")
        return model

    def run(model: torch.nn.Module) -> list:
        out = []
        for i in range(4):
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        return out

    expected = run(make())
    torch._dynamo.reset()
    model = make()
    budget = None
    if policy == "adaptive":
        probe = make()
        prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
        run(probe)
        budget = int(prov.report()["peak_bytes"] * 0.7)  # tight: the regions must be released
    prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0)
    assert len(prov.gates) == 2 and all(".mlp.gate" in g.name for g in prov.gates)
    got = run(model)
    assert mismatches(expected, got) == []
    assert prov.routing.counts and sum(prov.routing.counts[0]) == 2 * 16 * 3  # reported from compiled code
    report = prov.report()
    released = report["saved_bytes_by_choice"]["offload"] + report["saved_bytes_by_choice"]["recompute"]
    assert released > 0, report
    if policy == "adaptive":
        assert report["violations"] == 0, report



# -- Python-side state a compiled block reads (issue #61) ---------------------------------------------------------
# A compiled block rerun whole in backward runs its compiled code again, which reads what it reads
# besides its arguments (a module attribute, a container, a buffer) as backward finds it. No tracer
# sees those reads inside compiled code; Dynamo's guards name them (``regions.CompiledReads``).
SW = 8


class _Stash(torch.nn.Module):
    """Stashes an activation of its own on itself (``kept``: a storage nothing saves)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(SW, SW) / SW ** 0.5)
        self.kept: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x @ self.w)
        self.kept = y * 1.0
        return y


class _Reader(torch.nn.Module):
    """Reads the stash of another block (held in a list: not a submodule) into what it saves."""

    def __init__(self, source: _Stash) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(SW, SW) / SW ** 0.5)
        self.source = [source]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x + self.source[0].kept) @ self.w)


class _Counted(torch.nn.Module):
    """Reads a buffer of its own in its forward, and writes it there (``counts``: a running
    statistic) or not."""

    def __init__(self, counts: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(SW, SW) / SW ** 0.5)
        self.register_buffer("level", torch.ones(SW))
        self.counts = counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid((x + self.level) @ self.w)
        if self.counts:
            self.level.mul_(1.25)
        return y


class _StateModel(torch.nn.Module):
    def __init__(self, counted: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        stash = _Stash()
        self.blocks = torch.nn.ModuleList([stash, _Reader(stash)] + ([_Counted(counted)] if counted is not None else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _state_step(model: _StateModel, x: torch.Tensor, write: Any) -> List[torch.Tensor]:
    """Loss and every gradient of one step, ``write(model)`` run between forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = model(x)
    with torch.no_grad():
        write(model)
    loss.backward()
    return [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]


def _run_state_model(policy: Any, write: Any, counted: Any = None, steps: int = 3) -> List[Any]:
    """``steps`` steps of ``_StateModel`` with blocks compiled under ``policy``, each compared bit
    for bit with the same compiled model without bagualu2; its frames."""
    plain, model = _StateModel(counted), _StateModel(counted)
    for m in (plain, model):
        for block in m.blocks:
            block.compile(backend="aot_eager")
    x = torch.randn(4, SW)
    frames: List[Any] = []
    prov = bagualu2.enable(model, budget=None, policy=policy, gates=[], min_bytes=0)
    prov.runtime.on_frame_end.subscribe(frames.append)
    try:
        for i in range(steps):
            expected, got = _state_step(plain, x, write), _state_step(model, x, write)
            for j, (a, b) in enumerate(zip(expected, got)):
                assert torch.equal(a, b), f"step {i}: {'loss' if j == 0 else f'gradient {j - 1}'} differs"
        for a, b in zip(plain.buffers(), model.buffers()):
            assert torch.equal(a, b), "a buffer differs from plain PyTorch's"
    finally:
        prov.disable()
    return frames


def _write_the_stash(model: _StateModel) -> None:
    model.blocks[0].kept.mul_(1.5)


@pytest.mark.parametrize("policy", ["recompute_all", "plan"])
def test_a_compiled_block_reading_a_module_attribute_written_after_forward_is_exact(policy: str) -> None:
    """The issue's shape: compiled block 1 reads block 0's stash through a module attribute, and
    the stash is written in place between forward and backward. Rerun whole, block 1 would read
    the written stash (gradients off, no error from plain PyTorch's autograd: nothing saved it):
    its guards name the read, so it is offloaded, counted as a fallback naming the source, and
    block 0 (which reads only its argument and parameter) is still rerun."""
    plan: Any = "recompute_all" if policy == "recompute_all" else bagualu2.Plan(
        {"blocks.0:compiled": Choice.RECOMPUTE, "blocks.1:compiled": Choice.RECOMPUTE})
    frames = _run_state_model(plan, _write_the_stash)
    for frame in frames:
        assert any(f.startswith("blocks.1:compiled: recompute -> offload (it reads L['self'].source[0].kept")
                   for f in frame.stats.fallbacks), frame.stats.fallbacks
        assert not any(f.startswith("blocks.0:") for f in frame.stats.fallbacks), frame.stats.fallbacks
        assert frame.stats.rerun_blocks == 1


def test_a_compiled_block_writing_its_own_buffer_reruns_from_what_it_read() -> None:
    """Block 2 reads a buffer of its own and then writes it in its forward: its first call
    planned to be rerun reruns from a copy of the buffer as it read it (and writes the copy,
    not the buffer, again); its later calls are not rerun. Loss, gradients and the buffer match
    plain PyTorch's."""
    frames = _run_state_model("recompute_all", lambda m: None, counted=True)
    assert frames[0].stats.rerun_blocks == 2  # blocks 0 and 2 (block 1 reads block 0's stash)
    assert not any(f.startswith("blocks.2:") for f in frames[0].stats.fallbacks), frames[0].stats.fallbacks
    for frame in frames[1:]:
        assert frame.stats.rerun_blocks == 1
        assert any(f.startswith("blocks.2:compiled: recompute -> offload") for f in frame.stats.fallbacks)


def test_a_buffer_a_rerun_block_reads_written_after_forward_is_refused() -> None:
    """A buffer a compiled block reads, written in place between forward and backward after the
    block was seen leaving it as it was: its rerun would read the written buffer, and refuses
    instead, naming it (as autograd refuses a saved tensor written in place)."""
    model = _StateModel(counted=False)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", gates=[], min_bytes=0)
    x = torch.randn(4, SW)
    try:
        _state_step(model, x, lambda m: None)
        with pytest.raises(RuntimeError, match=r"level of block blocks\.2, which its compiled code reads"):
            _state_step(model, x, lambda m: m.blocks[2].level.add_(1.0))
    finally:
        prov.disable()


# tests/test_aliasing.py's adversary with every block compiled (``block.compile()``): generated
# blocks stash aliases of their activations on modules, buffers and containers, write them in
# place with and without grad, and read them in later blocks; under every policy, random fixed
# plans and adaptive under a tight budget; loss and every gradient bit for bit with the same
# compiled model without bagualu2, at every step.
# Each program also stashes an alias of a fresh activation in block 0, reads it by adding it
# (``("read", slot, "add")``: nothing saves it, so plain PyTorch's autograd lets a write of it
# pass) and writes it in place after that read, in the same block or a later one: a rerun of the
# reading block that read it as backward finds it would differ.
_ADVERSARY = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def _compiled_program(draw: Any) -> List[List[tuple]]:
    slot = draw(st.sampled_from(ALIASING_SLOTS))
    # Every read of that slot adds (a read that saved it would make plain PyTorch refuse the write).
    blocks = [[("read", a[1], "add") if a[0] == "read" and a[1] == slot else a for a in block]
              for block in draw(aliasing_program())]
    blocks[0].append(("stash", slot, draw(st.sampled_from(ALIASES)), False))
    c = draw(st.integers(1, len(blocks) - 1))
    blocks[c].insert(draw(st.integers(0, len(blocks[c]))), ("read", slot, "add"))
    d = draw(st.integers(c, len(blocks) - 1))
    at = len(blocks[d]) if d == c else draw(st.integers(0, len(blocks[d])))
    blocks[d].insert(at, ("write", slot, draw(st.sampled_from(("mul", "add", "part"))), draw(st.booleans())))
    return blocks


@settings(max_examples=8, **_ADVERSARY)
@given(data=st.data(), blocks=_compiled_program(), policy=st.sampled_from(ALIASING_POLICIES))
def test_adversary_with_compiled_blocks(data: st.DataObject, blocks: List[List[tuple]], policy: str) -> None:
    torch._dynamo.reset()
    aliasing_adversary(data, blocks, policy, compile_blocks=True)


@pytest.mark.slow
@settings(max_examples=60, **_ADVERSARY)
@given(data=st.data(), blocks=_compiled_program(), policy=st.sampled_from(ALIASING_POLICIES))
def test_adversary_with_compiled_blocks_at_length(data: st.DataObject, blocks: List[List[tuple]], policy: str) -> None:
    torch._dynamo.reset()
    aliasing_adversary(data, blocks, policy, compile_blocks=True)
