"""Activation runtime: tracing of operators and per-storage keep / offload / recompute."""

from bagualu2.runtime.activations import ActivationRuntime, Budget, Frame, FrameStats, ResidencyLedger
from bagualu2.runtime.tracing import StorageNode, TracingMode, is_recomputing

__all__ = [
    "ActivationRuntime", "Budget", "Frame", "FrameStats", "ResidencyLedger", "StorageNode", "TracingMode",
    "is_recomputing",
]
