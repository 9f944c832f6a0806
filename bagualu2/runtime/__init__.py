"""Activation runtime: tracing of operators and per-storage keep / offload / recompute."""

from bagualu2.runtime.activations import ActivationRuntime
from bagualu2.runtime.frame import Budget, Frame, FrameStats
from bagualu2.runtime.ledger import ResidencyLedger
from bagualu2.runtime.recipes import StorageNode, is_recomputing
from bagualu2.runtime.tracing import TracingMode

__all__ = [
    "ActivationRuntime", "Budget", "Frame", "FrameStats", "ResidencyLedger", "StorageNode", "TracingMode",
    "is_recomputing",
]
