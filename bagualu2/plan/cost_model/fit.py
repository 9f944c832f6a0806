"""The fitting library the cost model's pieces learn with; it predicts nothing on its own.

* ``LineFit``: ``a + b * tokens`` over a window of (tokens, value) samples, least squares for
  exact data (saved bytes) or robust for timings (the median, or Theil-Sen's median slope).
* ``CostFit``: a cost made of parts, each proportional to one feature of an observation (items
  that each cost the same, and a prediction of the cost times a factor), fitted to observed
  totals by least squares with non-negative parts, forgetting old observations per bucket.

Known error: none of their own beyond what the tests pin (tests/test_cost_model.py: the timing
fit is the Theil-Sen line of its window; exact costs are reproduced; noise does not bias the
relative fit low; a bucket forgets only what it observes anew). What the fitted models get
wrong is measured by the benchmarks their modules name.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# Samples a fit of one op's bytes or seconds against its tokens keeps (the latest).
FIT_WINDOW = 32


@dataclass
class LineFit:
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


class CostFit:
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
