"""``RunCounters``: what a provisioner counts over its run, apart from what it learns.

The micro-batches provisioned, the training steps marked, the out-of-memory recoveries, the
ledger's high-water mark with backward, the choices of the last micro-batch that planned,
whether a violation was told, and whether an offload failed. A checkpoint saves some of them
(``saved``; ``provision/state.py`` files them as plain values) and a resumed run goes on from
them (``restore``).

Invariants: the counters only grow (``last_choices`` is replaced whole); a violation is told
once a run (``first_violation``); once an offload failed, releases are never again left to
offloads (``copies_failed`` stays set).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from bagualu2.plan.planner import Choice

__all__ = ["RunCounters"]


class RunCounters:
    """A provisioner's run so far (the module note)."""

    def __init__(self) -> None:
        self.frames = 0  # micro-batches provisioned
        self.step = 0  # training steps marked (``Provisioner.step``)
        self.oom_recoveries = 0
        self.peak_with_backward = 0  # the ledger's high-water mark over the run (``note_peak``)
        self.last_choices: Optional[Dict[str, Choice]] = None  # what the last one that planned ran
        self._told_violation = False  # on_exceed="record" warns at the first violation only
        self.copies_failed = False  # an offload failed: releases are not left to offloads

    def note_peak(self, peak: int) -> int:
        """The high-water mark over the run, ``peak`` (the ledger's since it last restarted) included."""
        self.peak_with_backward = max(self.peak_with_backward, peak)
        return self.peak_with_backward

    def first_violation(self) -> bool:
        """Whether a violation is the run's first, the one told (a recorded count alone goes
        unread; a warning at every one would drown the rest)."""
        first = not self._told_violation
        self._told_violation = True
        return first

    def saved(self) -> Dict[str, Any]:
        """What a checkpoint keeps of them."""
        return {"frames": self.frames, "step": self.step, "peak_with_backward": self.peak_with_backward,
                "last_choices": self.last_choices}

    def restore(self, counters: Mapping[str, Any]) -> None:
        """Go on from what ``saved`` returned in the run that saved a checkpoint."""
        self.frames, self.step = counters["frames"], counters["step"]
        self.peak_with_backward, self.last_choices = counters["peak_with_backward"], counters["last_choices"]
