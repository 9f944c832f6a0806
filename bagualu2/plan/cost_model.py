"""Cost model: per-operator saved bytes and recompute time as functions of routed tokens.

Design note
-----------
The model is learned from profiled micro-batches, without the user describing the model. For
each operator key the runtime reports the bytes of the storage it saved and the measured time of
the ops that rebuild it; the provisioner reports each MoE layer's tokens per expert. Each key is
assigned a *driver*:

* an expert op (its module path lies under ``<moe layer>.experts.<e>``) is driven by the tokens
  routed to expert ``e`` of that layer;
* any other op (attention, norms, routing and permutation of the token slots) is driven by the
  micro-batch's size: the tokens routed by its first MoE layer (top-k times its tokens), which
  changes only when the sequence length or batch size does.

Bytes are fitted as ``a + b * tokens`` by least squares over the profiled samples
(proportional, ``a = 0``, while all samples share one token count; the largest sample for
constant ops). Saved bytes of expert ops are exactly linear in tokens, so the fit is exact once
two loads have been seen. Seconds are timings, with outliers (a preempted op, the cold first
micro-batch's allocations and first touches): the first micro-batch's timings are replaced by
the second's, and the fit is robust (the median for constant ops, Theil-Sen's median slope
otherwise). Copy time is bytes over the copy engine's measured bandwidth.

What one op costs to replay is measured where it runs: backward times each replayed op call
inside a chain (from the previous call's end: its inputs at hand, its share of the walk;
``observe_op_replays``), and a rebuild is priced at its ops' replay seconds. A rebuild's first
call, whose inputs were made before the rebuild, is timed apart (from its own start: the walk
down to it is entering the rebuild); alone it measured up to twice its time in a chain, on the
reference model, so its time in a chain prices it where it has one, and what it costs beyond
that is part of entering a rebuild; a call no chain has replayed (recomputing everything
replays each rebuild's first call only as such) is priced at its time as a first. A profiled
forward's op times stand for them only until an op has been replayed (scaled by the median
ratio of replay to profiled time over the ops replayed so far): on the reference model, the
profiled times of the ops a
recompute-everything plan replays summed to 0.56x to 2.0x what backward measured replaying them,
from run to run (one forward's timings, on a shared 2-core machine). The provisioner has the
first micro-batches that may need a plan recompute everything they can, so that every op plans
can release is measured before a plan relies on it (and, with ``recalibrate_every``, one in that
many after them, every other one of which offloads everything instead where there is a copy
engine: ``observe_copies`` then sees many offloads of every size, not only the plans' few).

What the backward pass pays beyond its ops is learned from the runtime's measurements of whole
plans (``_CostFit``): rebuilds as a cost per micro-batch that rebuilds anything (near 0 until
rebuilds tell it apart from the others: ``REPLAY_FRAME_SD``), a cost per rebuild backward
enters, a cost per replayed op and a factor on the ops' replay time; offloads
as a cost per micro-batch that offloads anything, a cost per offloaded storage (its
training-thread work: store, fresh reload buffer, hooks) and a factor on the predicted copy
time. The rebuild fit forgets per rebuild size (ops to a power of two): a batch of observations
decays only the earlier ones of its sizes, so that the one-op rebuilds budget plans make every
micro-batch do not erase the few large ones that tell the per-op part from the per-rebuild part;
the copy fit forgets per micro-batch offload count the same way, for the same reason.
What no timer of the runtime sees is not priced (``benchmarks/offload_cost_structure.py``
measures what a micro-batch that offloads costs the step beyond the copies and the learning).
A rebuild that replayed an op call again (backward could not keep what it made under the
budget until read) is not learned from: the model prices one replay per op. One that took more
than ``OUTLIER_RATIO`` times the median of the same key's last rebuilds of its size counts as
that much (a preempted thread).

The model does not price its own learning (the provisioner's refits as each backward ends,
which the step pays for). A fit of that cost against what was learned used to be part of every
plan's price; it was removed because no test of plans, decisions or budgets got worse without
it, and a model that models its own bookkeeping must earn its place that way. What learning
takes per step is shown, unpriced, by ``benchmarks/cost_model_accuracy.py``.

A plan's recomputed keys fall into rebuilds: each key backward meets first (no other recomputed
key reads it) enters one, and rebuilds inside it the recomputed keys and unsaved storages it
reads. On top of the shared fit, each key that enters a rebuild learns its own correction for
each rebuild size (the median ratio of what its rebuilds of that many op calls measured to what
the current fit predicts for them): ops with similar profiled forward times can cost very
different amounts to replay in backward (benchmarks/cost_model_accuracy.py shows by how much).

Overlap: offload traffic hides behind the forward compute that follows it, reload traffic
behind backward compute (taken as twice the forward); during pipeline warm-up the forwards of
the micro-batches that stack behind this one widen the offload window.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from bagualu2.runtime.tracing import call_key, module_of
from bagualu2.plan.planner import Candidate, Choice

__all__ = ["CostModel", "GROUPED", "OpCost", "SIZE"]

# A key of a counts mapping (MoE layer -> tokens per expert) holding the routing whose total
# sizes the micro-batch, when the layers' own entries are rounded up (planning).
SIZE = -1
GROUPED = -1
"""The expert index of an op that runs every expert of its layer at once (grouped experts):
the layer's tokens, summed, drive it."""

