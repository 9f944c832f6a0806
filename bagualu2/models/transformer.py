"""The reference MoE transformer: embeddings, N x [attention, MoE] blocks, LM head, LM + aux loss."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import Tensor, nn

from bagualu2.models.config import MoEConfig
from bagualu2.models.moe_layer import MoELayer, RoutingSpike, TopKRouter


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (statistics in float32, result in the input dtype)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        """Normalize ``x`` over its last dimension."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with attention-weight dropout."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout = cfg.dropout
        self.attn_impl = cfg.attn_impl
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        if cfg.attn_impl == "eager":
            mask = torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool).tril()
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` ([batch, seq, hidden]) causally."""
        batch, seq, hidden = x.shape
        q, k, v = (t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        p = self.dropout if self.training else 0.0
        if self.attn_impl == "sdpa":
            attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
            probs = F.dropout(scores.float().softmax(dim=-1).to(q.dtype), p=p, training=self.training)
            attn = probs @ v
        return self.out_proj(attn.transpose(1, 2).reshape(batch, seq, hidden))


class MoEBlock(nn.Module):
    """``x + drop(attn(norm(x)))`` then ``x + drop(moe(norm(x)))``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoELayer(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.expert_hidden_size,
                            cfg.shared_expert_hidden_size, cfg.router_load_cap, cfg.ep_size)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return (block output, this layer's auxiliary load-balancing loss)."""
        x = x + self.drop(self.attn(self.attn_norm(x)))
        moe_out, aux_loss = self.moe(self.moe_norm(x))
        return x + self.drop(moe_out), aux_loss


class MoETransformer(nn.Module):
    """Decoder-only MoE language model; ``model(tokens)`` returns the training loss.

    The loss is next-token cross-entropy plus ``cfg.aux_loss_coef`` times the sum over layers
    of the Switch load-balancing loss. Parameters are initialized from the global torch RNG,
    so ``torch.manual_seed(s)`` before construction makes two models identical.

    Expert parallelism: ``MoETransformer(cfg, ep_group=group)`` on every rank of ``group`` splits
    each layer's experts across the group (rank ``r`` holds experts ``experts_on_rank(r)``) and
    exchanges tokens with ``all_to_all_single`` (see ``bagualu2.models.moe_layer``). Built from
    the same seed, rank ``r``'s parameters are the one-process model's (its experts those of the
    same global indices), so every rank starts from the same weights without a broadcast. Each
    rank's loss is that of its own tokens; the gradients of the non-expert parameters are this
    rank's share, to be reduced over the data-parallel ranks as usual (an expert's gradient
    already sums every rank's tokens). ``cfg.ep_size`` is then 1 or the group's size.
    """

    def __init__(self, cfg: MoEConfig, ep_group: Any = None) -> None:
        super().__init__()
        if ep_group is not None:
            size = dist.get_world_size(ep_group)
            if cfg.ep_size not in (1, size):
                raise ValueError(
                    f"MoEConfig.ep_size={cfg.ep_size} disagrees with the EP group's size {size}; use "
                    f"ep_size=1 or {size} with ep_group (ep_size without a group is one rank's view)")
            if cfg.num_experts % size:
                raise ValueError(
                    f"the EP group's size {size} does not divide num_experts={cfg.num_experts}; use a "
                    f"group whose size divides it")
            cfg = cfg.replace(ep_size=1)  # the layers are built whole, then sharded
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if ep_group is not None:
            # After initialization, which drew every expert's weights as the one-process model does.
            for layer in self.layers:
                layer.moe.shard_experts(ep_group)

    def forward(self, tokens: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        """Scalar loss for ``tokens`` (int64 [batch, seq]).

        ``targets`` (int64 [batch, seq]) defaults to next-token prediction on ``tokens``
        (the last position is dropped, so ``seq`` must then be at least 2).
        """
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be int64 [batch, seq], got dtype={tokens.dtype}, shape={tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.cfg.max_seq_len}; "
                f"use a config with a larger max_seq_len")
        if targets is None:
            if seq < 2:
                raise ValueError(f"next-token loss needs seq >= 2, got seq={seq}; pass targets")
            targets = tokens[:, 1:]
        elif targets.shape != tokens.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} differs from tokens shape {tuple(tokens.shape)}")

        positions = torch.arange(seq, device=tokens.device)
        h = self.drop(self.embed(tokens) + self.pos_embed(positions))
        aux_losses = []
        for layer in self.layers:
            h, aux = layer(h)
            aux_losses.append(aux)
        logits = self.lm_head(self.norm(h))[:, : targets.shape[1]]
        lm_loss = F.cross_entropy(logits.float().reshape(-1, self.cfg.vocab_size), targets.reshape(-1))
        return lm_loss + self.cfg.aux_loss_coef * torch.stack(aux_losses).sum()

    def gates(self) -> Iterator[tuple[int, TopKRouter]]:
        """Yield ``(layer index, router)`` for every MoE layer, in model order."""
        for i, layer in enumerate(self.layers):
            yield i, layer.moe.router

    def experts_on_rank(self, rank: int) -> range:
        """Global indices of the experts that EP rank ``rank`` (of ``ep_group``) holds."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank={rank} is outside the EP group [0, {self.ep_size})")
        local = self.cfg.num_experts // self.ep_size
        return range(rank * local, (rank + 1) * local)

    @contextlib.contextmanager
    def routing_spike(self, imbalance: float = 2.6, experts: Optional[Sequence[int]] = None,
                      layers: Optional[Sequence[int]] = None,
                      ranks: Optional[Sequence[int]] = None) -> Iterator[None]:
        """Force a routing spike in every forward inside the ``with`` block.

        The most loaded expert of each routed batch (or each expert in ``experts``, global
        indices) receives ``imbalance`` x the mean per-expert load of this rank's tokens, to
        within one token; an expert can take each token at most once, so ``imbalance`` is at
        most ``num_experts / top_k``. Only ``layers`` (default: all) are affected. A batch
        already more imbalanced than asked is left as it is. Under expert parallelism the
        spiked experts may live on any rank, and ``ranks`` (EP ranks, default: all) says whose
        tokens spike: every rank can run the same code, and on the others the block changes
        nothing (``routing_spike(4.0, experts=[5], ranks=[0])`` sends rank 0's tokens onto
        expert 5, wherever it lives). Run backward inside the block when the router is rerun in
        backward (``torch.utils.checkpoint``, ``policy="recompute_all"``), so the rerun routes
        the same way.
        """
        cfg = self.cfg
        limit = cfg.num_experts / cfg.top_k
        if experts is not None:
            experts = tuple(int(e) for e in experts)
            bad = [e for e in experts if not 0 <= e < cfg.num_experts]
            if bad or not experts or len(set(experts)) != len(experts):
                raise ValueError(
                    f"experts must be distinct indices in [0, {cfg.num_experts}), got {experts}")
            limit = min(limit, cfg.num_experts / len(experts))
        if not 1.0 <= imbalance <= limit:
            raise ValueError(
                f"imbalance={imbalance} is outside [1, {limit:g}] for num_experts={cfg.num_experts}, "
                f"top_k={cfg.top_k}, {len(experts) if experts else 1} spiked expert(s): an expert takes "
                f"each token at most once and all spiked experts share the token slots")
        chosen = range(cfg.num_layers) if layers is None else [int(i) for i in layers]
        bad_layers = [i for i in chosen if not 0 <= i < cfg.num_layers]
        if bad_layers:
            raise ValueError(f"layers {bad_layers} are outside [0, {cfg.num_layers})")
        if ranks is not None:
            ranks = [int(r) for r in ranks]
            bad_ranks = [r for r in ranks if not 0 <= r < self.ep_size]
            if bad_ranks:
                raise ValueError(f"ranks {bad_ranks} are outside the EP group [0, {self.ep_size})")
            if self.ep_rank not in ranks:
                chosen = []  # another rank's tokens spike; this rank routes as it would
        routers = dict(self.gates())
        previous = {i: routers[i].spike for i in chosen}
        try:  # an interrupt while the spikes are set still restores them all
            for i in chosen:
                routers[i].spike = RoutingSpike(float(imbalance), experts)
            yield
        finally:
            for i, spike in previous.items():
                routers[i].spike = spike
