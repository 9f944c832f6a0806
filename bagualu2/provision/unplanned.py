"""Unplanned keys: operator keys that traced micro-batches saved after profiling and the cost
model never saw, so that no plan can name them (they are kept), and telling the user why.

Owns ``UnplannedKeys``: the keys (``report()["unplanned_keys"]``), the model's mode while
profiling, and whether each warning was given. An expert's keys are new when the expert got no
tokens while profiling, and that needs no word; any other new key means a module ran a different
number of ops than when profiled, which renumbers the ops after them in the same call.

Invariants: each warning is given at most once per provisioner: the mode warning when the model
runs in another mode (training or eval) than it was profiled in, the other when a module's ops
depend on the data. Past 4096 keys no more are recorded, so a run that renames keys every
micro-batch pays no scan per micro-batch.
"""

from __future__ import annotations

import warnings
from typing import Optional, Set

from bagualu2.plan.cost_model import CostModel
from bagualu2.runtime import Frame

__all__ = ["UnplannedKeys"]

_MOST = 4096  # enough to report


class UnplannedKeys:
    """Keys traced micro-batches saved after profiling that no plan can name."""

    def __init__(self) -> None:
        self._keys: Set[str] = set()
        self._profiled_training: Optional[bool] = None  # the model's mode while profiling
        self._mode_warned = False
        self._renamed_warned = False

    def __len__(self) -> int:
        return len(self._keys)

    def profiled(self, training: bool) -> None:
        """A micro-batch was profiled with the model in ``training`` mode."""
        self._profiled_training = training

    def note(self, frame: Frame, cost: CostModel, training: bool) -> None:
        """Record the keys ``frame`` saved that the profiled micro-batches never did (``cost``
        knows those), the model now in ``training`` mode, and say why once."""
        if len(self._keys) > _MOST:
            return
        new = [k for k in frame.keys_seen if k not in cost.ops]
        if not new:
            return
        self._keys.update(new)
        odd = next((k for k in new if cost.expert_of(k) is None), None)
        if odd is not None and self._profiled_training is not None and training != self._profiled_training:
            if not self._mode_warned:  # not a data-dependent loop: the mode changed the forward
                self._mode_warned = True
                now, then = ("eval", "training") if self._profiled_training else ("training", "eval")
                warnings.warn(
                    f"bagualu2: micro-batch {frame.index} ran in {now} mode with grad enabled, and the profiled "
                    f"micro-batches ran in {then} mode: {now} mode changed what the forward does (dropout, "
                    f"batch-norm statistics), so it saved activations under operator keys the profiled ones "
                    f"never used, e.g. {odd!r}; plans cannot name them, so they are kept. Evaluate under "
                    f"torch.no_grad() (not provisioned), or train in the mode that was profiled.", stacklevel=3)
            return
        if odd is not None and not self._renamed_warned:
            self._renamed_warned = True
            warnings.warn(
                f"bagualu2: micro-batch {frame.index} saved activations under operator keys that the "
                f"profiled micro-batches never used, e.g. {odd!r}. A key numbers an op within its "
                f"module call, so a module whose number of ops depends on the data (a loop that stops "
                f"early) renames the ops after that loop; plans cannot name them, so they are kept. "
                f"Moving such a loop into a module of its own keeps the names stable.", stacklevel=3)
