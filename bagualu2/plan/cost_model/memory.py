"""What a micro-batch saves: each operator key's saved bytes as a function of routed tokens.

Predicts: the bytes each key saves for a micro-batch with given routing (``predict_bytes``,
``predict_total``), and of those the bytes no plan releases (``floors``; both in one pass:
``floors_and_total``).

From: profiled micro-batches (``observe``): per key, the bytes of the storage it saved, the
measured seconds of its own ops (kept here for the rebuild model and the overlap scheduler),
whether it can be recomputed and which storages its rebuild reads; and each MoE layer's tokens
per expert. Each key is assigned a *driver*:

* an expert op (its module path lies under ``<moe layer>.experts.<e>``) is driven by the tokens
  routed to expert ``e`` of that layer;
* a compiled region (key ``"<path>:compiled"``, one unit of saves) is driven by the tokens its
  first MoE layer's experts receive, summed over the experts this rank runs (``local_experts``);
* any other op (attention, norms, routing and permutation of the token slots) is driven by the
  micro-batch's size: the tokens routed by its first MoE layer (top-k times its tokens), which
  changes only when the sequence length or batch size does.

Bytes are fitted as ``a + b * tokens`` by least squares (``LineFit``; proportional while all
samples share one token count, the largest sample for constant ops). Saved bytes of expert ops
are exactly linear in tokens, so the fit is exact once two loads have been seen. Seconds are
timings with outliers (a preempted op, the cold first micro-batch's allocations and first
touches): the first micro-batch's timings are replaced by the second's, and the fit is robust.

Known error: ``benchmarks/cost_model_accuracy.py`` (its first table) prints the error of the
all-keep high-water prediction per micro-batch, calm and spiked, and of the bytes model alone
(every layer's routing known); ``tests/test_provisioner.py``'s
``test_high_water_prediction_follows_the_sequence_length`` bounds it as sequence lengths change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from bagualu2.plan.cost_model.fit import LineFit
from bagualu2.shared import SIZE, SavedOp, call_key, is_region_key, module_of

GROUPED = -2
"""The expert index of an op that runs every expert of its layer at once (grouped experts):
the layer's tokens, summed, drive it. An expert index, never a key of a counts mapping: it
differs from ``SIZE`` (that key), so that neither can be read for the other."""


@dataclass
class OpCost:
    """What the cost model knows of one operator key."""

    key: str
    layer: Optional[int]      # MoE layer whose expert drives it, or None (constant)
    expert: Optional[int]
    position: int = -1        # in the order a micro-batch first saves the keys (-1: unsaved storage)
    bytes: LineFit = field(default_factory=LineFit)
    seconds: LineFit = field(default_factory=lambda: LineFit(robust=True))  # its own ops, timed in profiled forwards
    recomputable: bool = True
    unsaved_inputs: Tuple[str, ...] = ()  # storages nothing saves that rebuilding it rebuilds first
    saved_inputs: Tuple[str, ...] = ()  # saved keys that rebuild reads (rebuilt first when released)
    # Rebuilds it entered: (measured seconds, 1 if the micro-batch's first else 0, ops
    # replayed, their replay seconds), and the correction they make of the shared fit per
    # number of ops replayed, cached for one version of that fit.
    replays: List[Tuple[float, float, int, float]] = field(default_factory=list)
    correction: Tuple[int, Dict[int, float]] = (-1, {})
    span: Optional[int] = None  # a GROUPED op: the experts whose tokens drive it (None: all)
    call: str = field(init=False)  # the op call that makes its storage (``call_key``)

    def __post_init__(self) -> None:
        self.call = call_key(self.key)


def driving_tokens(op: OpCost, counts: Mapping[int, Optional[Sequence[int]]]) -> float:
    """What drives ``op``: its expert's routed tokens, or for any other op the micro-batch's
    size (the tokens routed by ``counts[SIZE]``, else by the first MoE layer in ``counts``
    that routed any: top-k times its tokens; counts list the layers in forward order)."""
    if op.layer is None:
        for routed in counts.values():
            if routed:
                return float(sum(counts.get(SIZE) or routed))
        return 0.0
    layer_counts = counts.get(op.layer)
    if layer_counts is None or op.expert is None or op.expert >= len(layer_counts):
        return 0.0
    if op.expert == GROUPED:
        return float(sum(layer_counts[:op.span] if op.span is not None else layer_counts))
    return float(layer_counts[op.expert])


def _bytes(op: OpCost, counts: Mapping[int, Optional[Sequence[int]]]) -> int:
    """``op``'s predicted saved bytes at ``counts``, rounded up (a plan then frees enough)."""
    return int(math.ceil(op.bytes(driving_tokens(op, counts))))


