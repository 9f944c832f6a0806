"""Top-k router, SwiGLU experts and the token-permuting MoE layer of the reference model.

Routing runs in :class:`TopKRouter`, a module of its own, so that a forward hook on it fires
after the router has decided and before any expert has run: this is where bagualu2 learns the
actual tokens per expert of a micro-batch.

Every step is bitwise deterministic on CPU (and free of atomics on GPUs): token slots are
ordered by a stable argsort, gathered with a permutation (each row read once), and un-permuted
through the inverse permutation; the k slots of a token are combined by a plain sum. No
``index_add_`` / ``scatter_add`` in the forward, so two identical runs agree bit for bit.

Expert parallelism (``MoELayer(..., ep_group=group)`` or :meth:`MoELayer.shard_experts`): the
group's rank ``r`` holds experts ``[r * L, (r + 1) * L)`` of the ``E = L * group size``. After
routing, :class:`ExpertDispatcher` exchanges the token counts (an ``all_to_all`` of ``E`` ints):
its forward returns how many slots each rank sends to each local expert, so a forward hook on it
sees the load this rank's experts will compute, before any token moves. The slots, grouped by
expert, then travel with ``all_to_all_single`` (each source's slots arrive in one block, in
expert order), are regrouped by local expert with a stable argsort, run, put back and returned
with a second ``all_to_all_single``; backward sends the gradients the same two ways. Every step
is a permutation or a collective that moves whole rows, so EP runs are as deterministic as
one-process runs. Against the one-process model holding every expert they agree to rounding
only: an expert's matmul over the slots of all ranks at once sums in another order than over
one rank's slots (CPU GEMM kernels block by the number of rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
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
    """Experts to overload (global indices); ``None``: the expert already most loaded in each batch."""


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


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows whose backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, output_splits: list[int], input_splits: list[int],
                group: Any) -> Tensor:  # type: ignore[override]
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:  # type: ignore[override]
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


class ExpertDispatcher(nn.Module):
    """The count exchange of an expert-parallel MoE layer: the point where the load each rank's
    experts will compute is known, and no token has moved yet.

    ``forward(tokens_per_expert)`` takes this rank's routing (int64 [E], every expert of the
    layer) and returns int64 [ep_size, num_local_experts]: ``received[s, l]`` token slots that rank
    ``s`` sends to this rank's local expert ``l``. A module of its own so that a forward hook on it
    (bagualu2's gate for EP layers, see ``bagualu2.runtime.gates.find_gates``) reads both this rank's routing
    (its argument) and its experts' load (its output).
    """

    def __init__(self, num_experts: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size:
            raise ValueError(f"ExpertDispatcher needs the EP group's size to divide num_experts, got "
                             f"{num_experts=}, group size {self.ep_size}; use an EP group of a divisor")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.last_received: Optional[Tensor] = None
        """Received counts of the latest forward (int64 [ep_size, num_local_experts]), for inspection."""

    def forward(self, tokens_per_expert: Tensor) -> Tensor:
        """Exchange counts: this rank's slots per expert in, slots per (source rank, local expert) out."""
        if tokens_per_expert.shape != (self.num_experts,):
            raise ValueError(f"ExpertDispatcher expects tokens per expert of shape ({self.num_experts},), "
                             f"got {tuple(tokens_per_expert.shape)}")
        with torch.no_grad():
            send = tokens_per_expert.detach().to(torch.int64).contiguous()
            received = torch.empty_like(send)
            dist.all_to_all_single(received, send, group=self.group)
            received = received.view(self.ep_size, self.num_local_experts)
        self.last_received = received
        return received


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

    Three ways to hold the experts:

    - all of them (``ep_size=1``, no ``ep_group``);
    - real expert parallelism (``ep_group``, or :meth:`shard_experts` later): this rank of the
      group holds experts ``[rank * L, (rank + 1) * L)``, ``L = num_experts // group size``; the
      router still chooses among all ``num_experts``, :class:`ExpertDispatcher` exchanges the
      counts and the slots travel to their expert's rank and back (see the module note);
    - the single-process view of EP rank 0 (``ep_size > 1``, no group): only experts
      ``[0, num_experts // ep_size)`` live (and run) here; slots routed to the other ranks'
      experts contribute zero, as if their results were dropped. A routing spike on a local
      expert then grows this rank's expert activations without any process group.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, expert_hidden_size: int,
                 shared_expert_hidden_size: int = 0, load_cap: Optional[float] = None,
                 ep_size: int = 1, ep_group: Any = None) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"MoELayer needs ep_size >= 1 dividing num_experts, got {ep_size=}, {num_experts=}")
        if ep_group is not None and ep_size != 1:
            raise ValueError(f"MoELayer takes ep_size={ep_size} (the one-process view of an EP rank) or an "
                             f"ep_group (real expert parallelism), not both; pass ep_size=1 with a group")
        self.top_k = top_k
        self.num_experts = num_experts
        self.router = TopKRouter(hidden_size, num_experts, top_k, load_cap)
        # Every expert is built, also with a group, so a rank's experts draw the same initial
        # weights as the one-process model's (shard_experts drops the others).
        self.experts = nn.ModuleList(
            SwiGLUExpert(hidden_size, expert_hidden_size) for _ in range(num_experts // ep_size))
        self.shared_expert: Optional[SwiGLUExpert] = (
            SwiGLUExpert(hidden_size, shared_expert_hidden_size) if shared_expert_hidden_size > 0
            else None)
        self.dispatcher: Optional[ExpertDispatcher] = None
        self.first_expert = 0
        """Global index of ``experts[0]`` (this rank's first expert under expert parallelism)."""
        if ep_group is not None:
            self.shard_experts(ep_group)

    def shard_experts(self, group: Any) -> None:
        """Turn this layer (holding every expert) into its part of an expert-parallel layer over
        ``group``: keep this rank's experts, drop the others, exchange tokens over ``group``.

        Raises:
            ValueError: the layer does not hold every expert, or the group's size does not divide
                ``num_experts``.
        """
        if self.dispatcher is not None or len(self.experts) != self.num_experts:
            raise ValueError(f"shard_experts needs a layer holding all {self.num_experts} experts, this one "
                             f"holds {len(self.experts)}; build it with ep_size=1 and no ep_group")
        dispatcher = ExpertDispatcher(self.num_experts, group)
        local = dispatcher.num_local_experts
        self.first_expert = dispatcher.ep_rank * local
        self.experts = nn.ModuleList(list(self.experts)[self.first_expert:self.first_expert + local])
        self.dispatcher = dispatcher

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return (output with the shape of ``x``, auxiliary load-balancing loss)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        num_tokens, hidden = tokens.shape
        routing = self.router(tokens)
        # The count exchange comes first: what this rank's experts will receive is known (and
        # hooked) before anything else of the layer runs.
        received = self.dispatcher(routing.tokens_per_expert) if self.dispatcher is not None else None

        # Dispatch: one row per (token, choice) slot, grouped by expert in slot order.
        order = torch.argsort(routing.indices.reshape(-1), stable=True)
        inverse = torch.argsort(order)
        slots = tokens.unsqueeze(1).expand(num_tokens, self.top_k, hidden).reshape(-1, hidden)
        grouped = slots.index_select(0, order)
        if received is not None:
            expert_out = self._exchange_and_run(grouped, routing.tokens_per_expert, received)
        else:
            counts = routing.tokens_per_expert.tolist()
            local = len(self.experts)
            outputs = [expert(chunk) for expert, chunk in zip(self.experts, grouped.split(counts))]
            remote_slots = sum(counts[local:])
            if remote_slots:
                outputs.append(grouped.new_zeros(remote_slots, hidden))
            expert_out = torch.cat(outputs)

        # Combine: back to slot order, weight the k choices of each token and sum them.
        combined = expert_out.index_select(0, inverse).view(num_tokens, self.top_k, hidden)
        out = (combined * routing.weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(shape), routing.aux_loss

    def _exchange_and_run(self, grouped: Tensor, tokens_per_expert: Tensor, received: Tensor) -> Tensor:
        """Send ``grouped`` (this rank's slots, grouped by global expert) to the experts' ranks,
        run the local experts on what arrives, and return their outputs in ``grouped``'s order."""
        assert self.dispatcher is not None
        ep_size, local = received.shape
        group = self.dispatcher.group
        send_splits = tokens_per_expert.view(ep_size, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        arrived = _AllToAll.apply(grouped, recv_splits, send_splits, group)
        # Rows arrive source-major (each source's slots in local-expert order); each expert runs
        # once on its rows from every source, in source order.
        block = torch.arange(ep_size * local, device=received.device)
        source_major = torch.repeat_interleave(block, received.reshape(-1))
        by_expert = torch.argsort((source_major % local) * ep_size + source_major // local, stable=True)
        per_expert = received.sum(dim=0).tolist()
        rows = arrived.index_select(0, by_expert)
        outputs = [expert(chunk) for expert, chunk in zip(self.experts, rows.split(per_expert))]
        results = torch.cat(outputs).index_select(0, torch.argsort(by_expert))
        return _AllToAll.apply(results, send_splits, recv_splits, group)
