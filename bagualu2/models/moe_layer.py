"""Top-k router, SwiGLU experts and the token-permuting MoE layer of the reference model.

Routing runs in :class:`TopKRouter`, a module of its own, so that a forward hook on it fires
after the router has decided and before any expert has run: this is where bagualu2 learns the
actual tokens per expert of a micro-batch.

Every step is bitwise deterministic on CPU (and free of atomics on GPUs): token slots are
ordered by a stable argsort, gathered with a permutation (each row read once), and un-permuted
through the inverse permutation; the k slots of a token are combined by a plain sum. No
``index_add_`` / ``scatter_add`` in the forward, so two identical runs agree bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RouterOutput(NamedTuple):
    """What :class:`TopKRouter` returns for ``T`` tokens, ``E`` experts and top-``k`` routing."""

    logits: Tensor
    """[T, E] float32 router logits."""
    weights: Tensor
    """[T, k] combination weights (renormalized over the k choices), in the input dtype."""
    indices: Tensor
    """[T, k] int64 chosen experts."""
    tokens_per_expert: Tensor
    """[E] int64 token slots routed to each expert (sums to T * k)."""
    aux_loss: Tensor
    """Scalar float32 Switch-style load-balancing loss ``E * sum_e f_e * P_e``."""


@dataclass(frozen=True)
class RoutingSpike:
    """A forced load spike: which experts receive ``imbalance`` x the mean load per expert."""

    imbalance: float
    experts: Optional[tuple[int, ...]] = None
    """Experts to overload; ``None``: the expert already most loaded in each batch."""


def load_imbalance(counts: Union[Tensor, Sequence[int]]) -> float:
    """Expert-load imbalance ``max(counts) / mean(counts)`` (1.0 when nothing was routed)."""
    c = torch.as_tensor(counts, dtype=torch.float64).flatten()
    if c.numel() == 0:
        raise ValueError("load_imbalance needs at least one expert count, got an empty sequence")
    total = float(c.sum())
    if total == 0.0:
        return 1.0
    return float(c.max()) * c.numel() / total


def _count_selected(indices: Tensor, num_experts: int) -> Tensor:
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


def _bias_thresholds(scores: Tensor, top_k: int) -> Tensor:
    """[T, E] thresholds: expert ``e`` is in token ``t``'s top-k iff its bias rises by more than
    ``th[t, e]`` while every other expert's score stays fixed (so ``th < 0`` means selected now)."""
    values, indices = scores.topk(top_k + 1, dim=-1)
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices[:, :top_k], True)
    kth_other = torch.where(selected, values[:, top_k:], values[:, top_k - 1:top_k])
    return kth_other - scores


def _bias_for_count(sorted_thresholds: Tensor, count: int) -> Tensor:
    """Bias change per expert admitting exactly ``count`` tokens (columns sorted ascending)."""
    num_tokens = sorted_thresholds.shape[0]
    if count <= 0:
        return sorted_thresholds[0] - 1.0
    if count >= num_tokens:
        return sorted_thresholds[-1] + 1.0
    return 0.5 * (sorted_thresholds[count - 1] + sorted_thresholds[count])


def _cap_bias(scores: Tensor, top_k: int, load_cap: float, rounds: int = 3) -> Tensor:
    """Per-expert selection bias (<= 0) moving load above ``load_cap`` x the mean to the
    affected tokens' next choices; stops early once no expert is over the cap."""
    num_tokens, num_experts = scores.shape
    bias = torch.zeros(num_experts, dtype=scores.dtype, device=scores.device)
    if top_k == num_experts or num_tokens == 0:
        return bias
    mean = num_tokens * top_k / num_experts
    cap = max(math.ceil(mean), math.floor(load_cap * mean))
    for _ in range(rounds):
        thresholds = _bias_thresholds(scores + bias, top_k)
        over = (thresholds < 0).sum(dim=0) > cap
        if not bool(over.any()):
            break
        delta = _bias_for_count(thresholds.sort(dim=0).values, cap)
        bias = bias + torch.where(over, delta, torch.zeros_like(delta))
    return bias


def _spike_bias(scores: Tensor, top_k: int, spike: RoutingSpike, rounds: int = 4) -> Tensor:
    """Per-expert selection bias giving each spiked expert ``spike.imbalance`` x the mean load.

    Uses exact per-token thresholds (see :func:`_bias_thresholds`), so one spiked expert gets
    its target to within ties; several spiked experts compete for the same token slots and
    are refined over a few deterministic rounds. A bias never lowers an expert's load.
    """
    num_tokens, num_experts = scores.shape
    bias = torch.zeros(num_experts, dtype=scores.dtype, device=scores.device)
    if top_k == num_experts or num_tokens == 0:
        return bias
    target = min(num_tokens, round(spike.imbalance * num_tokens * top_k / num_experts))
    if spike.experts is None:
        counts = (_bias_thresholds(scores, top_k) < 0).sum(dim=0)
        experts: tuple[int, ...] = (int(counts.argmax()),)
    else:
        experts = spike.experts
    expert_ids = torch.arange(num_experts, device=scores.device)
    for _ in range(rounds if len(experts) > 1 else 1):
        for e in experts:
            thresholds = _bias_thresholds(scores + bias, top_k)[:, e]
            delta = _bias_for_count(thresholds.sort().values.unsqueeze(1), target)[0]
            # Out of place: tensors traced by the activation runtime are never mutated.
            bias = torch.where(expert_ids == e, bias + delta.clamp(min=0.0), bias)
    return bias


