"""Stage modules: a transformer-like model cut into contiguous pipeline stages.

``split_model(model, num_stages)`` cuts a model laid out like ``bagualu2.models.MoETransformer``
(an embedding, a list of blocks, a head) into ``num_stages`` ``StageModule``s. Stage 0 owns the
embedding, the last stage the final norm and the head (``lm_loss``, the schedule's ``loss_fn``,
computes the LM loss on its logits); blocks are spread as evenly as possible.

Invariants:

* every stage module *shares* its parameters with ``model``: build the full model from the same
  seed on every rank and keep only your stages, so every rank starts from the same weights
  without any broadcast;
* stages pass single tensors, which is what point-to-point sends carry; a block's MoE
  auxiliary loss gets its gradient on the stage that computed it (``_AttachAuxLoss``), so the
  pipeline trains on the whole model's objective without sending extra tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["StageModule", "TokenEmbedding", "lm_loss", "split_model"]


class TokenEmbedding(nn.Module):
    """Stage 0's input layer for the reference model: token + position embedding, dropout."""

    def __init__(self, embed: nn.Embedding, pos_embed: nn.Embedding | None, drop: nn.Module | None):
        super().__init__()
        self.embed = embed
        self.pos_embed = pos_embed
        self.drop = drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.pos_embed is not None:
            h = h + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        return self.drop(h) if self.drop is not None else h


class StageModule(nn.Module):
    """A contiguous slice of a transformer: [embedding] -> blocks -> [final norm -> head].

    Inputs and outputs are single tensors (token ids into stage 0, hidden states between
    stages, logits out of the last stage), which is what point-to-point sends carry. A block
    may return ``(hidden, aux_loss)`` (the reference model's MoE blocks do): the auxiliary
    load-balancing loss is then added to the backward where it was computed, with weight
    ``aux_loss_coef``, so the pipeline trains on the whole model's objective (LM loss +
    coef x sum of aux losses) without sending extra tensors between stages.
    """

    def __init__(
        self,
        stage_index: int,
        num_stages: int,
        layers: Sequence[nn.Module],
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        head: nn.Module | None = None,
        aux_loss_coef: float = 0.0,
        layer_offset: int = 0,
    ):
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_offset = layer_offset  # index in the whole model of this stage's first block
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.head = head
        self.aux_loss_coef = aux_loss_coef

    @property
    def layer_indices(self) -> list[int]:
        """Indices, in the whole model, of the blocks this stage runs."""
        return list(range(self.layer_offset, self.layer_offset + len(self.layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            out = layer(x)
            if isinstance(out, tuple):
                x, aux = out
                if self.aux_loss_coef and isinstance(aux, torch.Tensor) and aux.requires_grad:
                    x = _AttachAuxLoss.apply(x, aux, self.aux_loss_coef)
            else:
                x = out
        if x._is_view():
            # torch's zero-bubble backward detaches stage outputs in place, which views forbid.
            x = x.clone()
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward, also sends ``coef`` as the gradient of ``aux``.

    Megatron's MoEAuxLossAutoScaler: the auxiliary loss of a block on a middle stage never
    reaches the last stage's loss function, so its gradient is injected where it was
    computed. The schedule divides every gradient by the number of micro-batches at the end,
    as it does for the main loss, so the result is coef x mean over micro-batches.
    """

    @staticmethod
    def forward(ctx, x, aux, coef):
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        ctx.coef = coef
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        g = torch.full(ctx.aux_shape, ctx.coef, dtype=ctx.aux_dtype, device=grad_x.device)
        return grad_x, g, None


def _find_attr(model: nn.Module, names: Sequence[str], what: str, required: bool = True):
    for n in names:
        m = getattr(model, n, None)
        if m is not None:
            return m
    if required:
        raise TypeError(
            f"split_model: {type(model).__name__} has no {what} (looked for {', '.join(names)}); "
            "pass stage_modules= to build_pipeline for other layouts"
        )
    return None


def split_model(model: nn.Module, num_stages: int, *, aux_loss_coef: float | None = None) -> list[StageModule]:
    """Cut ``model`` into ``num_stages`` StageModules that share its parameters.

    Works on ``bagualu2.models.MoETransformer`` and on models laid out like it (an
    embedding, optional position embedding, a ``layers`` list, a final norm, a head).
    Blocks are spread as evenly as possible; when they do not divide evenly the extra ones go
    to the middle stages first, since the first and last stages also carry the embedding and
    the head. ``aux_loss_coef`` defaults to ``model.cfg.aux_loss_coef`` (0 if absent).
    """
    embed = _find_attr(model, ("embed", "tok_embeddings", "embed_tokens", "wte"), "embedding")
    pos = _find_attr(model, ("pos_embed", "wpe"), "position embedding", required=False)
    drop = _find_attr(model, ("drop",), "dropout", required=False)
    layers = list(_find_attr(model, ("layers", "blocks", "h"), "list of blocks"))
    norm = _find_attr(model, ("norm", "final_norm", "ln_f"), "final norm", required=False)
    head = _find_attr(model, ("lm_head", "head", "output"), "output head")
    if num_stages < 1 or len(layers) < num_stages:
        raise ValueError(
            f"cannot split {len(layers)} blocks into {num_stages=} stages (need at least one block per stage)"
        )
    if aux_loss_coef is None:
        aux_loss_coef = float(getattr(getattr(model, "cfg", None), "aux_loss_coef", 0.0) or 0.0)
    base, extra = divmod(len(layers), num_stages)
    counts = [base] * num_stages
    middle_first = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
    for s in middle_first[:extra]:
        counts[s] += 1
    embedding = TokenEmbedding(embed, pos, drop)
    stages, start = [], 0
    for s in range(num_stages):
        stages.append(
            StageModule(
                s,
                num_stages,
                layers[start : start + counts[s]],
                embed=embedding if s == 0 else None,
                norm=norm if s == num_stages - 1 else None,
                head=head if s == num_stages - 1 else None,
                aux_loss_coef=aux_loss_coef,
                layer_offset=start,
            )
        )
        start += counts[s]
    return stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (the schedule's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
