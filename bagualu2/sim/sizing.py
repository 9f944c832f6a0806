"""Sizing the keep_all baseline: the longest sequence whose calm-phase peak fits in memory.

The aggressive baseline is tuned as it is in practice: the largest micro-batch that runs
without running out of memory in calm phases, with a safety margin of device memory left.
Both functions simulate keep_all on a one-step calm load with the engine itself, so the
baseline and the policies it is compared with share one memory model.
"""
from __future__ import annotations

import numpy as np

from bagualu2.sim.clusters import ClusterSpec
from bagualu2.sim.engine import Simulator
from bagualu2.sim.layout import Layout, stage_static_bytes
from bagualu2.sim.models import ModelSpec

__all__ = ["fit_seq_for_keep_all", "keep_all_calm_peak"]


def keep_all_calm_peak(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
                       calm_imbalance: float = 1.2) -> float:
    """Peak device bytes of keep_all (highest stage) when every MoE unit of every micro-batch
    carries ``calm_imbalance``."""
    sim = Simulator(model, cluster, layout, calm_imbalance=calm_imbalance)
    load = np.full((1, sim.M, len(sim.kinds_of_unit)), 1.0)
    load[:, :, sim.moe_units] = calm_imbalance
    return float(sim.simulate_policy("keep_all", load, max_load=calm_imbalance).peak.max())


def fit_seq_for_keep_all(model: ModelSpec, cluster: ClusterSpec, layout: Layout, *,
                         calm_imbalance: float = 1.125, margin: float = 0.03,
                         multiple: int = 64) -> int:
    """Longest sequence (a multiple of ``multiple``) whose keep_all calm peak fits in memory.

    This is how the aggressive baseline is tuned in practice: the largest micro-batch that ran
    without running out of memory in calm phases (every in-flight micro-batch at the calm mean
    load ``calm_imbalance``) with a safety ``margin`` of device memory left. Sums over dozens of
    in-flight micro-batches concentrate near the mean, so calm steps fit; spikes decide whether
    it crashes.

    Raises:
        ValueError: when even ``multiple`` tokens do not fit (names the static bytes).
    """
    import dataclasses

    def fits(seq: int) -> bool:
        lay = dataclasses.replace(layout, seq=seq)
        return (keep_all_calm_peak(model, cluster, lay, calm_imbalance)
                <= (1.0 - margin) * cluster.device_memory)

    lo, hi = 0, 1
    while hi <= 4096 and fits(hi * multiple):
        lo, hi = hi, hi * 2
    if lo == 0:
        static = max(stage_static_bytes(model, layout, s)["total"] for s in range(layout.pp))
        raise ValueError(
            f"keep_all cannot fit even {multiple} tokens per micro-batch of {model.name} on "
            f"{cluster.name} with tp={layout.tp} pp={layout.pp} vpp={layout.vpp} ep={layout.ep}: "
            f"{static / 2**30:.1f} GiB of weights/optimizer per device; raise tp, pp or ep")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * multiple) else (lo, mid)
    return lo * multiple