# A rebuild runs the ops it replays: its time per second of their replay time is taken to be 1,
# give or take this, until the observed rebuilds tell otherwise (``_CostFit.prior_sd``). Their
# replay times are backward's own measurements of them (in a chain: what a rebuild's first op
# costs beyond that is the per-rebuild part's), so the factor has little left to explain and
# what it learns from one plan's rebuilds says nothing of another's ops ...
REPLAY_FACTOR_SD = 0.02
# ... and never below this (``_CostFit.floor``): a rebuild's time holds its ops' replays, whose
# times are measurements of the same ops, noisy but not by half. The rebuilds of cheap ops alone
# leave the factor free to trade against the per-op and per-rebuild parts, which then fits it far
# below 1 and underprices every plan that recomputes expensive ops.
REPLAY_FACTOR_FLOOR = 0.5
# The part of a rebuild's time paid once per micro-batch (landing in backward's first rebuild)
# is taken to be 0 give or take this, until rebuilds tell it apart from the per-op and
# per-rebuild parts (``_CostFit.zero_sd``). Recomputing everything, the first rebuild replays
# nearly every op, and only the plans' small first rebuilds tell the parts apart: from
# calibrations alone, the fit puts what all the ops cost beyond their replay times on every plan
# that rebuilds anything. The prior keeps it near what the plans that tell it apart measure.
REPLAY_FRAME_SD = 200e-6
# A rebuild measured more than this many times the median of the same key's last rebuilds of
# its size counts as that much (``observe_replays``): a preempted thread, a collection pause
# makes a rebuild take many times its usual time once, and the least-squares fit would take it
# in full.
OUTLIER_RATIO = 4.0
# A key's correction of the shared fit for rebuilds of one size (``replay_ratio``) holds once
# it has measured this many of them: one rebuild, measured in a calibration that recomputed
# every other key, can set a correction far from what its next rebuilds measure.
CORRECTION_SAMPLES = 3
# Samples a fit of one op's bytes or seconds against its tokens keeps (the latest).
FIT_WINDOW = 32


@dataclass
class _Fit:
    """``a + b * tokens`` from the last ``FIT_WINDOW`` (tokens, value) samples: least squares
    (exact data such as bytes), or ``robust`` (timings): median for one token count, Theil-Sen
    otherwise. A robust fit is refitted once an eighth of its samples are new (each sample,
    below 8): its O(n^2) slopes are costly in Python, a micro-batch that rebuilds adds a sample
    to each of its replayed ops' fits, and one sample in an eighth moves the median little."""

    robust: bool = False
    samples: List[Tuple[float, float]] = field(default_factory=list)  # (tokens, value)
    a: float = 0.0
    b: float = 0.0
    _stale: bool = False
    _new: int = 0  # samples since the last refit

    def add(self, tokens: float, value: float) -> None:
        self.samples.append((tokens, value))
        if len(self.samples) > FIT_WINDOW:
            del self.samples[0]
        self._new += 1
        if not self.robust or 8 * self._new >= len(self.samples):
            self._stale = True

    def clear(self) -> None:
        self.samples.clear()
        self.a = self.b = 0.0
        self._stale = False
        self._new = 0

    def _refit(self) -> None:
        self._stale = False
        self._new = 0
        samples = self.samples
        n = len(samples)
        if n == 0:
            return
        xs = [x for x, _ in samples]
        ys = [y for _, y in samples]
        low, high = min(xs), max(xs)
        if self.robust:
            if low == high:  # one token count: no slope
                if low > 0:
                    self.a, self.b = 0.0, statistics.median(ys) / low
                else:
                    self.a, self.b = statistics.median(ys), 0.0
                return
            slopes = []
            for i in range(n - 1):
                xi, yi = samples[i]
                slopes.extend([(yj - yi) / (xj - xi) for xj, yj in samples[i + 1:] if xj != xi])
            self.b = statistics.median(slopes)
            self.a = statistics.median([y - self.b * x for x, y in samples])
            return
        mean_x = sum(xs) / n
        mean_y = sum(ys) / n
        if low != high:
            var = sum((x - mean_x) ** 2 for x in xs)
            self.b = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var
            self.a = mean_y - self.b * mean_x
        elif mean_x > 0:
            self.a, self.b = 0.0, mean_y / mean_x
        else:
            self.a, self.b = max(ys), 0.0

    def __call__(self, tokens: float) -> float:
        if self._stale:
            self._refit()
        return max(0.0, self.a + self.b * tokens)


