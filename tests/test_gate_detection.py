"""Gate discovery (bagualu2.runtime.gates): every known router family is found, and the counts its hook
reports are exactly the token slots the experts then receive."""
from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch
from torch import nn

from bagualu2.models import MoEConfig, MoETransformer, load_imbalance
from bagualu2.runtime.gates import (GateSpec, counts_from_indices, counts_from_logits,
                          describe_unsupported, find_gates, register_gate_finder, register_module_gate)

BATCH, SEQ = 2, 12


def _hook_counts(specs: list[GateSpec]) -> tuple[dict[int, list[torch.Tensor]], Callable[[], None]]:
    seen: dict[int, list[torch.Tensor]] = {s.layer: [] for s in specs}
    handles = [s.module.register_forward_hook(
        lambda mod, args, out, s=s: seen[s.layer].append(s.counts_fn(mod, args, out)))
        for s in specs]
    return seen, lambda: [h.remove() for h in handles]


def _assert_counts(counts: torch.Tensor, expected: torch.Tensor, num_experts: int, top_k: int) -> None:
    assert counts.dtype == torch.int64 and counts.shape == (num_experts,)
    assert not counts.requires_grad
    assert int(counts.sum()) == BATCH * SEQ * top_k
    assert torch.equal(counts, expected), (counts.tolist(), expected.tolist())


# --- reference model -------------------------------------------------------------------------


def test_reference_model_gates_count_the_rows_each_expert_runs():
    cfg = MoEConfig.tiny(num_layers=3)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    specs = find_gates(model)
    assert [(s.layer, s.name, s.num_experts, s.top_k) for s in specs] == [
        (i, f"layers.{i}.moe.router", cfg.num_experts, cfg.top_k) for i in range(3)]
    assert [s.block_name for s in specs] == [f"layers.{i}.moe" for i in range(3)]
    rows: dict[int, list[int]] = {i: [] for i in range(3)}
    for i, layer in enumerate(model.layers):
        for expert in layer.moe.experts:
            expert.register_forward_pre_hook(lambda mod, args, i=i: rows[i].append(args[0].shape[0]))
    seen, remove = _hook_counts(specs)
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ))
    with model.routing_spike(imbalance=3.0, layers=[2]):
        model(tokens).backward()
    remove()
    for i in range(3):
        (counts,) = seen[i]
        _assert_counts(counts, torch.tensor(rows[i]), cfg.num_experts, cfg.top_k)
    assert abs(load_imbalance(seen[2][0]) - 3.0) < 0.2


# --- Hugging Face transformers 5.x -----------------------------------------------------------

try:
    import transformers
except ImportError:  # the HF tests need the optional test dependency
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, intermediate_size=32)


def _mixtral() -> nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2))


def _qwen2_moe() -> nn.Module:
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1))


def _qwen3_moe() -> nn.Module:
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, head_dim=8))


def _deepseek_v3() -> nn.Module:
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **COMMON, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))


FAMILIES: dict[str, tuple[Callable[[], nn.Module], str, list[int], int, int]] = {
    # builder, router class, decoder layers with a MoE block, num_experts, top_k
    "mixtral": (_mixtral, "MixtralTopKRouter", [0, 1], 4, 2),
    "qwen2_moe": (_qwen2_moe, "Qwen2MoeTopKRouter", [0, 1], 8, 2),
    "qwen3_moe": (_qwen3_moe, "Qwen3MoeTopKRouter", [0, 1], 8, 3),
    "deepseek_v3": (_deepseek_v3, "DeepseekV3TopkRouter", [1], 8, 2),
}


def _experts_input_counts(model: nn.Module, specs: list[GateSpec]) -> dict[int, list[torch.Tensor]]:
    """Independent count: the routing indices the experts module is actually called with."""
    modules = dict(model.named_modules())
    seen: dict[int, list[torch.Tensor]] = {s.layer: [] for s in specs}
    for s in specs:
        experts = modules[f"{s.block_name}.experts"]
        experts.register_forward_pre_hook(lambda mod, args, s=s: seen[s.layer].append(
            torch.bincount(args[1].reshape(-1), minlength=s.num_experts)))
    return seen


