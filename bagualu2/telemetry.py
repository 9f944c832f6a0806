"""Telemetry: one record per provisioning decision and per micro-batch, JSON lines, plots."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

__all__ = ["Decision", "MicroBatch", "Telemetry", "Totals"]


@dataclass
class Decision:
    """What the provisioner decided at one MoE gating event."""

    step: int
    micro_batch: int
    layer: int
    imbalance: float           # max tokens per expert over the mean
    resident_bytes: int        # ledger when the gate fired (other micro-batches included)
    predicted_bytes: int       # predicted resident high-water mark of this micro-batch, all keep
    planned_bytes: int         # the same under the chosen plan
    budget_bytes: Optional[int]
    mix: Dict[str, int]        # choice name -> number of operators
    latency_us: float
    feasible: bool = True
    kind: str = "decision"


@dataclass
class MicroBatch:
    """One provisioned forward, as measured."""

    step: int
    micro_batch: int
    peak_bytes: int            # ledger high-water mark during the forward
    predicted_peak_bytes: int  # what the cost model predicted at the first gate (all keep), 0 if none
    budget_bytes: Optional[int]
    imbalance: float           # the largest over the micro-batch's MoE layers
    bytes_by_choice: Dict[str, int]
    violations: int
    fallbacks: int
    forward_seconds: float
    oom_recovered: bool = False
    traced: bool = True        # False: calm, not traced (nothing planned; only offload could release)
    room_made_bytes: int = 0   # kept activations offloaded to make room for what nothing releases
    calibrating: bool = False  # released all it could (recomputed, or offloaded), to measure what that costs
    kind: str = "micro_batch"


@dataclass
class Totals:
    """Sums over every micro-batch and decision recorded, the ones no longer in memory included."""

    micro_batches: int = 0
    traced: int = 0
    peak_bytes: int = 0
    violations: int = 0
    fallbacks: int = 0
    room_made_bytes: int = 0
    bytes_by_choice: Dict[str, int] = field(default_factory=lambda: {"keep": 0, "offload": 0, "recompute": 0})
    decisions: int = 0
    latency_us_sum: float = 0.0
    latency_us_max: float = 0.0


@dataclass
class Telemetry:
    """Records kept in memory (the last ``keep`` of each kind, so a long run does not grow
    without bound; ``totals`` sums all of them) and, with ``path``, appended to a JSON lines
    file (all of them)."""

    path: Optional[Path] = None
    keep: int = 100_000
    decisions: List[Decision] = field(default_factory=list)
    micro_batches: List[MicroBatch] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep={self.keep} must be >= 1")
        if self.path is not None:
            self.path = Path(self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def add(self, record: Union[Decision, MicroBatch]) -> None:
        t = self.totals
        if isinstance(record, Decision):
            records: List = self.decisions
            t.decisions += 1
            t.latency_us_sum += record.latency_us
            t.latency_us_max = max(t.latency_us_max, record.latency_us)
        else:
            records = self.micro_batches
            t.micro_batches += 1
            t.traced += record.traced
            t.peak_bytes = max(t.peak_bytes, record.peak_bytes)
            t.violations += record.violations
            t.fallbacks += record.fallbacks
            t.room_made_bytes += record.room_made_bytes
            for k, v in record.bytes_by_choice.items():
                t.bytes_by_choice[k] = t.bytes_by_choice.get(k, 0) + v
        records.append(record)
        if len(records) >= 2 * self.keep:  # amortized: drop the oldest half at once
            del records[: len(records) - self.keep]
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(record)) + "\n")

    def decision_latency_us(self) -> Dict[str, float]:
        """Decision latency in microseconds: the mean and max over the whole run, the median
        over the decisions kept in memory (0.0 before any)."""
        t, lat = self.totals, sorted(d.latency_us for d in self.decisions)
        return {"mean": t.latency_us_sum / t.decisions if t.decisions else 0.0,
                "p50": lat[len(lat) // 2] if lat else 0.0, "max": t.latency_us_max}

    def plot(self, path: Union[str, Path], title: str = "activation memory") -> Path:
        """Memory of every micro-batch against the budget, spikes (imbalance >= 1.5) marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        records = self.micro_batches
        fig, ax = plt.subplots(figsize=(9, 3.5))
        xs = list(range(len(records)))
        ax.plot(xs, [r.peak_bytes / 2**20 for r in records], lw=1, label="peak activation MiB")
        budgets = [r.budget_bytes for r in records]
        if any(b is not None for b in budgets):
            ax.plot(xs, [(b or 0) / 2**20 for b in budgets], "k--", lw=1, label="budget")
        spikes = [i for i, r in enumerate(records) if r.imbalance >= 1.5]
        if spikes:
            ax.scatter(spikes, [records[i].peak_bytes / 2**20 for i in spikes], c="red", s=14,
                       zorder=3, label="routing spike")
        bad = [i for i, r in enumerate(records) if r.violations]
        if bad:
            ax.scatter(bad, [records[i].peak_bytes / 2**20 for i in bad], marker="x", c="black",
                       s=30, zorder=4, label="over budget")
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
