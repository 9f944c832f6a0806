"""What offloading costs the step: the training thread's part of each copy and what it waits for.

Predicts: one offload's and one reload's seconds (``offload_seconds``, ``reload_seconds``),
what a micro-batch pays once when it offloads anything (``copy_frame_s``), and how much copy
time the compute around it can hide (``windows``).

From: the copy engine's bandwidths and fixed per-copy seconds (given), and the runtime's
measurement per micro-batch that offloads (``observe_copies``): the training thread's seconds
on its copies (submitting, settling completed copies, waiting for copies and for room), fitted
as ``copy_frame_s + copies * copy_overhead_s + copy_factor * predicted copy time``
(``CostFit``), forgetting per offload count (to a power of two) so that the many small plans do
not erase what the micro-batches that offload everything taught. The copy engine's own busy
time is not a cost: a GPU's copy engines run beside compute, and the cpu backend copies on the
submitting thread when its stream is idle and on idle-priority threads otherwise, so the step
pays a copy where the thread runs or waits for it. Offload traffic hides behind the forward
compute after it, reload traffic behind backward (taken as twice the forward); in pipeline
warm-up the forwards stacked behind this micro-batch widen the offload window.

Known error: ``benchmarks/offload_cost_structure.py`` prints, per offload plan, the predicted
overhead beside the runtime's copy seconds and the measured step delta, and fits which of
(per micro-batch, per storage, per saved tensor, per byte) each follows; what no timer of the
runtime sees is its residual and is not priced. ``benchmarks/cost_model_accuracy.py`` prints
predicted against measured copy seconds per plan.
"""

from __future__ import annotations

from typing import Tuple

from bagualu2.plan.cost_model.fit import CostFit


class CopyModel:
    """Copy costs learned over a copy engine's given figures.

    Args:
        d2h_bandwidth, h2d_bandwidth: copy engine bandwidth in bytes per second.
        copy_fixed_s: (offload, reload) seconds every copy costs besides its bytes (submission,
            the reload's fresh device buffer, the wait).
        copies_overlap: whether copy time hides behind the compute after it, up to the copy
            windows (a GPU's copy engines). The cpu backend's copy threads run at the OS's idle
            priority beside compute: what a copy costs there is what the training thread waits
            for it, measured as such, and the windows are zero.
    """

    def __init__(self, d2h_bandwidth: float = 10e9, h2d_bandwidth: float = 10e9,
                 copy_fixed_s: Tuple[float, float] = (0.0, 0.0), copies_overlap: bool = True) -> None:
        if d2h_bandwidth <= 0 or h2d_bandwidth <= 0:
            raise ValueError(f"bandwidths must be > 0, got {d2h_bandwidth=}, {h2d_bandwidth=}")
        if min(copy_fixed_s) < 0:
            raise ValueError(f"copy_fixed_s={copy_fixed_s} must be >= 0")
        self.d2h_bandwidth = d2h_bandwidth
        self.h2d_bandwidth = h2d_bandwidth
        self.copy_fixed_s = (float(copy_fixed_s[0]), float(copy_fixed_s[1]))
        self.copies_overlap = copies_overlap
        # Per micro-batch that offloads: 1, its offloads, their predicted copy seconds ->
        # training-thread seconds, forgotten per size (offloads to a power of two).
        self.fit = CostFit(3)

    def observe_copies(self, seconds: float, copies: int, nbytes: int) -> None:
        """Learn what one micro-batch's offloads cost: ``seconds`` the training thread spent on
        them (submitting, settling completed copies, waiting for copies and for room) for
        ``copies`` offloads (each with its reload) of ``nbytes`` in all. The copy engine's busy
        time is no part of it (the module note says why). A copy's own work on the training
        thread (its store, the reload's fresh buffer, the hooks) does not scale with its bytes,
        what its bytes cost depends on how much of the copy the thread waits for, and a
        micro-batch that offloads anything pays a part once: three parts, told apart by
        micro-batches that offload different numbers and sizes of storages."""
        transfer = nbytes / self.d2h_bandwidth + nbytes / self.h2d_bandwidth
        fixed = copies * (self.copy_fixed_s[0] + self.copy_fixed_s[1])
        self.fit.add([((1.0, float(copies), fixed + transfer), seconds)], [copies.bit_length()])

    @property
    def copy_frame_s(self) -> float:
        """Learned training-thread seconds per micro-batch that offloads anything."""
        return self.fit.coef[0]

    @property
    def copy_overhead_s(self) -> float:
        """Learned training-thread seconds per offloaded storage (offload and reload together)."""
        return self.fit.coef[1]

    @property
    def copy_factor(self) -> float:
        """Learned seconds per second of copy time predicted from the engine's bandwidth."""
        return self.fit.coef[2]

    def offload_seconds(self, nbytes: int) -> float:
        """Predicted cost of offloading ``nbytes`` (one copy)."""
        return 0.5 * self.copy_overhead_s + self.copy_factor * (self.copy_fixed_s[0] + nbytes / self.d2h_bandwidth)

    def reload_seconds(self, nbytes: int) -> float:
        """Predicted cost of reloading ``nbytes`` (one copy)."""
        return 0.5 * self.copy_overhead_s + self.copy_factor * (self.copy_fixed_s[1] + nbytes / self.h2d_bandwidth)

    def windows(self, forward_seconds: float, remaining_fraction: float, stacked_forwards: int = 0) -> Tuple[float, float]:
        """(offload window, reload window) in seconds for the rest of a micro-batch.

        Args:
            forward_seconds: a micro-batch's forward time.
            remaining_fraction: share of the forward still to run after the decision point.
            stacked_forwards: forwards of other micro-batches that run before this one's
                backward (pipeline warm-up); their compute hides offloads too.
        """
        if not self.copies_overlap:
            return 0.0, 0.0
        return forward_seconds * (max(0.0, remaining_fraction) + stacked_forwards), 2.0 * forward_seconds