class ExpertSelection(nn.Module):
    """The scores a :class:`TopKRouter` chooses experts by, shaped for balance or a spike.

    A module of its own: how many ops shaping runs depends on the batch (the load-cap rounds
    stop once no expert is over the cap), and ops inside a module call are numbered per call,
    so the router's own ops keep the same names from batch to batch.
    """

    def __init__(self, top_k: int, load_cap: Optional[float]) -> None:
        super().__init__()
        self.top_k = top_k
        self.load_cap = load_cap

    def forward(self, scores: Tensor, spike: Optional[RoutingSpike]) -> Tensor:
        """Selection scores from detached router logits ``scores`` ([T, E])."""
        if self.load_cap is not None:
            centered = scores - scores.mean(dim=0)
            scale = centered.pow(2).mean(dim=0).sqrt().clamp_min(torch.finfo(scores.dtype).tiny)
            scores = centered / scale
            scores = scores + _cap_bias(scores, self.top_k, self.load_cap)
        if spike is not None:
            scores = scores + _spike_bias(scores, self.top_k, spike)
        return scores


class TopKRouter(nn.Module):
    """Softmax top-k router with renormalized weights and a Switch-style auxiliary loss.

    A separate module so that a forward hook on it runs after routing and before the experts.
    Selection may differ from the scores that weight the experts (DeepSeek-V3 style: shaping
    changes which experts are chosen, not how their outputs are weighted). With ``load_cap``,
    calm batches stay near balance, as in a trained, load-balanced model (an untrained router
    sends up to 4x the mean load to one expert): experts are chosen on per-batch standardized
    logits (each expert's scores centered and scaled over the batch), and load above
    ``load_cap`` x the mean moves to the tokens' next choices. Under
    :meth:`MoETransformer.routing_spike` a selection bias forces the requested imbalance.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 load_cap: Optional[float] = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter needs 1 <= top_k <= num_experts, got {top_k=}, {num_experts=}")
        if load_cap is not None and load_cap < 1.0:
            raise ValueError(f"TopKRouter needs load_cap >= 1 (a multiple of the mean load) or None, "
                             f"got {load_cap=}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.selection = ExpertSelection(top_k, load_cap)
        self.spike: Optional[RoutingSpike] = None
        self.last_tokens_per_expert: Optional[Tensor] = None
        """Tokens per expert of the latest forward (int64 [E]), for inspection."""

    def forward(self, x: Tensor) -> RouterOutput:
        """Route ``x`` ([T, hidden]) to ``top_k`` experts per token."""
        logits = self.proj(x).float()
        probs = logits.softmax(dim=-1)
        # One sequence of ops whatever the batch (balanced, capped or spiked), so each op keeps
        # its name from micro-batch to micro-batch; softmax keeps the logits' order.
        indices = self.selection(logits.detach(), self.spike).topk(self.top_k, dim=-1).indices
        top_probs = probs.gather(1, indices)
        weights = (top_probs / top_probs.sum(dim=-1, keepdim=True)).to(x.dtype)
        with torch.no_grad():
            tokens_per_expert = _count_selected(indices, self.num_experts)
            self.last_tokens_per_expert = tokens_per_expert
            slot_fraction = tokens_per_expert.float() / max(1, indices.numel())
        aux_loss = self.num_experts * (slot_fraction * probs.mean(dim=0)).sum()
        return RouterOutput(logits, weights, indices, tokens_per_expert, aux_loss)


class SwiGLUExpert(nn.Module):
    """``down(silu(gate(x)) * up(x))``: one expert (also used as the shared expert)."""

    def __init__(self, hidden_size: int, expert_hidden_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, expert_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, expert_hidden_size, bias=False)
        self.down_proj = nn.Linear(expert_hidden_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the expert to ``x`` ([tokens, hidden]); zero tokens give an empty result."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoELayer(nn.Module):
    """Router + experts with token permutation (variable tokens per expert) + optional shared expert.

    With ``ep_size > 1`` the layer is the view of expert-parallel rank 0: the router chooses
    among all ``num_experts``, but only experts ``[0, num_experts // ep_size)`` live (and run)
    here; slots routed to the other ranks' experts contribute zero, as if their results were
    dropped. A routing spike on a local expert then grows this rank's expert activations.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, expert_hidden_size: int,
                 shared_expert_hidden_size: int = 0, load_cap: Optional[float] = None,
                 ep_size: int = 1) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"MoELayer needs ep_size >= 1 dividing num_experts, got {ep_size=}, {num_experts=}")
        self.top_k = top_k
        self.router = TopKRouter(hidden_size, num_experts, top_k, load_cap)
        self.experts = nn.ModuleList(
            SwiGLUExpert(hidden_size, expert_hidden_size) for _ in range(num_experts // ep_size))
        self.shared_expert: Optional[SwiGLUExpert] = (
            SwiGLUExpert(hidden_size, shared_expert_hidden_size) if shared_expert_hidden_size > 0
            else None)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return (output with the shape of ``x``, auxiliary load-balancing loss)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        num_tokens, hidden = tokens.shape
        routing = self.router(tokens)

        # Dispatch: one row per (token, choice) slot, grouped by expert in slot order.
        order = torch.argsort(routing.indices.reshape(-1), stable=True)
        inverse = torch.argsort(order)
        slots = tokens.unsqueeze(1).expand(num_tokens, self.top_k, hidden).reshape(-1, hidden)
        grouped = slots.index_select(0, order)
        counts = routing.tokens_per_expert.tolist()
        local = len(self.experts)
        outputs = [expert(chunk) for expert, chunk in zip(self.experts, grouped.split(counts))]
        remote_slots = sum(counts[local:])
        if remote_slots:
            outputs.append(grouped.new_zeros(remote_slots, hidden))

        # Combine: back to slot order, weight the k choices of each token and sum them.
        combined = torch.cat(outputs).index_select(0, inverse).view(num_tokens, self.top_k, hidden)
        out = (combined * routing.weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(shape), routing.aux_loss
