"""MoE gate discovery: which modules route tokens, and how many tokens each expert gets."""
from bagualu2.moe.gates import (HF_ROUTER_CLASSES, CountsFn, GateSpec, SizeFn, counts_from_indices,
                                counts_from_logits, describe_unsupported, find_gates)

__all__ = [
    "HF_ROUTER_CLASSES",
    "CountsFn",
    "GateSpec",
    "SizeFn",
    "counts_from_indices",
    "counts_from_logits",
    "describe_unsupported",
    "find_gates",
]
