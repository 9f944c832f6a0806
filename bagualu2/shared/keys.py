"""Operator keys: the names a plan, the cost model and the runtime give one saved storage.

A traced op's key is ``"<module path>:<op>:<occurrence>"`` (output ``i > 0`` of a call:
``"<that key>.<i>"``; a module's second and later calls in one forward: ``<path>#<n>``). A
compiled region, one unit of the plan, has ``"<module path>:compiled"``. The runtime makes the
keys; the planner and the cost model read them with these functions only.
"""
from __future__ import annotations

__all__ = ["REGION_SUFFIX", "SIZE", "call_key", "is_region_key", "module_of", "region_key"]

REGION_SUFFIX = "compiled"

SIZE = -1
"""The key of a counts mapping (MoE layer -> tokens per expert) holding the routing whose total
sizes the micro-batch (this rank's own routed token slots), beside the layers' own entries. No
MoE layer has a negative index."""


def call_key(key: str) -> str:
    """The key of the op call that made ``key``'s storage: the key of the call's first output
    (``"<module path>:<op>:<occurrence>"``; output ``i > 0`` has ``"<that key>.<i>"``)."""
    head, _, occurrence = key.rpartition(":")
    return f"{head}:{occurrence.partition('.')[0]}" if "." in occurrence else key


def module_of(key: str) -> str:
    """The path of the module whose call ran ``key``'s op (the ``#<n>`` that numbers a module's
    second and later calls in one forward left out)."""
    return key.partition(":")[0].partition("#")[0]


def region_key(path: str) -> str:
    """The plan key of the compiled region at module path ``path`` (``""``: the whole model)."""
    return f"{path}:{REGION_SUFFIX}"


def is_region_key(key: str) -> bool:
    """Whether ``key`` names a compiled region (``region_key``) rather than one op's storage."""
    return key.endswith(":" + REGION_SUFFIX) and key.count(":") == 1
