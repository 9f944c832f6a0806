"""``CostModel``: the one object the provisioner, the overlap scheduler, the simulator's
validation and the benchmarks price with.

It composes the pieces (``memory``: saved bytes, ``rebuild``: recompute seconds, ``copies``:
copy seconds and windows), computes what needs more than one of them (the planner's candidates,
a whole plan's price, the copy windows at the profiled forward time) and forwards the rest to
the piece that owns it, under the names callers have always used.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, List, Mapping, Sequence, Tuple

from bagualu2.plan.cost_model.copies import CopyModel
from bagualu2.plan.cost_model.memory import MemoryModel, driving_tokens
from bagualu2.plan.cost_model.rebuild import RebuildModel
from bagualu2.plan.planner import Candidate, Choice


def _forward(method: Callable, piece: str) -> Callable:
    """``method`` of the piece at attribute ``piece``, called through the facade (with its name,
    docstring and signature). A plain function, so a test may still replace it on an instance."""

    @functools.wraps(method)
    def forwarded(self: "CostModel", *args: Any, **kwargs: Any) -> Any:
        return method(getattr(self, piece), *args, **kwargs)

    return forwarded


def _read(piece: str, name: str) -> property:
    """The attribute ``name`` of the piece at attribute ``piece``, read through the facade."""
    return property(lambda self: getattr(getattr(self, piece), name), doc=f"``{piece}.{name}``")


class CostModel:
    """Predicts per-operator saved bytes, recompute time and copy time of a micro-batch.

    Args:
        expert_prefixes: for each MoE layer index, the module path prefix of its experts
            (e.g. ``{0: "layers.0.moe.experts"}``).
        d2h_bandwidth, h2d_bandwidth, copy_fixed_s, copies_overlap: the copy engine's figures
            (``CopyModel``).
    """

    def __init__(self, expert_prefixes: Mapping[int, str], d2h_bandwidth: float = 10e9,
                 h2d_bandwidth: float = 10e9, copy_fixed_s: Tuple[float, float] = (0.0, 0.0),
                 copies_overlap: bool = True) -> None:
        self.copies = CopyModel(d2h_bandwidth, h2d_bandwidth, copy_fixed_s, copies_overlap)
        self.memory = MemoryModel(expert_prefixes)
        self.rebuild = RebuildModel(self.memory)

    def candidates(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
                   can_offload: bool, fixed: Iterable[str] = ()) -> Tuple[List[Candidate], int]:
        """Planner candidates for ``keys``, and the predicted bytes that must stay resident.

        Keys below ``min_bytes`` and keys in ``fixed`` (anchors) are kept: their bytes are the
        floor that no plan can release (``floors``).
        """
        out: List[Candidate] = []
        floor = 0
        for key, op, nbytes, releasable in self.memory.sized(keys, counts, min_bytes, can_offload, fixed):
            if not releasable:
                floor += nbytes
                continue
            out.append(Candidate(
                key=key,
                nbytes=nbytes,
                recompute_s=self.recompute_seconds(key, counts),
                offload_s=self.offload_seconds(nbytes),
                reload_s=self.reload_seconds(nbytes),
                can_offload=can_offload,
                can_recompute=op.recomputable,
            ))
        return out, floor

    def plan_seconds(self, choices: Mapping[str, Any], counts: Mapping[int, Sequence[int]],
                     offload_window: float = 0.0, reload_window: float = 0.0) -> float:
        """Predicted step-time overhead of a plan (key -> Choice): its recomputes rebuilt
        together, plus the copy time the windows do not hide (``replay_frame_s`` or
        ``copy_frame_s`` once where it recomputes or offloads anything)."""
        recompute = [k for k, c in choices.items() if c == Choice.RECOMPUTE and k in self.ops]
        offload = [k for k, c in choices.items() if c == Choice.OFFLOAD and k in self.ops]
        seconds = 0.0
        if recompute:
            seconds += self.replay_frame_s + self.rebuild.rebuild_seconds(recompute, counts)
        out = back = 0.0
        for key in offload:
            nbytes = self.predict_bytes(key, counts)
            out += self.offload_seconds(nbytes)
            back += self.reload_seconds(nbytes)
        if offload:
            seconds += self.copy_frame_s
        return seconds + max(0.0, out - offload_window) + max(0.0, back - reload_window)

    def windows(self, remaining_fraction: float, stacked_forwards: int = 0) -> Tuple[float, float]:
        """``CopyModel.windows`` at the profiled forward time."""
        return self.copies.windows(self.memory.forward_seconds, remaining_fraction, stacked_forwards)

    # What profiled forwards taught (MemoryModel)
    expert_prefixes = _read("memory", "expert_prefixes")
    ops = _read("memory", "ops")
    unsaved = _read("memory", "unsaved")
    order = _read("memory", "order")
    forward_seconds = _read("memory", "forward_seconds")
    frames = _read("memory", "frames")
    ready = _read("memory", "ready")
    observe = _forward(MemoryModel.observe, "memory")
    expert_of = _forward(MemoryModel.expert_of, "memory")
    predict_bytes = _forward(MemoryModel.predict_bytes, "memory")
    predict_total = _forward(MemoryModel.predict_total, "memory")
    floors = _forward(MemoryModel.floors, "memory")
    floors_and_total = _forward(MemoryModel.floors_and_total, "memory")
    driving_tokens = staticmethod(driving_tokens)

    # What backward's rebuilds taught (RebuildModel)
    observe_op_replays = _forward(RebuildModel.observe_op_replays, "rebuild")
    observe_replays = _forward(RebuildModel.observe_replays, "rebuild")
    recompute_seconds = _forward(RebuildModel.recompute_seconds, "rebuild")
    rebuilds = _forward(RebuildModel.rebuilds, "rebuild")
    rebuild_profile = _forward(RebuildModel.rebuild_profile, "rebuild")
    replay_ratio = _forward(RebuildModel.replay_ratio, "rebuild")
    op_replay_seconds = _forward(RebuildModel.op_replay_seconds, "rebuild")
    replay_frame_s = _read("rebuild", "replay_frame_s")
    replay_fixed_s = _read("rebuild", "replay_fixed_s")
    replay_entry_s = _read("rebuild", "replay_entry_s")
    replay_factor = _read("rebuild", "replay_factor")

    # What the copies taught (CopyModel)
    observe_copies = _forward(CopyModel.observe_copies, "copies")
    offload_seconds = _forward(CopyModel.offload_seconds, "copies")
    reload_seconds = _forward(CopyModel.reload_seconds, "copies")
    d2h_bandwidth = _read("copies", "d2h_bandwidth")
    h2d_bandwidth = _read("copies", "h2d_bandwidth")
    copy_fixed_s = _read("copies", "copy_fixed_s")
    copy_frame_s = _read("copies", "copy_frame_s")
    copy_overhead_s = _read("copies", "copy_overhead_s")
    copy_factor = _read("copies", "copy_factor")