class _CostFit:
    """``y = sum(coef[i] * x[i])``: a cost made of parts, each proportional to one feature of
    an observation (the last feature is a prediction of the cost, the others count items that
    each cost the same), fitted to observed totals ``y``.

    Least squares over all observations, those of each batch (``add``) weighing ``memory``
    times as much as those of the next one (costs drift with the machine's load), within each
    bucket the caller sorts them into (a batch forgets only what it observes anew: rebuilds of
    one op, the most frequent, would otherwise erase the few large ones that tell the per-op
    part from the per-rebuild part): on the
    relative error (an observation of a small total counts as much as one of a large total),
    or with ``relative`` false on the absolute error (large observations count most, as they
    do in the sums predicted from the fit). The relative error is taken against the total the
    fit predicted for the observation before it was added (kept within a factor of 2 of the
    observed total: the first fits can be far off), not against the observed total: dividing
    by a noisy total weighs the observations that came out low the most, and on timings 20%
    (30%) either side of their mean that fitted costs 5% (12%) below it. Every coefficient
    stays >= 0: among the subsets of features that keep the last one and that the observations
    can tell apart, the fit with non-negative coefficients and the least residual wins (the
    smaller subset on a tie).
    Before any observation the prediction is taken as it is (last coefficient 1).

    With ``prior_sd``, the last coefficient is taken to be 1 give or take ``prior_sd`` until
    the observations say otherwise (a Gaussian prior; the fit is its posterior mode): its
    departure from 1 is penalized by the residual variance of the plain fit over
    ``prior_sd`` squared. Exact observations are reproduced as without it; noisy ones whose
    predicted part is small next to the counted parts no longer bend the factor that larger
    observations will be predicted with. With ``floor``, the last coefficient stays
    ``>= floor`` (the others ``>= 0``). With ``zero_sd``, each coefficient ``i`` in it is taken
    to be 0 give or take ``zero_sd[i]`` in the same way: observations that cannot tell that
    part from the others leave it near 0.
    """

    __slots__ = ("coef", "memory", "relative", "prior_sd", "floor", "zero_sd", "_buckets", "_subsets")

    def __init__(self, features: int, memory: float = 0.9, relative: bool = True,
                 prior_sd: Optional[float] = None, floor: float = 0.0,
                 zero_sd: Optional[Mapping[int, float]] = None) -> None:
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"floor={floor} must be in [0, 1] (the last coefficient starts at 1)")
        if zero_sd and not all(0 <= i < features - 1 and sd > 0 for i, sd in zero_sd.items()):
            raise ValueError(f"zero_sd={zero_sd} must map coefficients before the last to sds > 0")
        self.coef = [0.0] * (features - 1) + [1.0]
        self.memory = memory
        self.relative = relative
        self.prior_sd = prior_sd
        self.floor = floor
        self.zero_sd = dict(zero_sd or {})
        # bucket -> decayed weighted sums of x x^T, of x y, of y^2 and of the observations
        self._buckets: Dict[Any, Tuple[List[List[float]], List[float], List[float]]] = {}
        last = features - 1
        self._subsets = sorted(
            ([i for i in range(last) if mask >> i & 1] + [last] for mask in range(1 << last)), key=len)

    def add(self, rows: Sequence[Tuple[Sequence[float], float]], buckets: Optional[Sequence[Any]] = None) -> None:
        """Observe a batch of (features, total), each row in the bucket at its index in
        ``buckets`` (all in one when None), and refit; rows with a total or a last feature that
        is not > 0, or a negative feature, are skipped."""
        k = len(self.coef)
        decayed: set = set()
        for row, bucket in zip(rows, buckets if buckets is not None else [None] * len(rows)):
            x, y = row
            if not (y > 0 and x[-1] > 0 and min(x) >= 0):
                continue
            stats = self._buckets.get(bucket)
            if stats is None:
                stats = self._buckets[bucket] = ([[0.0] * k for _ in range(k)], [0.0] * k, [0.0, 0.0])
            a, b, cn = stats
            if bucket not in decayed:
                decayed.add(bucket)
                for i in range(k):
                    b[i] *= self.memory
                    for j in range(k):
                        a[i][j] *= self.memory
                cn[0] *= self.memory
                cn[1] *= self.memory
            if self.relative:  # against the total expected, within 2x of the observed one
                expected = min(max(sum(c * v for c, v in zip(self.coef, x)), 0.5 * y), 2.0 * y)
                w = 1.0 / (expected * expected)
            else:
                w = 1.0
            for i in range(k):
                b[i] += w * x[i] * y
                for j in range(k):
                    a[i][j] += w * x[i] * x[j]
            cn[0] += w * y * y
            cn[1] += 1.0
        if not decayed:
            return
        sum_a = [[sum(st[0][i][j] for st in self._buckets.values()) for j in range(k)] for i in range(k)]
        sum_b = [sum(st[1][i] for st in self._buckets.values()) for i in range(k)]
        sum_c = sum(st[2][0] for st in self._buckets.values())
        observations = sum(st[2][1] for st in self._buckets.values())
        # The fit is of y - floor * x[last], whose last coefficient is coef[last] - floor >= 0.
        last, floor = k - 1, self.floor
        b = [sum_b[i] - floor * sum_a[i][last] for i in range(k)]
        c = sum_c - 2.0 * floor * sum_b[last] + floor * floor * sum_a[last][last]
        best = self._best(sum_a, b)
        if best is not None and (self.prior_sd or self.zero_sd):
            # residual sum of squares = c - theta^T b; per degree of freedom, the noise variance
            fitted = sum(1 for v in best[1] if v > 0)
            variance = max(0.0, c + best[0]) / max(1.0, observations - fitted)
            if variance > 0:
                a = [row[:] for row in sum_a]
                b = b[:]
                if self.prior_sd:  # + ridge * (coef[last] - 1)^2 in the objective
                    ridge = variance / (self.prior_sd * self.prior_sd)
                    a[last][last] += ridge
                    b[last] += ridge * (1.0 - floor)
                for i, sd in self.zero_sd.items():  # + ridge * coef[i]^2
                    a[i][i] += variance / (sd * sd)
                best = self._best(a, b) or best
        if best is not None:
            self.coef = best[1][:last] + [best[1][last] + floor]

    @property
    def observed(self) -> bool:
        """Whether any observation was kept."""
        return bool(self._buckets)

    def _best(self, a: List[List[float]], b: List[float]) -> Optional[Tuple[float, List[float]]]:
        """The least-squares fit with non-negative coefficients over the feature subsets, as
        (its residual up to a constant, the coefficients)."""
        k = len(b)
        best: Optional[Tuple[float, List[float]]] = None
        for subset in self._subsets:
            theta = _solve([[a[i][j] for j in subset] for i in subset], [b[i] for i in subset])
            if theta is None or min(theta) < 0:
                continue
            # Residual up to a constant: theta^T A theta - 2 theta^T b = -theta^T b at the optimum.
            residual = -sum(t * b[i] for t, i in zip(theta, subset))
            if best is None or residual < best[0] - 1e-9 * abs(best[0]):
                coef = [0.0] * k
                for t, i in zip(theta, subset):
                    coef[i] = t
                best = (residual, coef)
        return best


