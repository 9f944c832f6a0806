"""Test-only shims that let torchtitan 0.3.0 build and train tiny models on a CPU-only torch.

Nothing here is part of bagualu2: torchtitan assumes CUDA in a few places that have nothing to
do with activation provisioning, and the tests work around them here (listed in
docs/engines.md):

- FlexAttention (torchtitan's attention for language models) has no CPU backward: each
  model's inner attention is swapped for :class:`CausalSDPA` (plain causal
  ``scaled_dot_product_attention``, no document masking; the tests pass no positions).
- ``torchtitan.tools.utils.device_type`` is ``"cuda"`` on a CPU-only torch (it falls back to
  cuda when no accelerator is found), and ``ParallelDims.build_mesh`` builds its meshes on it:
  :func:`use_cpu` points the copy ``parallel_dims`` imported at ``"cpu"``.
- FSDP2 reduces gradients with PREMUL_SUM, which gloo does not have:
  :func:`force_sum_reduction` sets ``set_force_sum_reduction_for_comms(True)`` on every
  ``fully_shard``-ed module.
- The default ``spmd_backend="spmd_types"`` does not run on gloo/CPU here; the tests use
  ``spmd_backend="partial_dtensor"``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan.protocols.module import Module


class CausalSDPA(Module):
    """Causal attention through ``F.scaled_dot_product_attention`` (math backend on CPU),
    taking FlexAttention's arguments (``(B, L, N, H)`` tensors) and ignoring its masks."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
                enable_gqa=False, **kwargs):
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def use_cpu() -> None:
    """Build torchtitan's device meshes on cpu (gloo) instead of the "cuda" it assumes."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    parallel_dims.device_type = "cpu"
    utils.device_type = "cpu"


def force_sum_reduction(model: torch.nn.Module) -> None:
    """FSDP2 on gloo: reduce gradients with SUM (then divide) instead of PREMUL_SUM."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def with_sdpa(config):
    """``config`` (a torchtitan Decoder config) with every layer's inner attention swapped for
    :class:`CausalSDPA`."""
    for layer in config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = CausalSDPA.Config()
    return config