class MemoryModel:
    """The table of operator keys profiled micro-batches saved, and their bytes.

    Args:
        expert_prefixes: for each MoE layer index, the module path prefix of its experts
            (e.g. ``{0: "layers.0.moe.experts"}``); the caller may add layers later.
    """

    def __init__(self, expert_prefixes: Mapping[int, str]) -> None:
        self.expert_prefixes = dict(expert_prefixes)
        self.local_experts: Dict[int, int] = {}  # MoE layer -> experts this rank runs, where fewer than routed to
        self.ops: Dict[str, OpCost] = {}
        self.unsaved: Dict[str, OpCost] = {}  # ops whose outputs nothing saves (rebuilt as inputs)
        self.order: List[str] = []           # keys in the order a micro-batch first saves them
        self.forward_seconds = 0.0           # measured forward time of one micro-batch
        self.frames = 0

    @property
    def ready(self) -> bool:
        return self.frames > 0

    def expert_of(self, key: str) -> Optional[int]:
        """The expert whose module runs ``key``'s op, or None when no expert does."""
        return self._driver(key)[1]

    def _driver(self, key: str) -> Tuple[Optional[int], Optional[int]]:
        """(MoE layer, expert) whose tokens drive ``key``'s op: an expert of a ``ModuleList``
        under the layer's experts path (directly, or one level down as Megatron's
        ``experts.local_experts.<e>``), ``GROUPED`` for other ops under it (experts run as one
        grouped call), (None, None) outside every experts path."""
        path = module_of(key)
        if is_region_key(key):
            region = key.rpartition(":")[0]
            for layer, prefix in sorted(self.expert_prefixes.items()):
                if not region or prefix.startswith(region + "."):
                    return layer, GROUPED
            return None, None
        for layer, prefix in self.expert_prefixes.items():
            if path == prefix or path.startswith(prefix + "."):
                parts = path[len(prefix) + 1:].split(".")[:2]
                index = next((p for p in parts if p.isdigit()), None)
                return layer, int(index) if index is not None else GROUPED
        return None, None

    def observe(self, saved: Mapping[str, SavedOp], counts: Mapping[int, Sequence[int]],
                forward_seconds: float, unsaved: Optional[Mapping[str, float]] = None) -> None:
        """Learn from one profiled micro-batch.

        Args:
            saved: key -> ``SavedOp`` (saved storage bytes, measured seconds of its own ops,
                recomputable, keys of the unsaved storages its rebuild rebuilds first, saved keys
                its rebuild reads), in the order the micro-batch first saved them.
            counts: MoE layer -> tokens per expert of this micro-batch.
            forward_seconds: wall time of the micro-batch's forward.
            unsaved: key -> measured seconds of the ops of those unsaved storages.
        """
        for key, seconds in (unsaved or {}).items():
            op = self.unsaved.get(key)
            if op is None:
                op = self.unsaved[key] = OpCost(key, *self._driver(key))
            self._time(op, counts, seconds)
        for key, entry in saved.items():
            nbytes, seconds, recomputable, unsaved_inputs, saved_inputs = SavedOp(*entry)
            op = self.ops.get(key)
            if op is None:
                layer, expert = self._driver(key)
                op = self.ops[key] = OpCost(key, layer, expert, position=len(self.order))
                if is_region_key(key) and layer is not None:
                    op.span = self.local_experts.get(layer)
                self.order.append(key)
            op.bytes.add(driving_tokens(op, counts), float(nbytes))
            self._time(op, counts, seconds)
            op.recomputable = op.recomputable and recomputable
            op.unsaved_inputs = tuple(unsaved_inputs)
            op.saved_inputs = tuple(saved_inputs)
        self.forward_seconds = (forward_seconds if self.frames == 0
                                else 0.5 * (self.forward_seconds + forward_seconds))
        self.frames += 1

    def _time(self, op: OpCost, counts: Mapping[int, Sequence[int]], seconds: float) -> None:
        if self.frames == 1:
            op.seconds.clear()  # the first micro-batch ran cold: its timings are not the op's
        op.seconds.add(driving_tokens(op, counts), float(seconds))

    def predict_bytes(self, key: str, counts: Mapping[int, Sequence[int]]) -> int:
        """Predicted saved bytes of ``key`` for a micro-batch with ``counts``."""
        op = self.ops.get(key)
        return 0 if op is None else _bytes(op, counts)

    def predict_total(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> int:
        """Predicted saved bytes of ``keys`` (all keep) for a micro-batch with ``counts``
        (``floors_and_total``'s one pass: what drives the non-expert operators found once)."""
        return self.floors_and_total(keys, counts, 0, True)[2]

    def sized(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
              can_offload: bool, fixed: Iterable[str]) -> Iterable[Tuple[str, OpCost, int, bool]]:
        """(key, op, predicted bytes, whether a plan can release it) for the known keys with bytes."""
        fixed = set(fixed)
        for key in keys:
            op = self.ops.get(key)
            if op is None:
                continue
            nbytes = _bytes(op, counts)
            if nbytes:
                releasable = nbytes >= min_bytes and key not in fixed and (can_offload or op.recomputable)
                yield key, op, nbytes, releasable

    def floors(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
               can_offload: bool) -> Tuple[int, int]:
        """The predicted bytes of ``keys`` that no plan releases (``candidates``' floor, without
        pricing the candidates), and of those the bytes nothing can release at all (neither
        offloadable nor recomputable: the runtime releases small ones too when the budget
        demands it)."""
        soft, hard, _ = self.floors_and_total(keys, counts, min_bytes, can_offload)
        return soft, hard

    def floors_and_total(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
                         can_offload: bool) -> Tuple[int, int, int]:
        """``floors`` and ``predict_total`` of ``keys`` in one pass over them (what the end of
        every micro-batch asks), the tokens that drive the non-expert ops found once."""
        soft = hard = total = 0
        dense: Optional[float] = None  # what drives every op outside the experts: one number
        ops = self.ops
        for key in keys:
            op = ops.get(key)
            if op is None:
                continue
            if op.layer is None:
                if dense is None:
                    dense = driving_tokens(op, counts)
                tokens = dense
            else:
                tokens = driving_tokens(op, counts)
            nbytes = int(math.ceil(op.bytes(tokens)))
            total += nbytes
            if nbytes and not (nbytes >= min_bytes and (can_offload or op.recomputable)):
                soft += nbytes
                if not (can_offload or op.recomputable):
                    hard += nbytes
        return soft, hard, total
