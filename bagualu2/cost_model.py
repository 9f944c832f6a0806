"""Cost model: per-operator saved bytes and recompute time as functions of routed tokens.

Design note
-----------
The model is learned from profiled micro-batches, without the user describing the model. For
each operator key the runtime reports the bytes of the storage it saved and the measured time of
the ops that rebuild it; the provisioner reports each MoE layer's tokens per expert. Each key is
assigned a *driver*:

* an expert op (its module path lies under ``<moe layer>.experts.<e>``) is driven by the tokens
  routed to expert ``e`` of that layer;
* any other op is constant per micro-batch (attention, norms, routing and permutation of a fixed
  number of token slots).

Bytes and seconds are fitted as ``a + b * tokens`` by least squares over the profiled samples
(proportional, ``a = 0``, while all samples share one token count; the largest sample for
constant ops). Saved bytes of expert ops are exactly linear in tokens, so the fit is exact once
two loads have been seen. Copy time is bytes over the copy engine's measured bandwidth.

Overlap: offload traffic hides behind the forward compute that follows it, reload traffic
behind backward compute (taken as twice the forward); during pipeline warm-up the forwards of
the micro-batches that stack behind this one widen the offload window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from bagualu2.planner import Candidate

__all__ = ["CostModel", "OpCost"]


@dataclass
class _Fit:
    samples: List[Tuple[float, float]] = field(default_factory=list)  # (tokens, value)
    a: float = 0.0
    b: float = 0.0

    def add(self, tokens: float, value: float) -> None:
        self.samples.append((tokens, value))
        if len(self.samples) > 64:
            del self.samples[0]
        self._refit()

    def _refit(self) -> None:
        xs = [s[0] for s in self.samples]
        ys = [s[1] for s in self.samples]
        n = len(xs)
        mean_x = sum(xs) / n
        mean_y = sum(ys) / n
        var = sum((x - mean_x) ** 2 for x in xs)
        if var > 0:
            self.b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
            self.a = mean_y - self.b * mean_x
        elif mean_x > 0:
            self.a, self.b = 0.0, mean_y / mean_x
        else:
            self.a, self.b = max(ys), 0.0

    def __call__(self, tokens: float) -> float:
        return max(0.0, self.a + self.b * tokens)


@dataclass
class OpCost:
    """What the cost model knows of one operator key."""

    key: str
    layer: Optional[int]      # MoE layer whose expert drives it, or None (constant)
    expert: Optional[int]
    bytes: _Fit = field(default_factory=_Fit)
    seconds: _Fit = field(default_factory=_Fit)  # the op itself, timed in profiled forwards
    recomputable: bool = True


class CostModel:
    """Predicts per-operator saved bytes, recompute time and copy time of a micro-batch.

    Args:
        expert_prefixes: for each MoE layer index, the module path prefix of its experts
            (e.g. ``{0: "layers.0.moe.experts."}``).
        d2h_bandwidth, h2d_bandwidth: copy engine bandwidth in bytes per second.
        copy_fixed_s: (offload, reload) seconds every copy costs besides its bytes (submission,
            the reload's fresh device buffer, the wait).
        copies_overlap: whether copies run beside compute (a GPU's copy engines). On the cpu
            backend the copy threads share the cores with compute: copy time is never hidden,
            and the copy windows are zero.
    """

    def __init__(self, expert_prefixes: Mapping[int, str], d2h_bandwidth: float = 10e9,
                 h2d_bandwidth: float = 10e9, copy_fixed_s: Tuple[float, float] = (0.0, 0.0),
                 copies_overlap: bool = True) -> None:
        if d2h_bandwidth <= 0 or h2d_bandwidth <= 0:
            raise ValueError(f"bandwidths must be > 0, got {d2h_bandwidth=}, {h2d_bandwidth=}")
        if min(copy_fixed_s) < 0:
            raise ValueError(f"copy_fixed_s={copy_fixed_s} must be >= 0")
        self.expert_prefixes = dict(expert_prefixes)
        self.d2h_bandwidth = d2h_bandwidth
        self.h2d_bandwidth = h2d_bandwidth
        self.copy_fixed_s = (float(copy_fixed_s[0]), float(copy_fixed_s[1]))
        self.copies_overlap = copies_overlap
        self.ops: Dict[str, OpCost] = {}
        self.replay_factor = 1.0  # what backward rebuilds cost per second of profiled op time
        self.copy_factor = 1.0  # what an offload and its reload cost per second of predicted copy time
        self.order: List[str] = []           # keys in the order a micro-batch first saves them
        self.forward_seconds = 0.0           # measured forward time of one micro-batch
        self.frames = 0

    @property
    def ready(self) -> bool:
        return self.frames > 0

    def _driver(self, key: str) -> Tuple[Optional[int], Optional[int]]:
        path = key.split(":", 1)[0]
        for layer, prefix in self.expert_prefixes.items():
            if path.startswith(prefix):
                head = path[len(prefix):].split(".", 1)[0].split("#", 1)[0]
                if head.isdigit():
                    return layer, int(head)
        return None, None

    def observe(self, saved: Mapping[str, Tuple[int, float, bool]],
                counts: Mapping[int, Sequence[int]], forward_seconds: float) -> None:
        """Learn from one profiled micro-batch.

        Args:
            saved: key -> (saved storage bytes, measured seconds to rebuild, recomputable), in
                the order the micro-batch first saved them.
            counts: MoE layer -> tokens per expert of this micro-batch.
            forward_seconds: wall time of the micro-batch's forward.
        """
        for key, (nbytes, seconds, recomputable) in saved.items():
            op = self.ops.get(key)
            if op is None:
                layer, expert = self._driver(key)
                op = self.ops[key] = OpCost(key, layer, expert)
                self.order.append(key)
            tokens = self._tokens(op, counts)
            op.bytes.add(tokens, float(nbytes))
            op.seconds.add(tokens, float(seconds))
            op.recomputable = op.recomputable and recomputable
        self.forward_seconds = (forward_seconds if self.frames == 0
                                else 0.5 * (self.forward_seconds + forward_seconds))
        self.frames += 1

    def observe_replays(self, replays: Mapping[str, Tuple[float, int]],
                        counts: Mapping[int, Sequence[int]]) -> None:
        """Learn what recomputing costs in backward: ``replays`` maps a key to (seconds, count)
        of its rebuilds. A rebuild also pays for the inputs it must rebuild first and for the
        replay's own work, and which key pays for a shared input depends on the plan, so one
        factor is learned for all keys: measured seconds per second of profiled op time
        (smoothed over observations)."""
        measured = profiled = 0.0
        for key, (seconds, n) in replays.items():
            op = self.ops.get(key)
            if op is None or n <= 0:
                continue
            measured += seconds
            profiled += n * op.seconds(self._tokens(op, counts))
        if measured > 0 and profiled > 0:
            self.replay_factor = 0.5 * (self.replay_factor + measured / profiled)

    def observe_copies(self, seconds: float, copies: int, nbytes: int) -> None:
        """Learn what offloads cost: ``seconds`` of work they caused (the caller's submissions
        and waits, and on the cpu backend the copy threads' time, which the cores give up to
        them) for ``copies`` offloads of ``nbytes`` in all, against the predicted copy time."""
        predicted = (copies * (self.copy_fixed_s[0] + self.copy_fixed_s[1])
                     + nbytes / self.d2h_bandwidth + nbytes / self.h2d_bandwidth)
        if seconds > 0 and predicted > 0:
            self.copy_factor = 0.5 * (self.copy_factor + seconds / predicted)

    def recompute_seconds(self, key: str, counts: Mapping[int, Sequence[int]]) -> float:
        """Predicted backward cost of recomputing ``key``: its profiled op time times the
        measured ``replay_factor``."""
        op = self.ops[key]
        return op.seconds(self._tokens(op, counts)) * self.replay_factor

    @staticmethod
    def _tokens(op: OpCost, counts: Mapping[int, Sequence[int]]) -> float:
        if op.layer is None:
            return 0.0
        layer_counts = counts.get(op.layer)
        if layer_counts is None or op.expert is None or op.expert >= len(layer_counts):
            return 0.0
        return float(layer_counts[op.expert])

    def predict_bytes(self, key: str, counts: Mapping[int, Sequence[int]]) -> int:
        """Predicted saved bytes of ``key`` for a micro-batch with ``counts``."""
        op = self.ops.get(key)
        return 0 if op is None else int(math.ceil(op.bytes(self._tokens(op, counts))))

    def predict_total(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> int:
        """Predicted saved bytes of ``keys`` (all keep) for a micro-batch with ``counts``."""
        return sum(self.predict_bytes(k, counts) for k in keys)

    def candidates(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
                   can_offload: bool, fixed: Iterable[str] = ()) -> Tuple[List[Candidate], int]:
        """Planner candidates for ``keys``, and the predicted bytes that must stay resident.

        Keys below ``min_bytes`` and keys in ``fixed`` (anchors) are kept: their bytes are the
        floor that no plan can release.
        """
        fixed = set(fixed)
        out: List[Candidate] = []
        floor = 0
        for key in keys:
            op = self.ops.get(key)
            if op is None:
                continue
            tokens = self._tokens(op, counts)
            nbytes = int(math.ceil(op.bytes(tokens)))
            if nbytes == 0:
                continue
            if nbytes < min_bytes or key in fixed or not (can_offload or op.recomputable):
                floor += nbytes
                continue
            out.append(Candidate(
                key=key,
                nbytes=nbytes,
                recompute_s=self.recompute_seconds(key, counts),
                offload_s=self.copy_factor * (self.copy_fixed_s[0] + nbytes / self.d2h_bandwidth),
                reload_s=self.copy_factor * (self.copy_fixed_s[1] + nbytes / self.h2d_bandwidth),
                can_offload=can_offload,
                can_recompute=op.recomputable,
            ))
        return out, floor

    def windows(self, remaining_fraction: float, stacked_forwards: int = 0) -> Tuple[float, float]:
        """(offload window, reload window) in seconds for the rest of a micro-batch.

        Args:
            remaining_fraction: share of the forward still to run after the decision point.
            stacked_forwards: forwards of other micro-batches that run before this one's
                backward (pipeline warm-up); their compute hides offloads too.
        """
        if not self.copies_overlap:
            return 0.0, 0.0
        fwd = self.forward_seconds
        return fwd * (max(0.0, remaining_fraction) + stacked_forwards), 2.0 * fwd
