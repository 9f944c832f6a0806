"""Expert-load traces: generated (seeded) or read from the provisioner's telemetry JSON lines.

A :class:`LoadTrace` holds, per step, micro-batch and MoE unit, the *imbalance* of the expert-
parallel group: tokens received by the most loaded EP rank divided by the mean (1.0 = perfectly
balanced). It is what the simulator's most-loaded rank receives (``R = T * top_k * load``).

Generated traces reproduce the measured pattern (BaGuaLu-2: 97.1% of iterations below 1.2x,
2.9% reaching 2.6x):

- calm: every (micro-batch, layer) draws ``calm_lo + (calm_hi - calm_lo) * Beta(2, 2)``
  (default 1.05 .. 1.20, mean 1.125);
- spikes: each *step* is a spike step with probability ``spike_rate``; a spike hits a burst of
  1 to 4 consecutive micro-batches (uniform), in every MoE layer, with imbalance
  ``1 + (max_imbalance - 1) * U(0.6, 1)``; one (micro-batch, layer) of the burst reaches
  ``max_imbalance`` exactly.

With ``ep == 1`` there is no imbalance between ranks (one rank holds every expert): all 1.0.
:func:`rank_counts` expands one imbalance into per-EP-rank token counts with that max/mean.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np

__all__ = ["LoadTrace", "generate_trace", "rank_counts", "read_telemetry", "write_telemetry"]


@dataclass
class LoadTrace:
    """Imbalance per ``[step, microbatch, moe_unit]`` and which steps carry a spike.

    Attributes:
        load: float array ``[steps, microbatches, moe_units]`` (>= 1 in generated traces).
        spike: bool array ``[steps]``: steps generated as (or observed to be) spikes.
        source: where it comes from (``generated(seed=...)`` or a file path).
    """

    load: np.ndarray
    spike: np.ndarray
    source: str = ""

    @property
    def steps(self) -> int:
        return int(self.load.shape[0])

    def stats(self, calm_threshold: float = 1.2) -> dict:
        """Observed spike rate (steps whose max exceeds ``calm_threshold``), quantiles."""
        step_max = self.load.reshape(self.steps, -1).max(axis=1)
        return {
            "steps": self.steps,
            "spike_rate": float((step_max > calm_threshold + 1e-9).mean()),
            "max_imbalance": float(self.load.max()),
            "calm_mean": (float(self.load[~self.spike].mean()) if (~self.spike).any()
                          else float("nan")),
            "p50": float(np.quantile(self.load, 0.5)),
            "p99": float(np.quantile(self.load, 0.99)),
        }

    def fit(self, steps: int, microbatches: int, moe_units: int) -> "LoadTrace":
        """This trace tiled/cropped to the shape a simulation needs (recorded traces are short)."""
        reps = [math.ceil(n / max(1, d)) for n, d in zip((steps, microbatches, moe_units),
                                                          self.load.shape)]
        load = np.tile(self.load, reps)[:steps, :microbatches, :moe_units]
        spike = np.tile(self.spike, reps[0])[:steps]
        return LoadTrace(np.ascontiguousarray(load), spike, self.source)


def generate_trace(steps: int, microbatches: int, moe_units: int, *, ep: int = 8,
                   spike_rate: float = 0.029, max_imbalance: float = 2.6,
                   calm: Sequence[float] = (1.05, 1.20), seed: int = 0) -> LoadTrace:
    """Seeded synthetic trace (see the module docstring for the distribution).

    Raises:
        ValueError: rates outside [0, 1], ``max_imbalance`` below the calm range, bad shapes.
    """
    if not 0.0 <= spike_rate <= 1.0:
        raise ValueError(f"spike_rate must be in [0, 1], got {spike_rate}")
    lo, hi = float(calm[0]), float(calm[1])
    if not 1.0 <= lo <= hi:
        raise ValueError(f"calm range must satisfy 1 <= lo <= hi, got {calm}")
    if max_imbalance < hi:
        raise ValueError(f"max_imbalance = {max_imbalance} is below the calm range {calm}; "
                         f"use at least {hi}")
    if min(steps, microbatches) < 1 or moe_units < 0:
        raise ValueError(f"need steps >= 1, microbatches >= 1, moe_units >= 0; got "
                         f"{steps}, {microbatches}, {moe_units}")
    rng = np.random.default_rng(seed)
    shape = (steps, microbatches, moe_units)
    spike = rng.random(steps) < spike_rate
    if ep <= 1:
        return LoadTrace(np.ones(shape), spike & False, f"generated(seed={seed}, ep=1)")
    load = lo + (hi - lo) * rng.beta(2.0, 2.0, size=shape)
    for s in np.flatnonzero(spike):
        if moe_units == 0:
            break
        burst = int(rng.integers(1, min(4, microbatches) + 1))
        first = int(rng.integers(0, microbatches - burst + 1))
        mag = 1.0 + (max_imbalance - 1.0) * rng.uniform(0.6, 1.0, size=(burst, moe_units))
        mag[int(rng.integers(0, burst)), int(rng.integers(0, moe_units))] = max_imbalance
        load[s, first:first + burst] = np.maximum(load[s, first:first + burst], mag)
    return LoadTrace(load, spike, f"generated(seed={seed}, spike_rate={spike_rate}, "
                                  f"max_imbalance={max_imbalance})")


def rank_counts(tokens: int, ep: int, imbalance: float,
                rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Token copies per EP rank summing to ``tokens`` whose max / mean equals ``imbalance``.

    The hot rank gets ``imbalance * mean``; the rest share the remainder with mild noise kept
    below the hot rank. Needs ``1 <= imbalance <= ep``.
    """
    if ep < 1 or not 1.0 <= imbalance <= ep:
        raise ValueError(f"need ep >= 1 and 1 <= imbalance <= ep, got ep={ep}, "
                         f"imbalance={imbalance}")
    rng = rng or np.random.default_rng(0)
    mean = tokens / ep
    out = np.empty(ep)
    out[0] = imbalance * mean
    if ep > 1:
        w = rng.uniform(0.9, 1.1, size=ep - 1)
        rest = (tokens - out[0]) * w / w.sum()
        out[1:] = np.minimum(rest, out[0])
        out[1:] *= (tokens - out[0]) / max(out[1:].sum(), 1e-12)
    return out