@needs_transformers
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_routers_are_found_and_count_what_the_experts_receive(family):
    build, router_cls, moe_layers, num_experts, top_k = FAMILIES[family]
    torch.manual_seed(0)
    model = build().eval()
    specs = find_gates(model)
    assert [(s.layer, s.name, type(s.module).__name__, s.num_experts, s.top_k) for s in specs] == [
        (n, f"model.layers.{i}.mlp.gate", router_cls, num_experts, top_k)
        for n, i in enumerate(moe_layers)]
    with torch.no_grad():
        for s in specs:
            s.module.weight.normal_()
    expected = _experts_input_counts(model, specs)
    seen, remove = _hook_counts(specs)
    with torch.no_grad():
        model(torch.randint(64, (BATCH, SEQ)))
    remove()
    for s in specs:
        _assert_counts(seen[s.layer][0], expected[s.layer][0], num_experts, top_k)
        assert int((seen[s.layer][0] > 0).sum()) > top_k  # routing is not degenerate


@needs_transformers
def test_deepseek_v3_counts_follow_group_limited_biased_selection():
    """DeepSeek-V3 chooses on sigmoid scores + e_score_correction_bias within the top groups,
    so the logits' plain top-k is not its routing: counts must come from its indices."""
    torch.manual_seed(0)
    model = _deepseek_v3().eval()
    (spec,) = find_gates(model)
    with torch.no_grad():
        spec.module.weight.normal_()
        spec.module.e_score_correction_bias[5] = 10.0
    logits_counts: list[torch.Tensor] = []
    spec.module.register_forward_hook(
        lambda mod, args, out: logits_counts.append(counts_from_logits(8, 2)(mod, args, out)))
    expected = _experts_input_counts(model, [spec])
    seen, _ = _hook_counts([spec])
    with torch.no_grad():
        model(torch.randint(64, (BATCH, SEQ)))
    counts = seen[0][0]
    _assert_counts(counts, expected[0][0], 8, 2)
    assert int(counts[5]) == BATCH * SEQ
    assert not torch.equal(counts, logits_counts[0])


# --- transformers 4.x-style gates (plain nn.Linear) ------------------------------------------


