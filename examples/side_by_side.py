"""What the engine examples print: the engine without bagualu2, keep_all and adaptive under one
budget, step by step and side by side, every rank's numbers gathered and printed by rank 0 (so
no two ranks' lines interleave).

``Run`` records one variant on one rank; ``report`` gathers every rank's runs and prints them.
A step's peak is the highest activation bytes resident in its forwards (``MicroBatch.peak_bytes``
of its micro-batches); a step is over the budget when one of its saves crossed it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist


@dataclass
class Run:
    """One variant's steps on this rank: the loss each step printed, and with bagualu2 its peak
    and whether it went over the budget."""

    name: str
    losses: List[Optional[float]] = field(default_factory=list)
    peaks: List[int] = field(default_factory=list)
    over: List[bool] = field(default_factory=list)
    budgeted: List[bool] = field(default_factory=list)  # whether the step ran under a budget
    untraced: List[bool] = field(default_factory=list)  # calm, untraced: what keep_all holds at its leanest
    budget: Optional[int] = None
    by_choice: Dict[str, int] = field(default_factory=dict)  # bytes saved as keep, offload, recompute
    _seen: int = 0
    _violations: int = 0

    def calm_peak(self) -> int:
        """The highest peak of the untraced steps so far: the first micro-batches are profiled
        (traced), which holds more than a calm one does."""
        return max(p for p, calm in zip(self.peaks, self.untraced) if calm)

    def record(self, loss: Optional[float], prov=None) -> None:
        """After a step: its loss (None where this rank computes none) and what ``prov`` saw."""
        self.losses.append(loss)
        if prov is None:
            return
        mbs = prov.telemetry.micro_batches[self._seen:]
        self._seen += len(mbs)
        self.peaks.append(max((m.peak_bytes for m in mbs), default=0))
        self.untraced.append(not any(m.traced for m in mbs))
        summary = prov.report()
        self.over.append(summary["violations"] > self._violations)
        self._violations = summary["violations"]
        self.budget = prov.budget
        self.budgeted.append(prov.budget is not None)
        self.by_choice = summary["saved_bytes_by_choice"]


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f}"


def report(runs: Sequence[Run], spikes: Sequence[int], first_step: int) -> None:
    """Gather every rank's ``runs`` on rank 0 and print them: per step the losses side by side,
    then per rank each variant's peaks against the budget; a summary last."""
    gathered: List[Optional[List[Run]]] = [None] * dist.get_world_size()
    dist.gather_object(list(runs), gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return
    names = [r.name for r in runs]
    steps = range(first_step, first_step + len(runs[0].losses))
    print("\nloss of each step, by rank (plain: the engine without bagualu2)")
    print("step spike  " + "  ".join(f"rank {k} " + " ".join(f"{n:>10}" for n in names)
                                     for k in range(len(gathered))))
    for i, step in enumerate(steps):
        cells = []
        for rank_runs in gathered:
            cells.append("       " + " ".join(f"{'-' if r.losses[i] is None else f'{r.losses[i]:.6f}':>10}"
                                             for r in rank_runs))
        print(f"{step:>4} {'yes' if step in spikes else '':>5}  " + "  ".join(cells))
    provisioned = [n for n in names if n != "plain"]
    print("\nactivation peak of each step, KiB (* over the budget; - no budget yet: keep_all's first steps "
          "measure the calm peak the budget is set from)")
    print("step spike  " + "  ".join(f"rank {k} " + " ".join(f"{n:>10}" for n in provisioned)
                                     for k in range(len(gathered))))
    for i, step in enumerate(steps):
        cells = []
        for rank_runs in gathered:
            cells.append("       " + " ".join(
                f"{_kib(r.peaks[i]) + ('*' if r.over[i] else ' ' if r.budgeted[i] else '-'):>10}"
                for r in rank_runs if r.name != "plain"))
        print(f"{step:>4} {'yes' if step in spikes else '':>5}  " + "  ".join(cells))
    print()
    for k, rank_runs in enumerate(gathered):
        by_name: Dict[str, Run] = {r.name: r for r in rank_runs}
        plain = by_name.get("plain")
        parts = []
        for r in rank_runs:
            if r.name == "plain":
                continue
            same = plain is None or r.losses == plain.losses  # bit for bit
            mix = ", ".join(f"{choice} {_kib(n)}" for choice, n in r.by_choice.items())
            peak = max(p for p, b in zip(r.peaks, r.budgeted) if b)
            since = steps[r.budgeted.index(True)]
            parts.append(f"{r.name}: peak {_kib(peak)} KiB from step {since} on, "
                         f"over the budget in {sum(r.over)} steps, "
                         f"losses {'equal to' if same else 'DIFFERENT from'} plain (KiB saved: {mix})")
        budget = next((r.budget for r in rank_runs if r.budget is not None), None)
        print(f"rank {k}: budget {_kib(budget) if budget else '-'} KiB\n  " + "\n  ".join(parts))
