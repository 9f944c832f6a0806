"""Shared types: the leaf of bagualu2's layers, imported by every layer above it.

What crosses a layer boundary is defined here, so that the runtime and the planner never import
each other's internals for it: the per-activation ``Choice``, the operator keys a plan is
written in (``keys``), the ``Budget`` a forward is held to, the ``Event`` an extension point is
subscribed through, and the frozen records that carry measurements across (``SavedOp``,
``Measurements``). Nothing here imports the rest of bagualu2 (docs/CONTRACTS.md, "Layers").
"""
from bagualu2.shared.budget import Budget
from bagualu2.shared.choice import Choice
from bagualu2.shared.events import Event, Subscription
from bagualu2.shared.keys import REGION_SUFFIX, SIZE, call_key, is_region_key, module_of, region_key
from bagualu2.shared.records import CopyTimes, Measurements, OpReplayTimes, ReplayTimes, SavedOp

__all__ = ["Budget", "Choice", "CopyTimes", "Event", "Measurements", "OpReplayTimes", "REGION_SUFFIX", "ReplayTimes",
           "SIZE", "SavedOp", "Subscription", "call_key", "is_region_key", "module_of", "region_key"]