def _imbalance(counts: Sequence[float], ep: int) -> float:
    c = np.asarray(counts, dtype=np.float64)
    if ep <= 1 or c.sum() <= 0:
        return 1.0
    if len(c) % ep:
        raise ValueError(f"{len(c)} experts cannot be split over ep = {ep} ranks")
    per_rank = c.reshape(ep, -1).sum(axis=1)
    return float(per_rank.max() / per_rank.mean())


def read_telemetry(path: Union[str, Path], *, ep: int, experts_per_rank: int = 1,
                   calm_threshold: float = 1.2) -> LoadTrace:
    """Load trace from the provisioner's telemetry JSON lines (``bagualu2.telemetry``).

    Each decision record needs a step, a micro-batch and a MoE layer index (keys ``step``,
    ``micro_batch`` (or ``microbatch`` / ``mb``), ``layer``) and either ``tokens_per_expert``
    (per-expert counts; split contiguously over ``ep`` ranks to get the rank imbalance) or an
    ``imbalance`` / ``load_imbalance`` field. The runtime's ``imbalance`` is per *expert* (max
    expert over the mean expert); replayed on a layout whose EP ranks hold ``experts_per_rank``
    experts, the hot rank carries the hot expert plus ``experts_per_rank - 1`` experts at the
    mean, so its imbalance is ``(x + g - 1) / g`` (``g = experts_per_rank``; 1 keeps ``x``).
    Records that are not decisions (no ``layer``, e.g. ``kind == "micro_batch"``) are skipped.
    Missing cells are filled with 1.0; spike steps are those with an imbalance above
    ``calm_threshold``.

    Raises:
        ValueError: when no usable record is found (names the file and the keys expected).
    """
    rows: List[tuple] = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict) or "layer" not in rec:
                continue
            if "tokens_per_expert" in rec:
                imb = _imbalance(rec["tokens_per_expert"], ep)
            elif "imbalance" in rec or "load_imbalance" in rec:
                x = float(rec.get("imbalance", rec.get("load_imbalance")))
                g = max(1, int(experts_per_rank))
                imb = (x + g - 1) / g
            else:
                continue
            mb = rec.get("micro_batch", rec.get("microbatch", rec.get("mb", 0)))
            rows.append((int(rec.get("step", 0)), int(mb), int(rec["layer"]), imb))
    if not rows:
        raise ValueError(f"{path}: no telemetry decision records with 'layer' and "
                         f"'tokens_per_expert' (or 'imbalance') found; record one with "
                         f"bagualu2.enable(..., telemetry_path=<path>)")
    steps = sorted({r[0] for r in rows})
    sidx = {s: i for i, s in enumerate(steps)}
    M = max(r[1] for r in rows) + 1
    L = max(r[2] for r in rows) + 1
    load = np.ones((len(steps), M, L))
    for s, m, layer, imb in rows:
        load[sidx[s], m, layer] = imb
    spike = load.reshape(len(steps), -1).max(axis=1) > calm_threshold
    return LoadTrace(load, spike, str(path))


def write_telemetry(trace: LoadTrace, path: Union[str, Path]) -> None:
    """Write ``trace`` as telemetry-style JSON lines (``imbalance`` field); round-trips."""
    with open(path, "w") as fh:
        for s, m, layer in np.ndindex(*trace.load.shape):
            fh.write(json.dumps({"kind": "decision", "step": s, "micro_batch": m, "layer": layer,
                                 "imbalance": float(trace.load[s, m, layer])}) + "\n")
