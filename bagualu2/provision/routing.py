"""The routing record: the tokens per expert each MoE layer routed, for the micro-batch running
now and summed over all so far.

Owns ``RoutingRecord``. The provisioner plans and predicts from the running micro-batch's counts
(``counts``), learns replay costs at them, and answers ``mean_counts`` and the worst routing a
micro-batch of this size could see (``worst``) from them.

Invariants: ``counts`` holds only what gates reported since ``begin`` (the forward now running,
or the last one when none runs); a layer's sums grow only with a report of as many experts as
its first, so a mean is over like reports; ``SIZE`` (the tokens this rank's own operators see,
under expert parallelism) is the first gate's and is never summed.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from bagualu2.shared import SIZE
from bagualu2.runtime.gates import GateSpec

__all__ = ["RoutingRecord"]


class RoutingRecord:
    """Tokens per expert of each MoE layer: this micro-batch's, and their sums over all."""

    def __init__(self) -> None:
        self.counts: Dict[int, List[int]] = {}  # layer (or SIZE) -> tokens per expert, this micro-batch
        self.sums: Dict[int, List[int]] = {}  # layer -> tokens per expert, summed over micro-batches
        self.frames: Dict[int, int] = {}  # layer -> micro-batches summed

    def begin(self) -> None:
        """A micro-batch's forward begins: nothing of it is routed yet."""
        self.counts = {}

    def record(self, layer: int, values: List[int], size: Optional[int] = None) -> None:
        """Gate ``layer`` routed ``values`` tokens per expert (``size``: tokens of this rank's own,
        where an expert-parallel gate's counts are what this rank's experts receive)."""
        if size is not None and SIZE not in self.counts:
            # The operators outside the experts follow this rank's own tokens (the first gate's).
            self.counts[SIZE] = [int(size)]
        self.counts[layer] = values
        sums = self.sums.setdefault(layer, [0] * len(values))
        if len(sums) == len(values):
            self.sums[layer] = [a + b for a, b in zip(sums, values)]
            self.frames[layer] = self.frames.get(layer, 0) + 1

    def mean(self) -> Dict[int, List[int]]:
        """Mean tokens per expert of each MoE layer over the micro-batches seen so far."""
        return {layer: [round(v / self.frames[layer]) for v in sums]
                for layer, sums in self.sums.items() if self.frames.get(layer)}

    def worst(self, gates: Sequence[GateSpec]) -> Optional[Dict[int, List[int]]]:
        """The routing of a micro-batch of this one's size whose every local expert gets every
        token it can (under expert parallelism, every token of every rank of the group, each
        routing as many as this one); None when a gate never fired (no bound)."""
        worst: Dict[int, List[int]] = {}
        for spec in gates:
            # A gate that did not fire in this micro-batch but did before belongs to a part of the
            # model this forward does not run (another pipeline stage or model chunk of the rank):
            # its micro-batches are sized as its past ones were on average.
            seen = self.counts.get(spec.layer) or self.mean().get(spec.layer)
            if not seen:
                return None
            routed = self.counts.get(SIZE) if spec.size_fn is not None else None
            tokens = sum(routed or seen) // (spec.top_k or 1) * spec.ep_size
            worst[spec.layer] = [tokens] * len(seen)
        return worst