def _solve(a: List[List[float]], b: List[float]) -> Optional[List[float]]:
    """``a x = b`` for a small positive semi-definite ``a``; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    scale = [max(abs(m[i][i]), 1e-300) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9 * scale[col]:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class OpCost:
    """What the cost model knows of one operator key."""

    key: str
    layer: Optional[int]      # MoE layer whose expert drives it, or None (constant)
    expert: Optional[int]
    position: int = -1        # in the order a micro-batch first saves the keys (-1: unsaved storage)
    bytes: _Fit = field(default_factory=_Fit)
    seconds: _Fit = field(default_factory=lambda: _Fit(robust=True))  # its own ops, timed in profiled forwards
    recomputable: bool = True
    unsaved_inputs: Tuple[str, ...] = ()  # storages nothing saves that rebuilding it rebuilds first
    saved_inputs: Tuple[str, ...] = ()  # saved keys that rebuild reads (rebuilt first when released)
    # Rebuilds it entered: (measured seconds, 1 if the micro-batch's first else 0, ops
    # replayed, their replay seconds), and the correction they make of the shared fit per
    # number of ops replayed, cached for one version of that fit.
    replays: List[Tuple[float, float, int, float]] = field(default_factory=list)
    correction: Tuple[int, Dict[int, float]] = (-1, {})
    call: str = field(init=False)  # the op call that makes its storage (``call_key``)

    def __post_init__(self) -> None:
        self.call = call_key(self.key)


class CostModel:
    """Predicts per-operator saved bytes, recompute time and copy time of a micro-batch.

    Args:
        expert_prefixes: for each MoE layer index, the module path prefix of its experts
            (e.g. ``{0: "layers.0.moe.experts"}``).
        d2h_bandwidth, h2d_bandwidth: copy engine bandwidth in bytes per second.
        copy_fixed_s: (offload, reload) seconds every copy costs besides its bytes (submission,
            the reload's fresh device buffer, the wait).
        copies_overlap: whether copy time hides behind the compute after it, up to the copy
            windows (a GPU's copy engines). The cpu backend's copy threads run at the OS's idle
            priority beside compute: what a copy costs there is what the training thread waits
            for it, measured as such, and the windows are zero.
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
        self.unsaved: Dict[str, OpCost] = {}  # ops whose outputs nothing saves (rebuilt as inputs)
        # Per rebuild: first of its micro-batch, replayed ops, 1, the ops' replay seconds ->
        # its seconds. A plan's recompute cost is a sum over its rebuilds, where the large ones
        # weigh most; each key's replay_ratio corrects the small ones.
        self._replay_fit = _CostFit(4, relative=False, prior_sd=REPLAY_FACTOR_SD, floor=REPLAY_FACTOR_FLOOR,
                                    zero_sd={0: REPLAY_FRAME_SD})
        self._replay_version = 0
        # Per micro-batch that offloads: 1, its offloads, their predicted copy seconds ->
        # training-thread seconds, forgotten per size (offloads to a power of two).
        self._copy_fit = _CostFit(3)
        # op call -> its replay's seconds in backward, timed by the runtime's replays
        self._op_replays: Dict[str, _Fit] = {}
        self._lead_replays: Dict[str, _Fit] = {}  # ... as a rebuild's first call (timed apart)
        self._replay_scale = (-1, 1.0)  # (len(_op_replays) it was taken at, the scale)
        self._first_only: set = set()  # ("chain" or "lead", call) of fits holding only cold first replays
        self._cold_calls: set = set()  # calls first replayed in the last observe_op_replays
        self._call_replays: Dict[str, int] = {}  # ... and each call's replays there
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
        for layer, prefix in self.expert_prefixes.items():
            if path == prefix or path.startswith(prefix + "."):
                parts = path[len(prefix) + 1:].split(".")[:2]
                index = next((p for p in parts if p.isdigit()), None)
                return layer, int(index) if index is not None else GROUPED
        return None, None

    def observe(self, saved: Mapping[str, Tuple], counts: Mapping[int, Sequence[int]],
                forward_seconds: float, unsaved: Optional[Mapping[str, float]] = None) -> None:
        """Learn from one profiled micro-batch.

        Args:
            saved: key -> (saved storage bytes, measured seconds of its own ops, recomputable,
                keys of the unsaved storages its rebuild rebuilds first[, saved keys its rebuild
                reads]), in the order the micro-batch first saved them.
            counts: MoE layer -> tokens per expert of this micro-batch.
            forward_seconds: wall time of the micro-batch's forward.
            unsaved: key -> measured seconds of the ops of those unsaved storages.
        """
        for key, seconds in (unsaved or {}).items():
            op = self.unsaved.get(key)
            if op is None:
                op = self.unsaved[key] = OpCost(key, *self._driver(key))
            self._time(op, counts, seconds)
        for key, (nbytes, seconds, recomputable, unsaved_inputs, *saved_inputs) in saved.items():
            op = self.ops.get(key)
            if op is None:
                layer, expert = self._driver(key)
                op = self.ops[key] = OpCost(key, layer, expert, position=len(self.order))
                self.order.append(key)
            op.bytes.add(self._tokens(op, counts), float(nbytes))
            self._time(op, counts, seconds)
            op.recomputable = op.recomputable and recomputable
            op.unsaved_inputs = tuple(unsaved_inputs)
            op.saved_inputs = tuple(saved_inputs[0]) if saved_inputs else ()
        self.forward_seconds = (forward_seconds if self.frames == 0
                                else 0.5 * (self.forward_seconds + forward_seconds))
        self.frames += 1

    def _time(self, op: OpCost, counts: Mapping[int, Sequence[int]], seconds: float) -> None:
        if self.frames == 1:
            op.seconds.clear()  # the first micro-batch ran cold: its timings are not the op's
        op.seconds.add(self._tokens(op, counts), float(seconds))

    def rebuilds(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> List[Tuple[str, List[str], int, float]]:
        """The rebuilds backward enters to recompute ``keys`` together, latest key first:
        (the key that enters it, the recomputed keys it rebuilds, the ops it replays, their
        replay seconds, ``op_replay_seconds``). A rebuild replays its key's own op, the
        recomputed keys that op reads (and so on), and each unsaved storage any of those
        needs, unless an earlier rebuild ran its op (a rebuilt storage, and every other output
        of its op call, is cached for the rest of the backward pass)."""
        known = sorted((k for k in dict.fromkeys(keys) if k in self.ops), key=lambda k: -self.ops[k].position)
        wanted = set(known)
        read = {k for key in known for k in self.ops[key].saved_inputs if k in wanted}
        claimed: set = set()
        made: set = set()
        out = []
        for entry in known:
            if entry in read:
                continue
            members: List[str] = []
            stack = [entry]
            while stack:
                key = stack.pop()
                if key in claimed:
                    continue
                claimed.add(key)
                members.append(key)
                stack.extend(k for k in self.ops[key].saved_inputs if k in wanted)
            out.append((entry, members, *self._replayed(members, counts, made)))
        # Keys that read each other (an in-place write reading a later storage) have no key
        # that enters their rebuild first: each is counted as met on its own.
        for key in known:
            if key not in claimed:
                claimed.add(key)
                out.append((key, [key], *self._replayed([key], counts, made)))
        return out

    def _replayed(self, members: Iterable[str], counts: Mapping[int, Sequence[int]], made: set) -> Tuple[int, float]:
        """Ops and replay seconds of rebuilding ``members``: the op call of each, and of each
        unsaved storage they need, that is not in ``made`` (run earlier; added to it). One call
        makes all its outputs: a key whose sibling output was rebuilt is found made."""
        ops = 0
        seconds = 0.0
        for key in members:
            op = self.ops[key]
            if op.call in made:
                continue
            made.add(op.call)
            ops += 1
            seconds += self.op_replay_seconds(op, counts)
            for name in op.unsaved_inputs:
                unsaved = self.unsaved.get(name)
                if unsaved is not None and unsaved.call not in made:
                    made.add(unsaved.call)
                    ops += 1
                    seconds += self.op_replay_seconds(unsaved, counts)
        return ops, seconds

    def observe_op_replays(self, times: Mapping[str, Tuple[float, int, int, float, int]],
                           counts: Mapping[int, Sequence[int]]) -> None:
        """Learn what replaying each op costs in backward: ``times`` maps a key (of a saved or
        unsaved storage) to (seconds, n, replays, lead seconds, leads): what its op call's
        ``n`` replays inside a chain took, of ``replays`` in all, and what its ``leads``
        replays as a rebuild's first call took (``ActivationRuntime.take_op_replay_times``).
        A call's first replays in either role run cold (the first allocations of their
        outputs in backward: on the cpu, up to 1.8x the next ones): the next observation
        replaces them, and the rebuilds a call's very first replays were part of are not
        learned from (``observe_replays`` after this call); nor are those that replayed a call
        more often than there were micro-batches."""
        self._cold_calls = set()
        self._call_replays = {}
        for key, (seconds, n, replays, lead_seconds, leads) in times.items():
            op = self.ops.get(key) or self.unsaved.get(key)
            if op is None:
                continue
            call = op.call
            self._call_replays[call] = self._call_replays.get(call, 0) + replays
            if call not in self._op_replays and call not in self._lead_replays and n + leads > 0:
                self._cold_calls.add(call)
            for role, fits, spent, timed in (("chain", self._op_replays, seconds, n),
                                             ("lead", self._lead_replays, lead_seconds, leads)):
                if timed <= 0:
                    continue
                fit = fits.get(call)
                if fit is None:
                    fit = fits[call] = _Fit(robust=True)
                    self._first_only.add((role, call))
                elif (role, call) in self._first_only and call not in self._cold_calls:
                    fit.clear()  # its first replays ran cold: the next replace them
                    self._first_only.discard((role, call))
                fit.add(self._tokens(op, counts), spent / timed)

    def op_replay_seconds(self, op: OpCost, counts: Mapping[int, Sequence[int]]) -> float:
        """Seconds one replay of ``op``'s call costs in backward: as measured in replays inside
        a chain (``observe_op_replays``); for a call only ever replayed first in its rebuild,
        as measured there; until it has been replayed, its profiled forward time scaled as the
        ops replayed so far measured against theirs (the median ratio)."""
        tokens = self._tokens(op, counts)
        fit = self._op_replays.get(op.call) or self._lead_replays.get(op.call)
        if fit is not None:
            return fit(tokens)
        return self._profiled_scale() * op.seconds(tokens)

    def _profiled_scale(self) -> float:
        if self._replay_scale[0] != len(self._op_replays):
            ratios = []
            for op in list(self.ops.values()) + list(self.unsaved.values()):
                fit = self._op_replays.get(op.call)
                if fit is not None and fit.samples:
                    tokens = fit.samples[-1][0]
                    profiled = op.seconds(tokens)
                    if profiled > 0:
                        ratios.append(fit(tokens) / profiled)
            self._replay_scale = (len(self._op_replays), statistics.median(ratios) if ratios else 1.0)
        return self._replay_scale[1]

    def rebuild_profile(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> Tuple[int, int, float]:
        """What rebuilding ``keys`` together replays: the number of ops, the number of rebuilds
        backward enters (``rebuilds``) and the ops' replay seconds."""
        found = self.rebuilds(keys, counts)
        return sum(r[2] for r in found), len(found), sum(r[3] for r in found)

    def _fitted(self, ops: int, seconds: float) -> float:
        """The shared fit's seconds of one rebuild of ``ops`` ops replaying in ``seconds``."""
        return self.replay_entry_s + ops * self.replay_fixed_s + seconds * self.replay_factor

    def _corrections(self, key: str) -> Dict[int, float]:
        """``replay_ratio`` of ``key`` for each number of ops its measured rebuilds replayed."""
        op = self.ops[key]
        if op.correction[0] != self._replay_version:
            frame = self.replay_frame_s
            ratios: Dict[int, List[float]] = {}
            for measured, first, ops, seconds in op.replays:
                fitted = self._fitted(ops, seconds)
                if fitted > 0:
                    ratios.setdefault(ops, []).append(max(0.0, measured - first * frame) / fitted)
            op.correction = (self._replay_version,
                             {ops: min(10.0, max(0.1, statistics.median(r))) for ops, r in ratios.items()
                              if len(r) >= CORRECTION_SAMPLES})
        return op.correction[1]

    def replay_ratio(self, key: str, ops: int = 1) -> float:
        """How much more (or less) than the shared fit the rebuilds ``key`` entered that
        replayed ``ops`` ops measured: the median ratio over its last 16 (1 until
        ``CORRECTION_SAMPLES`` were measured), less the per-micro-batch part where the rebuild
        came first. Rebuilds of
        other sizes say little of these: which storages a rebuild finds already made depends
        on the plan (a plan recomputing everything rebuilds dozens of keys inside the one
        backward meets first), so a key's correction is learned and applied per size."""
        return self._corrections(key).get(ops, 1.0)

    def _rebuild_seconds(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> float:
        """What rebuilding ``keys`` together costs: the sum over its rebuilds."""
        return sum(self.replay_ratio(entry, ops) * self._fitted(ops, seconds)
                   for entry, _, ops, seconds in self.rebuilds(keys, counts))

    def observe_replays(self, replays: Mapping[str, Tuple[float, int]],
                        counts: Mapping[int, Sequence[int]]) -> None:
        """Learn what recomputing costs in backward: ``replays`` maps a key to (seconds, n):
        what its rebuilds in ``n`` micro-batches took (``ActivationRuntime.take_replay_times``).

        Each rebuild the plan enters (``rebuilds``) is one observation: what its members
        measured per micro-batch, against what it replays, among the rebuilds of its size
        (its ops to a power of two: the fit forgets per size). Four parameters for all ops:
        ``seconds = replay_fixed_s * replayed ops + replay_entry_s + replay_factor * the ops'
        replay seconds``, plus ``replay_frame_s`` in the first rebuild of a micro-batch's
        backward (where the per-micro-batch work lands) (``_CostFit``). Rebuilds differ in
        size, so the parts are told apart where plan totals alone confuse them (a plan's
        rebuilds, replayed ops and their seconds grow together). A shared unsaved input is
        charged to the rebuild ``rebuilds`` expects to make it; which one really does depends
        on the order backward unpacks, and each key's ``replay_ratio`` absorbs what stays
        systematic."""
        cold, self._cold_calls = self._cold_calls, set()
        call_replays, self._call_replays = self._call_replays, {}
        known = {k: v for k, v in replays.items() if k in self.ops and v[1] > 0}
        if not known:
            return
        # Where backward could not keep what it rebuilt under the budget, it rebuilt it again
        # (a call replayed more often than there were micro-batches): the rebuilds that
        # replayed such a call are not the ones priced here (each op once), and teach nothing
        # of them: under a tight budget one rebuilt storage that finds no room to be kept for
        # its next reader makes every later reader replay its chain again.
        micro_batches = max(n for _, n in known.values())
        skip = cold | {call for call, n in call_replays.items() if n > micro_batches}
        rows, sizes = [], []  # sizes: the rebuilds' size classes (ops, to a power of two)
        found = self.rebuilds(known, counts)
        for i, (entry, members, n_ops, seconds) in enumerate(found):
            measured = sum(known[k][0] / known[k][1] for k in members)
            if measured <= 0 or (skip and self._replays_any(members, skip)):
                continue
            first = 1.0 if i == 0 else 0.0
            samples = self.ops[entry].replays
            alike = [m for m, f, n, _ in samples if n == n_ops and f == first]
            if len(alike) >= 3:
                measured = min(measured, OUTLIER_RATIO * statistics.median(alike))
            rows.append(((first, float(n_ops), 1.0, seconds), measured))
            sizes.append(n_ops.bit_length())
            samples.append((measured, first, n_ops, seconds))
            if len(samples) > 16:
                del samples[0]
        self._replay_fit.add(rows, sizes)
        self._replay_version += 1

    def _replays_any(self, members: Iterable[str], calls: set) -> bool:
        """Whether rebuilding ``members`` replays any of ``calls`` (their own or an unsaved
        input's)."""
        for key in members:
            op = self.ops[key]
            if op.call in calls or any(u in self.unsaved and self.unsaved[u].call in calls for u in op.unsaved_inputs):
                return True
        return False

    @property
    def replay_frame_s(self) -> float:
        """Learned seconds per micro-batch whose backward rebuilds anything."""
        return self._replay_fit.coef[0]

    @property
    def replay_fixed_s(self) -> float:
        """Learned seconds per replayed op (the replay's own work: decoding, caching)."""
        return self._replay_fit.coef[1]

    @property
    def replay_entry_s(self) -> float:
        """Learned seconds per rebuild backward enters (its scopes, its walk of the recipe)."""
        return self._replay_fit.coef[2]

    @property
    def replay_factor(self) -> float:
        """Learned backward rebuild seconds per second of its ops' replay time."""
        return self._replay_fit.coef[3]

    def observe_copies(self, seconds: float, copies: int, nbytes: int) -> None:
        """Learn what one micro-batch's offloads cost: ``seconds`` the training thread spent on
        them (submitting, settling completed copies, waiting for copies and for room) for
        ``copies`` offloads (each with its reload) of ``nbytes`` in all: ``seconds =
        copy_frame_s + copies * copy_overhead_s + copy_factor * predicted copy time``
        (``_CostFit``). A copy's own work on the training thread (its store, the reload's fresh
        buffer, the hooks) does not scale with its bytes; what its bytes cost depends on how
        much of the copy the thread waits for; and a micro-batch that offloads anything pays a
        part once (benchmarks/offload_cost_structure.py measures the three parts). The copy
        engine's own busy time is not a cost: a GPU's copy
        engines run beside compute, and the cpu backend copies on the submitting thread when
        its stream is idle (queued copies run on threads at idle priority, which take only
        cycles compute leaves), so the step pays a copy where the thread runs or waits for it.
        Like the rebuilds' fit, this one forgets per size (its
        offloads to a power of two): the few micro-batches that offload everything are not
        erased by the many small plans between them, which alone cannot tell the per-offload
        part from the per-micro-batch part and the factor."""
        transfer = nbytes / self.d2h_bandwidth + nbytes / self.h2d_bandwidth
        self._copy_fit.add([((1.0, float(copies), copies * (self.copy_fixed_s[0] + self.copy_fixed_s[1]) + transfer), seconds)],
                           [copies.bit_length()])

    @property
    def copy_frame_s(self) -> float:
        """Learned training-thread seconds per micro-batch that offloads anything."""
        return self._copy_fit.coef[0]

    @property
    def copy_overhead_s(self) -> float:
        """Learned training-thread seconds per offloaded storage (offload and reload together)."""
        return self._copy_fit.coef[1]

    @property
    def copy_factor(self) -> float:
        """Learned seconds per second of copy time predicted from the engine's bandwidth."""
        return self._copy_fit.coef[2]

    def recompute_seconds(self, key: str, counts: Mapping[int, Sequence[int]]) -> float:
        """Predicted backward cost of recomputing ``key`` alone: the learned ``replay_entry_s``
        for entering its rebuild, ``replay_fixed_s`` per op it replays (unsaved inputs
        included), plus their replay seconds times the learned ``replay_factor``. The planner
        adds these up; a plan that recomputes several keys with a common unsaved input pays for
        that input once, and ``replay_frame_s`` once (``plan_seconds``)."""
        if key not in self.ops:
            return 0.0
        # rebuilds((key,), counts) for one key, without the walk (it is called per candidate)
        ops, seconds = self._replayed((key,), counts, set())
        return self.replay_ratio(key, ops) * self._fitted(ops, seconds)

    def offload_seconds(self, nbytes: int) -> float:
        """Predicted cost of offloading ``nbytes`` (one copy)."""
        return 0.5 * self.copy_overhead_s + self.copy_factor * (self.copy_fixed_s[0] + nbytes / self.d2h_bandwidth)

    def reload_seconds(self, nbytes: int) -> float:
        """Predicted cost of reloading ``nbytes`` (one copy)."""
        return 0.5 * self.copy_overhead_s + self.copy_factor * (self.copy_fixed_s[1] + nbytes / self.h2d_bandwidth)

    def plan_seconds(self, choices: Mapping[str, Any], counts: Mapping[int, Sequence[int]],
                     offload_window: float = 0.0, reload_window: float = 0.0) -> float:
        """Predicted step-time overhead of a plan (key -> Choice): its recomputes rebuilt
        together, plus the copy time the windows do not hide (``replay_frame_s`` or
        ``copy_frame_s`` once where it recomputes or offloads anything)."""
        recompute = [k for k, c in choices.items() if c == Choice.RECOMPUTE and k in self.ops]
        offload = [k for k, c in choices.items() if c == Choice.OFFLOAD and k in self.ops]
        seconds = 0.0
        if recompute:
            seconds += self.replay_frame_s + self._rebuild_seconds(recompute, counts)
        out = back = 0.0
        for key in offload:
            nbytes = self.predict_bytes(key, counts)
            out += self.offload_seconds(nbytes)
            back += self.reload_seconds(nbytes)
        if offload:
            seconds += self.copy_frame_s
        return seconds + max(0.0, out - offload_window) + max(0.0, back - reload_window)

    @staticmethod
    def _tokens(op: OpCost, counts: Mapping[int, Optional[Sequence[int]]]) -> float:
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
            return float(sum(layer_counts))
        return float(layer_counts[op.expert])

    def predict_bytes(self, key: str, counts: Mapping[int, Sequence[int]]) -> int:
        """Predicted saved bytes of ``key`` for a micro-batch with ``counts``."""
        op = self.ops.get(key)
        return 0 if op is None else int(math.ceil(op.bytes(self._tokens(op, counts))))

    def predict_total(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> int:
        """Predicted saved bytes of ``keys`` (all keep) for a micro-batch with ``counts``."""
        return sum(self.predict_bytes(k, counts) for k in keys)

    def _sized(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
               can_offload: bool, fixed: Iterable[str]) -> Iterable[Tuple[str, OpCost, int, bool]]:
        """(key, op, predicted bytes, whether a plan can release it) for the known keys with bytes."""
        fixed = set(fixed)
        for key in keys:
            op = self.ops.get(key)
            if op is None:
                continue
            nbytes = int(math.ceil(op.bytes(self._tokens(op, counts))))
            if nbytes:
                releasable = nbytes >= min_bytes and key not in fixed and (can_offload or op.recomputable)
                yield key, op, nbytes, releasable

    def candidates(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
                   can_offload: bool, fixed: Iterable[str] = ()) -> Tuple[List[Candidate], int]:
        """Planner candidates for ``keys``, and the predicted bytes that must stay resident.

        Keys below ``min_bytes`` and keys in ``fixed`` (anchors) are kept: their bytes are the
        floor that no plan can release (``floors``).
        """
        out: List[Candidate] = []
        floor = 0
        for key, op, nbytes, releasable in self._sized(keys, counts, min_bytes, can_offload, fixed):
            if not releasable:
                floor += nbytes
                continue
            out.append(Candidate(
                key=key,
                nbytes=nbytes,
                recompute_s=self.recompute_seconds(key, counts),
                offload_s=self.offload_seconds(nbytes),
                reload_s=self.reload_seconds(nbytes),
                can_offload=can_offload,
                can_recompute=op.recomputable,
            ))
        return out, floor

    def floors(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]], min_bytes: int,
               can_offload: bool) -> Tuple[int, int]:
        """The predicted bytes of ``keys`` that no plan releases (``candidates``' floor, without
        pricing the candidates), and of those the bytes nothing can release at all (neither
        offloadable nor recomputable: the runtime releases small ones too when the budget
        demands it)."""
        soft = hard = 0
        for _, op, nbytes, releasable in self._sized(keys, counts, min_bytes, can_offload, ()):
            if not releasable:
                soft += nbytes
                if not (can_offload or op.recomputable):
                    hard += nbytes
        return soft, hard

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
