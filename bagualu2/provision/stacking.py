"""Stacking: the micro-batches in flight on this rank, this one and those that will run their
forward before its backward.

Owns ``Stacking``: the pipeline phase and stacked forwards a schedule declares
(``Provisioner.set_pipeline_phase``) and, outside a schedule, the runs of forwards that ran back
to back without a backward between them (gradient accumulation: forward, forward, backward,
backward). The provisioner reserves room for what each stacked micro-batch will hold
(``Footprint.reserve``), sizes the host arena for all of them at the worst routing, and prices
copy windows by them.

Invariants: a declared phase overrides what the runs show; outside one, a forward's place in its
run is counted from the runtime's backward passes (a forward that begins after a backward starts
a new run), and only the last ``_RECENT`` runs count, so a burst of forwards without a backward
(an evaluation run with grad on) is forgotten.
"""

from __future__ import annotations

import collections
from typing import Deque

__all__ = ["Stacking", "PHASES"]

PHASES = ("none", "warmup", "steady", "cooldown")
# Runs of back-to-back forwards remembered: the longest of them predicts the next.
_RECENT = 8


class Stacking:
    """How many micro-batches stack on this rank before a backward."""

    def __init__(self) -> None:
        self.phase = "none"
        self.declared = 0  # forwards a pipeline schedule says run before the next backward
        # This forward's place in its run, the lengths of the last runs, and the backward count
        # when the last forward began.
        self._run_position = 0
        self._runs: Deque[int] = collections.deque(maxlen=_RECENT)
        self._backwards_seen = -1

    def set_phase(self, phase: str, stacked_forwards: int) -> None:
        """What a pipeline schedule declares (``Provisioner.set_pipeline_phase``)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: use one of {sorted(PHASES)}")
        if stacked_forwards < 0:
            raise ValueError(f"stacked_forwards={stacked_forwards} must be >= 0")
        self.phase = phase
        self.declared = stacked_forwards

    def count_forward(self, backward_passes: int) -> None:
        """Place the forward beginning now in its run of forwards without a backward between
        them (``backward_passes``: the runtime's count so far)."""
        if backward_passes == self._backwards_seen:
            self._run_position += 1
        else:
            if self._backwards_seen >= 0:
                self._runs.append(self._run_position + 1)
            self._run_position = 0
        self._backwards_seen = backward_passes

    def behind(self) -> int:
        """Forwards that will stack on this one before its backward: as the schedule declares,
        or as many as followed this place in the longest of the last runs."""
        if self.phase != "none":
            return self.declared
        return max(0, max(self._runs, default=0) - 1 - self._run_position)

    def deepest(self) -> int:
        """Forwards that stack on the first of a run before its backward (the most that are in
        flight behind one), as the schedule declares or the longest of the last runs shows;
        -1 before any run ended."""
        return self.declared if self.phase != "none" else max(self._runs, default=0) - 1