class _Expert(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _SparseMoeBlock4x(nn.Module):
    """Shaped like transformers 4.x MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden) for _ in range(num_experts))
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.reshape(-1, x.shape[-1])
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights, selected = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(selected == e)
            out[token] += weights[token, slot, None] * expert(x[token])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * x, router_logits


class _Model4x(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_SparseMoeBlock4x(16, 6, 2), _SparseMoeBlock4x(16, 4, 1)])
        self.head = nn.ModuleDict({"gate": nn.Linear(16, 16)})  # a `gate` outside any MoE block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)[0]
        return self.head["gate"](x)


def test_linear_gates_of_4x_sparse_moe_blocks_count_top_k_of_the_logits():
    torch.manual_seed(0)
    model = _Model4x()
    specs = find_gates(model)
    assert [(s.layer, s.name, s.num_experts, s.top_k) for s in specs] == [
        (0, "layers.0.gate", 6, 2), (1, "layers.1.gate", 4, 1)]
    rows: dict[int, list[int]] = {0: [], 1: []}
    for i, layer in enumerate(model.layers):
        for expert in layer.experts:
            expert.register_forward_pre_hook(lambda mod, args, i=i: rows[i].append(args[0].shape[0]))
    seen, _ = _hook_counts(specs)
    model(torch.randn(BATCH * SEQ, 16))
    for s in specs:
        _assert_counts(seen[s.layer][0], torch.tensor(rows[s.layer]), s.num_experts, s.top_k)


# --- nothing found, bad outputs ---------------------------------------------------------------


def test_unknown_model_gives_no_gates_and_a_helpful_description():
    model = nn.Sequential(nn.Linear(4, 4))
    model.router = nn.Linear(4, 3)
    assert find_gates(model) == []
    message = describe_unsupported(model)
    assert "0 MoE gate(s) recognized" in message and "router: nn.Linear(4, 3)" in message
    assert "register_gate" in message and "on_gating" in message
    assert "No other module" in describe_unsupported(nn.Linear(2, 2))


class _Dispatch(nn.Module):
    """A routing module of a model family discovery does not know by itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_registered_finders_are_asked_in_order_and_unregister():
    model = nn.Sequential(_Dispatch(), nn.Linear(4, 4), _Dispatch())
    model.add_module("router", _Dispatch())  # looks like a router: described unless a finder knows it
    counts = counts_from_indices(2)

    def family(name: str, module: nn.Module, modules: dict) -> tuple | None:
        if not isinstance(module, _Dispatch):
            return None
        return () if name.endswith("router") else (GateSpec(module, name, 99, 2, counts, 1, ""),)

    assert find_gates(model) == [] and "router: _Dispatch" in describe_unsupported(model)
    unregister = register_module_gate(family)
    try:
        specs = find_gates(model)
        # renumbered in model order; the module the finder knows as no gate is not described
        assert [(s.layer, s.name) for s in specs] == [(0, "0"), (1, "2")]
        assert "router: _Dispatch" not in describe_unsupported(model)
        engine = [GateSpec(model[1], "1", 0, 4, counts_from_indices(4))]
        unregister_engine = register_gate_finder(lambda m: engine if m is model else None)
        try:
            assert find_gates(model) == engine  # a model finder that answers decides alone
            assert [s.name for s in find_gates(nn.Sequential(model))] == ["0.0", "0.2"]
        finally:
            unregister_engine()
    finally:
        unregister()
    assert find_gates(model) == []


def test_counts_functions_reject_outputs_they_cannot_read():
    gate = nn.Identity()
    indices = counts_from_indices(4)
    assert indices(gate, (), (torch.zeros(3, 4), torch.tensor([[0, 3], [3, 3]]))).tolist() == [1, 0, 0, 3]
    with pytest.raises(TypeError, match="exactly one integer tensor"):
        indices(gate, (), (torch.zeros(3, 4), torch.zeros(3, 2)))
    with pytest.raises(ValueError, match=r"experts in \[0, 4\], outside \[0, 4\)"):
        indices(gate, (), torch.tensor([0, 4]))
    logits = counts_from_logits(3, 2)
    assert logits(gate, (), torch.tensor([[0.0, 1.0, 2.0], [5.0, 1.0, 2.0]])).tolist() == [1, 1, 2]
    with pytest.raises(TypeError, match=r"expected logits \[\.\.\., 3\]"):
        logits(gate, (), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="top_k=4, num_experts=3"):
        counts_from_logits(3, 4)


@needs_transformers
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_models_train_bit_exactly_under_a_tight_budget(family):
    """``enable`` on a Hugging Face model, trained as usual (labels, ``.loss``): the same losses
    and gradients as without it, and no micro-batch over a budget of 60% of its all-keep peak,
    the first one included (the loss reads the labels, pinned from outside, at the very end)."""
    import copy

    import bagualu2

    torch.manual_seed(0)
    model = FAMILIES[family][0]()
    plain = copy.deepcopy(model)
    tokens = torch.randint(64, (2, 24))
    probe = copy.deepcopy(model)
    keep = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    probe(tokens, labels=tokens).loss.backward()
    budget = int(keep.report()["peak_bytes"] * 0.6)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    for i in range(4):
        losses, grads = [], []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            loss = m(tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in m.parameters()])
        assert torch.equal(*losses)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*grads))
    report = prov.report()
    assert report["violations"] == 0 and report["decisions"] > 0
    assert all(m.peak_bytes <= budget for m in prov.telemetry.micro_batches)
    assert report["saved_bytes_by_choice"]["recompute"] + report["saved_bytes_by_choice"]["offload"] > 0


