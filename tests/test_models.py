"""Reference MoE transformer (bagualu2.models): runs, is bit-reproducible, routes as asked."""
from __future__ import annotations

import pytest
import torch

from bagualu2.models import (MoEConfig, MoELayer, MoETransformer, load_imbalance,
                             synthetic_batches)

DTYPES = [torch.float32, torch.bfloat16]


def _model(cfg: MoEConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(cfg).to(dtype)


def _tokens(cfg: MoEConfig, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return next(synthetic_batches(cfg.vocab_size, batch, seq, seed=seed))


def _step(model: MoETransformer, tokens: torch.Tensor, rng_seed: int = 0
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    loss = model(tokens)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_forward_backward_runs_and_every_parameter_gets_a_gradient(dtype, attn_impl):
    cfg = MoEConfig.tiny(attn_impl=attn_impl)
    model = _model(cfg, dtype)
    loss, grads = _step(model, _tokens(cfg))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    for name, grad in grads.items():
        assert grad is not None, name
        assert grad.dtype == dtype and torch.isfinite(grad).all(), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("shared", [0, 16])
def test_identical_runs_are_bitwise_equal(dtype, dropout, shared):
    cfg = MoEConfig.tiny(dropout=dropout, shared_expert_hidden_size=shared)
    tokens = _tokens(cfg)
    loss_a, grads_a = _step(_model(cfg, dtype), tokens)
    loss_b, grads_b = _step(_model(cfg, dtype), tokens)
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_dropout_depends_on_rng_and_mode():
    cfg = MoEConfig.tiny(dropout=0.2)
    model, tokens = _model(cfg), _tokens(cfg)
    loss_a, _ = _step(model, tokens, rng_seed=0)
    loss_b, _ = _step(model, tokens, rng_seed=1)
    assert not torch.equal(loss_a, loss_b)
    model.eval()
    with torch.no_grad():
        torch.manual_seed(0)
        eval_a = model(tokens)
        torch.manual_seed(1)
        eval_b = model(tokens)
    assert torch.equal(eval_a, eval_b)
    no_dropout = _model(cfg.replace(dropout=0.0)).eval()
    with torch.no_grad():
        assert torch.equal(no_dropout(tokens), eval_a)


def test_shared_expert_adds_parameters_that_learn():
    plain, shared = MoEConfig.tiny(), MoEConfig.tiny(shared_expert_hidden_size=24)
    n_plain = sum(p.numel() for p in _model(plain).parameters())
    model = _model(shared)
    n_shared = sum(p.numel() for p in model.parameters())
    assert n_shared - n_plain == shared.num_layers * 3 * shared.hidden_size * 24
    _, grads = _step(model, _tokens(shared))
    assert all(grads[f"layers.{i}.moe.shared_expert.down_proj.weight"].abs().sum() > 0
               for i in range(shared.num_layers))


def test_sdpa_and_eager_attention_agree():
    cfg = MoEConfig.tiny()
    tokens = _tokens(cfg)
    loss_sdpa, _ = _step(_model(cfg), tokens)
    loss_eager, _ = _step(_model(cfg.replace(attn_impl="eager")), tokens)
    torch.testing.assert_close(loss_sdpa, loss_eager)


@pytest.mark.parametrize("load_cap, ep_size", [(1.2, 1), (None, 1), (1.2, 2)])
def test_permuted_experts_match_dense_reference_with_empty_experts(load_cap, ep_size):
    """Variable tokens per expert, several experts with zero tokens: the sort / split /
    un-permute path equals a per-token loop, and empty experts get zero (not missing) grads.
    With expert parallelism, slots routed to other ranks' experts contribute zero."""
    torch.manual_seed(0)
    layer = MoELayer(hidden_size=16, num_experts=8, top_k=2, expert_hidden_size=8,
                     shared_expert_hidden_size=8, load_cap=load_cap, ep_size=ep_size)
    local = 8 // ep_size
    assert len(layer.experts) == local
    x = torch.randn(1, 3, 16, requires_grad=True)
    out, aux = layer(x)
    routing = layer.router(x.reshape(-1, 16))
    counts = routing.tokens_per_expert
    assert int(counts.sum()) == 3 * 2 and (counts == 0).sum() >= 2
    tokens = x.reshape(-1, 16)
    dense = torch.stack([
        sum(w * layer.experts[int(e)](t[None])[0] for w, e in zip(ws, es) if e < local)
        + layer.shared_expert(t[None])[0]
        for t, ws, es in zip(tokens, routing.weights, routing.indices)])
    torch.testing.assert_close(out.reshape(-1, 16), dense)
    (out.sum() + aux).backward()
    for e in range(local):
        grad = layer.experts[e].up_proj.weight.grad
        assert grad is not None
        assert bool(grad.abs().sum() > 0) == bool(counts[e] > 0), (e, counts.tolist())


def test_router_hook_runs_after_routing_and_before_the_experts():
    cfg = MoEConfig.tiny()
    model = _model(cfg)
    events: list[str] = []
    block = model.layers[0].moe
    block.router.register_forward_hook(
        lambda mod, args, out: events.append(f"gate:{int(out.tokens_per_expert.sum())}"))
    for expert in block.experts:
        expert.register_forward_pre_hook(lambda mod, args: events.append("expert"))
    model(_tokens(cfg, batch=2, seq=8))
    assert events[0] == f"gate:{2 * 8 * cfg.top_k}"
    assert events[1:] == ["expert"] * cfg.num_experts
    assert [i for i, _ in model.gates()] == list(range(cfg.num_layers))


@pytest.mark.parametrize("imbalance", [1.5, 2.0, 2.6, 3.5])
def test_routing_spike_reaches_requested_imbalance_on_small_config(imbalance):
    cfg = MoEConfig.small(num_layers=1)
    model = _model(cfg)
    with torch.no_grad():
        for seed in range(2):
            tokens = _tokens(cfg, batch=4, seq=64, seed=seed)
            model(tokens)
            calm = load_imbalance(model.layers[0].moe.router.last_tokens_per_expert)
            with model.routing_spike(imbalance=imbalance):
                model(tokens)
            spiked = load_imbalance(model.layers[0].moe.router.last_tokens_per_expert)
            assert calm <= 1.25  # router_load_cap=1.2 keeps calm batches near balance
            assert abs(spiked - max(imbalance, calm)) <= 0.1 * imbalance, (seed, calm, spiked)
    assert model.layers[0].moe.router.spike is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_spike_in_both_dtypes_and_with_gradients(dtype):
    cfg = MoEConfig.tiny()
    model, tokens = _model(cfg, dtype), _tokens(cfg, batch=2, seq=16)
    with model.routing_spike(imbalance=2.6):
        _step(model, tokens)
    for _, router in model.gates():
        assert abs(load_imbalance(router.last_tokens_per_expert) - 2.6) <= 0.1 * 2.6


def test_routing_spike_on_chosen_experts_and_layers():
    cfg = MoEConfig.small()
    model = _model(cfg)
    tokens = _tokens(cfg, batch=4, seq=64)
    mean = 4 * 64 * cfg.top_k / cfg.num_experts
    with torch.no_grad(), model.routing_spike(imbalance=2.0, experts=[1, 5], layers=[1]):
        model(tokens)
    first, second = (layer.moe.router.last_tokens_per_expert for layer in model.layers)
    assert load_imbalance(first) <= 1.25
    for e in (1, 5):
        assert abs(int(second[e]) / mean - 2.0) <= 0.2, second.tolist()


def test_expert_parallel_view_grows_local_rows_only_on_a_local_spike():
    cfg = MoEConfig.tiny(ep_size=4)
    model, tokens = _model(cfg), _tokens(cfg, batch=2, seq=32)
    assert [len(layer.moe.experts) for layer in model.layers] == [2, 2]
    rows: list[int] = []
    model.layers[0].moe.experts[0].register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    with torch.no_grad():
        model(tokens)
        with model.routing_spike(imbalance=2.6, experts=(0,)):
            model(tokens)
    mean = 2 * 32 * cfg.top_k / cfg.num_experts
    assert rows[0] <= 1.25 * mean and rows[1] == round(2.6 * mean)
    with pytest.raises(ValueError, match="ep_size=3 must be a positive int dividing num_experts=8"):
        MoEConfig.tiny(ep_size=3)


def test_routing_spike_does_not_change_loss_outside_the_block():
    cfg = MoEConfig.tiny()
    model, tokens = _model(cfg), _tokens(cfg)
    with torch.no_grad():
        before = model(tokens)
        with model.routing_spike(imbalance=3.0):
            during = model(tokens)
        after = model(tokens)
    assert torch.equal(before, after) and not torch.equal(before, during)


def test_bad_arguments_name_the_values():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        MoEConfig.tiny(top_k=9)
    with pytest.raises(ValueError, match="num_heads"):
        MoEConfig.tiny(num_heads=3)
    model = _model(MoEConfig.tiny())
    with pytest.raises(ValueError, match=r"imbalance=5.0 is outside \[1, 4\]"):
        with model.routing_spike(imbalance=5.0):
            pass
    with pytest.raises(ValueError, match="experts must be distinct"):
        with model.routing_spike(imbalance=2.0, experts=[8]):
            pass
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 8, dtype=torch.int32))


def test_load_imbalance():
    assert load_imbalance([4, 4, 4, 4]) == 1.0
    assert load_imbalance(torch.tensor([8, 0, 0, 0])) == 4.0
    assert load_imbalance([0, 0]) == 1.0
    with pytest.raises(ValueError):
        load_imbalance([])


def test_synthetic_batches_are_deterministic_and_learnable_walks():
    a = list(synthetic_batches(50, 3, 12, seed=7, num_batches=2))
    b = list(synthetic_batches(50, 3, 12, seed=7, num_batches=2))
    c = next(synthetic_batches(50, 3, 12, seed=8))
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c)
    assert a[0].dtype == torch.long and a[0].shape == (3, 12)
    assert int(a[0].min()) >= 0 and int(a[0].max()) < 50
    successors: dict[int, set[int]] = {}
    for batch in synthetic_batches(50, 8, 64, seed=7, num_batches=4):
        for prev, nxt in zip(batch[:, :-1].flatten().tolist(), batch[:, 1:].flatten().tolist()):
            successors.setdefault(prev, set()).add(nxt)
    assert max(len(s) for s in successors.values()) <= 4


def test_training_lowers_the_loss():
    cfg = MoEConfig.tiny()
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in synthetic_batches(cfg.vocab_size, 4, 16, seed=0, num_batches=20):
        loss = model(tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
