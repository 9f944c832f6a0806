"""Configuration of the reference MoE transformer (:class:`MoEConfig`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

_ATTN_IMPLS = ("sdpa", "eager")


@dataclass(frozen=True)
class MoEConfig:
    """Sizes and options of :class:`bagualu2.models.MoETransformer`.

    Three presets cover the uses in this project; each accepts keyword overrides, e.g.
    ``MoEConfig.tiny(dropout=0.1)``. Derive variants with ``dataclasses.replace``.

    Sizes, from fastest to slowest:

    - :meth:`tiny`: unit tests (batch 2 x seq 16, milliseconds per step on a CPU);
    - :meth:`small`: demos (batch 4 x seq 64);
    - :meth:`bench`: benchmarks (batch 8 x seq 256, seconds per step on a CPU).

    bf16 (``model.to(torch.bfloat16)``) is exact and deterministic, but slow on CPUs without
    native bf16 matrix units.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_hidden_size: int = 256
    shared_expert_hidden_size: int = 0
    """Hidden size of a SwiGLU expert applied to every token; 0 disables the shared expert."""
    router_load_cap: Optional[float] = 1.2
    """Calm routing: experts are chosen on per-batch standardized router logits and load above
    this multiple of the mean moves to the tokens' next choices, so calm batches look like a
    trained, balanced model's (an untrained plain router sends up to 4x the mean load to one
    expert). ``None``: plain top-k of the router probabilities. ``routing_spike`` overrides it."""
    ep_size: int = 1
    """Expert-parallel ranks: the model is rank 0's view, holding and running experts
    ``[0, num_experts // ep_size)``; slots routed elsewhere contribute zero. With 1 (all
    experts local) a spike moves load between experts but not the total; with more ranks a
    spike on a local expert grows this rank's activations, as on a real EP rank."""
    max_seq_len: int = 256
    dropout: float = 0.0
    """Probability of attention-weight dropout and of residual dropout (after attention and MoE)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch-style load-balancing loss (summed over layers) in the returned loss."""
    norm_eps: float = 1e-6
    attn_impl: str = "sdpa"
    """``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"eager"`` (matmul, mask, softmax)."""
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_experts",
                     "top_k", "expert_hidden_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.shared_expert_hidden_size, int) or self.shared_expert_hidden_size < 0:
            raise ValueError(
                f"MoEConfig.shared_expert_hidden_size must be an int >= 0 (0 disables the shared "
                f"expert), got {self.shared_expert_hidden_size!r}")
        if not isinstance(self.ep_size, int) or self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(
                f"MoEConfig.ep_size={self.ep_size!r} must be a positive int dividing "
                f"num_experts={self.num_experts}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"MoEConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; pick num_heads dividing hidden_size")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                f"use top_k <= num_experts")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MoEConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.router_load_cap is not None and not self.router_load_cap >= 1.0:
            raise ValueError(
                f"MoEConfig.router_load_cap must be >= 1 (a multiple of the mean load) or None, "
                f"got {self.router_load_cap!r}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(
                f"MoEConfig.norm_eps and init_std must be > 0, got {self.norm_eps!r}, {self.init_std!r}")
        if self.attn_impl not in _ATTN_IMPLS:
            raise ValueError(f"MoEConfig.attn_impl must be one of {_ATTN_IMPLS}, got {self.attn_impl!r}")

    @classmethod
    def tiny(cls, **overrides: Any) -> MoEConfig:
        """Test size: 2 layers, hidden 32, 8 experts (top-2); a step takes a few ms."""
        base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_experts=8,
                    top_k=2, expert_hidden_size=32, max_seq_len=64)
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> MoEConfig:
        """Demo size: 2 layers, hidden 256, 8 experts (top-2); batch 4 x seq 64 per step."""
        base = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_experts=8,
                    top_k=2, expert_hidden_size=512, max_seq_len=128)
        return cls(**{**base, **overrides})

    @classmethod
    def bench(cls, **overrides: Any) -> MoEConfig:
        """Benchmark size: 4 layers, hidden 384, 8 experts (top-2); batch 8 x seq 256 per step."""
        base = dict(vocab_size=1024, hidden_size=384, num_layers=4, num_heads=6, num_experts=8,
                    top_k=2, expert_hidden_size=768, max_seq_len=256)
        return cls(**{**base, **overrides})

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)