@needs_transformers
@pytest.mark.parametrize("use_cache", [False, True], ids=["no cache", "kv cache"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_models_rerun_their_decoder_layers_exactly_under_recompute_all(family, use_cache):
    """``recompute_all`` reruns each decoder layer whole in backward: the layers take keyword
    arguments (position embeddings, attention mask) that the rerun must pass again as they were;
    the losses and gradients stay those of plain PyTorch, with a padding mask too. With the
    config's KV cache on, the forward appends to a cache object the layers are called with, and
    a rerun would see it grown: those layers are traced and recomputed op by op instead."""
    import copy

    import bagualu2

    torch.manual_seed(0)
    model = FAMILIES[family][0]()
    model.config.use_cache = use_cache
    plain = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=None, policy="recompute_all", min_bytes=0)
    frames: list = []
    prov.runtime.on_frame_start.subscribe(frames.append)
    tokens = torch.randint(64, (2, 24))
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0  # left padding
    if family == "deepseek_v3":
        mask = None  # the tiny DeepSeek-V3's attention rejects a padding mask without bagualu2 too
    for i in range(2):
        losses, grads = [], []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            with pytest.warns(UserWarning, match="use_cache") if use_cache and m is model and not i \
                    else contextlib.nullcontext():
                loss = m(tokens, attention_mask=mask if i else None, labels=tokens).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in m.parameters()])
        assert torch.equal(*losses)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*grads))
    reruns = 0 if use_cache else model.config.num_hidden_layers
    assert [f.stats.rerun_blocks for f in frames] == [0, reruns]  # blocks are first traced
    assert all(("DynamicCache" in " ".join(f.stats.fallbacks)) == use_cache for f in frames)
    assert prov.report()["saved_bytes_by_choice"]["recompute"] > 0
    assert prov.runtime.ledger.resident == 0


@needs_transformers
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_gradient_accumulation_with_varying_lengths_and_padding_holds_the_budget(family):
    """Two micro-batches in flight per step (one with a left-padding attention mask), the
    sequence length changing from step to step: the losses and gradients of plain PyTorch, and
    no micro-batch over a budget of 60% of one short micro-batch's all-keep peak. The first
    micro-batch does not know a second will stack on it; what the second cannot release is
    made room for by offloading the first's kept activations, and later steps plan for it."""
    import copy

    import bagualu2

    torch.manual_seed(0)
    model = FAMILIES[family][0]()
    plain = copy.deepcopy(model)
    probe = copy.deepcopy(model)
    keep = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    tokens = torch.randint(64, (2, 24))
    probe(tokens, labels=tokens).loss.backward()
    budget = int(keep.report()["peak_bytes"] * 0.6)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    for i, seq in enumerate([24, 16, 32, 24, 8, 32]):
        tokens = torch.randint(64, (2, seq))
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, : seq // 3] = 0
        results = []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            loss = m(tokens, attention_mask=mask, labels=tokens).loss
            loss = loss + m(tokens.flip(1), labels=tokens.flip(1)).loss
            loss.backward()
            results.append((loss.detach(), [p.grad for p in m.parameters()]))
        assert torch.equal(results[0][0], results[1][0])
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    report = prov.report()
    assert report["violations"] == 0
    assert all(mb.peak_bytes <= budget for mb in prov.telemetry.micro_batches)
    assert report["resident_bytes"] == 0 and report["arena_in_use_bytes"] == 0
    # Once a step has shown two forwards stack, the first plans room for the second.
    assert all(mb.room_made_bytes == 0 for mb in prov.telemetry.micro_batches[2:])
