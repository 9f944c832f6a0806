"""Head to head: bagualu2 ``adaptive`` against the fastest static configuration that held the budget.

A user who does not install bagualu2 tunes their engine's own activation options until the run
survives its spikes. This script does that tuning for them, on the same model, the same spike trace
and the same per-rank budget, and times the winner against ``adaptive``.

Engines (``--engines``): ``pytorch``, the reference MoE model with ``torch.utils.checkpoint`` and
selective checkpointing (versus_static_pytorch.py); ``torchtitan``, a torchtitan 0.3.0 qwen3 MoE
decoder of the same sizes with its ``activation_checkpoint`` modes (versus_static_torchtitan.py);
``megatron``, a Megatron-Core 0.16.1 MoE ``GPTModel`` of the same sizes with its
``recompute_granularity`` / ``recompute_modules`` options (versus_static_megatron.py). Each names
the options it leaves out and why. bagualu2's integrations refuse an engine's own recompute
together with bagualu2, so ``adaptive`` runs with it off.

Setup (every engine): real expert parallelism over ``--world`` gloo processes (127.0.0.1, one
thread each), the same weights for every configuration (built from one seed; no optimizer step,
so every configuration computes the same losses on the same batches, which the script checks).
The trace has ``--micro-batches`` micro-batches; about ``--spike-rate`` of them (at least two)
route ``--imbalance`` x the mean load onto one expert, alternately one held by rank 0 and one held
by the last rank, so the spike lands on either rank (every rank's router sends that share of its
tokens there: the reference model's ``routing_spike``, or ``spike_logits`` on an engine's router).

Memory is measured the same way for every configuration, bagualu2 included, by
``AllocationMeter``: every storage an aten op creates from the start of a micro-batch's forward
to the end of its backward, while it lives (the stand-in on this machine for
``torch.cuda.max_memory_allocated``: activations, temporaries and gradients).
The per-rank budget is ``--headroom`` above the largest calm micro-batch's peak without any
activation option (keep everything). ``adaptive`` gets that budget whole, and the meter as its
allocator view (``enable(allocator=meter.read)``: the bytes the meter counts now and its peak since
the last reading), as a GPU run gets ``allocator="cuda"``: it learns, micro-batch by micro-batch,
what lies outside its activations at the peak (the forward's working set, the gradients) and how
that grows with the routed load, and holds its activations to what that leaves. Nothing is tuned
for it; it is judged by the meter like everything else.

For each engine the script:

1. measures every static configuration of its grid on the calm micro-batch and on one spike aimed
   at each rank, and keeps those whose peak stays within the budget on every rank (``adaptive``
   runs the same micro-batches once before the trace, and learns from them what it learns from
   any);
2. times the survivors on a few calm micro-batches, interleaved, and picks the fastest;
3. runs the whole trace once per configuration (the fastest survivor, ``adaptive``, keep-all and
   full recompute), one micro-batch of each per round in a rotating order, timing each
   micro-batch (the slowest rank's time, the ranks aligned by a barrier), each configuration
   under its own meter (so every one pays the meter's cost per op, and ``adaptive`` reads it),
   and counts the micro-batches over the budget on any rank (violations) in that same run.

Speedups are paired: the trace is cut into ``--segments`` consecutive parts and each part's time
of the static winner is divided by ``adaptive``'s over the same micro-batches; the table gives the
median and the range of those ratios.

On this machine an offload is a memcpy between two areas of the same RAM, competing with the
compute for the same two cores; on a GPU it is a DMA transfer over PCIe that runs beside the
kernels. Offload is therefore priced high here, and ``adaptive`` leans on recomputation; on a
device the same planner gets cheaper offloads, which moves the ratio in its favour.

    python benchmarks/versus_static.py --engines pytorch,torchtitan,megatron --out versus_static.json
    python benchmarks/versus_static.py --quick      # the slow lane's short form
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from bagualu2.models import MoEConfig

# The tests' multi-process harness (spawned gloo ranks on 127.0.0.1, a free port, hard timeouts);
# the spawned ranks find it on the sys.path they inherit.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from pipeline_harness import launch  # noqa: E402

SEED = 0
ENGINES = ("pytorch", "torchtitan", "megatron")
REGIMES = {"default": 0.05, "tight": -0.35, "paper": 0.05}  # the budget above the calm keep-all peak

# ---------------------------------------------------------------------------------------------
# The trace and the meter
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trace:
    """Which micro-batches spike, and onto which expert (global index); in the ``paper`` regime
    also the mild imbalance of every other micro-batch after the warm-up (``skew``)."""

    micro_batches: int
    spikes: Dict[int, int]
    imbalance: float
    skew: Dict[int, Tuple[int, float]] = field(default_factory=dict)  # i -> (expert, imbalance)

    @classmethod
    def make(cls, n: int, rate: float, imbalance: float, num_experts: int, warmup: int,
             paper: bool = False) -> "Trace":
        count = max(2, round(rate * n))
        if count > n - warmup:
            raise SystemExit(f"--micro-batches {n} leaves no room for {count} spikes after {warmup} calm ones")
        step = (n - warmup) / count
        where = [warmup + int(step * (k + 0.5)) for k in range(count)]
        # Alternately an expert of rank 0 and one of the last rank (the last expert).
        spikes = {i: (0 if k % 2 == 0 else num_experts - 1) for k, i in enumerate(where)}
        skew: Dict[int, Tuple[int, float]] = {}
        if paper:
            # The BaGuaLu-2 paper's load: every micro-batch after the warm-up at an imbalance
            # drawn up to 1.2x on an expert drawn at random, the spikes drawn from 1.2x to
            # ``imbalance`` (the warm-up balanced: the budget is set on a balanced micro-batch).
            g = random.Random(SEED)
            for i in range(warmup, n):
                skew[i] = (spikes[i], g.uniform(1.2, imbalance)) if i in spikes else \
                    (g.randrange(num_experts), g.uniform(1.0, 1.2))
        return cls(n, spikes, imbalance, skew)

    def load(self, i: int) -> Tuple[Optional[int], float]:
        """Micro-batch ``i``'s (expert lifted or None, imbalance it is lifted to)."""
        if i in self.skew:
            return self.skew[i]
        return self.spikes.get(i), self.imbalance

    def probes(self) -> List[int]:
        """One calm micro-batch and the first spike aimed at each rank."""
        first: Dict[int, int] = {}
        for i, expert in sorted(self.spikes.items()):
            first.setdefault(expert, i)
        calm = next(i for i in range(self.micro_batches) if i not in self.spikes)
        return [calm, *sorted(first.values())]


def _tokens(vocab: int, rank: int, i: int, batch: int, seq: int) -> torch.Tensor:
    """Micro-batch ``i``'s tokens on ``rank`` (the same for every configuration)."""
    g = torch.Generator().manual_seed(SEED + 1000 * rank + i)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class AllocationMeter(TorchDispatchMode):
    """The bytes of the storages that ops create while it is on and that are still alive, and
    their high-water mark.

    The outermost dispatch mode sees every aten op below it, bagualu2's tracing mode, selective
    checkpointing's modes and backward's recomputations included, so every configuration is
    measured alike. What no op creates (bagualu2's pinned host arena, filled by its copy engine)
    is host memory and is not counted. A storage is counted from the op that creates it until it
    dies (checked at each op), at its full size. A wrapper subclass (a functional collective's
    result, a ``DTensor``) owns no memory of its own: the tensors it wraps are counted instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.bytes = 0
        self.peak = 0
        self.window_peak = 0  # the peak since the last ``read``

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.bytes -= self.live.pop(key)[1]

    def read(self) -> Tuple[int, int]:
        """An allocator view for ``bagualu2.enable(allocator=...)``: the bytes held now and the
        peak since the last call (then reset to what is held)."""
        self._sweep()
        now, peak = self.bytes, max(self.window_peak, self.bytes)
        self.window_peak = self.bytes
        return now, peak

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        # A view of an older storage (a weight's transpose) is not a new storage.
        inputs = {t.untyped_storage()._cdata for t in _plain_tensors((args, kwargs))}
        for t in _plain_tensors(out):
            storage = t.untyped_storage()
            if storage._cdata not in self.live and storage._cdata not in inputs:
                self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        self.window_peak = max(self.window_peak, self.bytes)
        return out


def _plain_tensors(tree: Any) -> List[torch.Tensor]:
    """The tensors in ``tree`` that own memory: a wrapper subclass (a functional collective's
    ``AsyncCollectiveTensor``, a ``DTensor``) has a storage with a size but no data, so it
    stands for the tensors it wraps."""
    out: List[torch.Tensor] = []
    stack = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
            stack.extend(x for x in inner if isinstance(x, torch.Tensor))
        else:
            out.append(t)
    return out


def allocation_peak(fn: Callable[[], Any]) -> Tuple[Any, int]:
    """``fn()`` and the most bytes that storages created during it held at once."""
    with AllocationMeter() as meter:
        out = fn()
    return out, meter.peak


def spike_logits(logits: torch.Tensor, expert: Optional[int], imbalance: float, top_k: int) -> torch.Tensor:
    """``logits`` (``[..., experts]``, a router's) with ``expert`` lifted above every other
    expert for just enough more tokens that it gets ``imbalance`` x the mean load of these
    tokens (to within one token; tokens that chose it already keep it): the engines' form of the
    reference model's ``routing_spike``, deterministic, so a recomputed router routes alike.
    ``expert=None`` lifts nothing through the same ops (an op's name in a plan is its place in
    its module's call, so a spiked micro-batch must not add ops)."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    tokens, experts = flat.shape
    target = 0 if expert is None else min(tokens, round(imbalance * tokens * top_k / experts))
    column = 0 if expert is None else expert
    chosen = flat.topk(top_k, dim=-1).indices.eq(column).any(dim=-1)
    extra = (~chosen).nonzero().flatten()[:max(0, target - int(chosen.sum()))]
    lift = torch.zeros_like(flat)
    lift[extra, column] = flat.max() - flat.min() + 1.0
    return logits + lift.view(logits.shape).to(logits.dtype)


# ---------------------------------------------------------------------------------------------
# Engines: the static options each offers, and one micro-batch of a model built with one
# ---------------------------------------------------------------------------------------------


class Run:
    """One model built for the head to head (a static option, or under bagualu2 as ``prov``)."""

    prov: Any = None

    def step(self, rank: int, trace: Trace, i: int) -> float:
        """One forward + backward of micro-batch ``i`` (spiked as the trace says); the loss."""
        raise NotImplementedError

    def close(self) -> None:
        if self.prov is not None:
            self.prov.disable()
        self.prov = None


class Engine:
    """What the head to head needs from an engine: its grid of static options (name -> option),
    the name of the one that recomputes every block, models built with an option (``None``:
    keep everything) or under bagualu2, and the options it leaves out, with why."""

    name = ""
    full = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = getattr(MoEConfig, args.config)(num_layers=args.layers)

    def grid(self) -> Dict[str, Any]:
        raise NotImplementedError

    def left_out(self) -> Dict[str, str]:
        return {}

    def static(self, option: Any) -> Run:
        raise NotImplementedError

    def provisioned(self, policy: str, budget: Optional[int], allocator: Any = None) -> Run:
        """A model under bagualu2 with ``policy`` and ``budget`` (``allocator``: its view, as
        ``enable`` takes it)."""
        raise NotImplementedError


@dataclass
class Config:
    """A named run, built when first needed."""

    name: str
    build: Callable[[], Run]
    run: Optional[Run] = None

    def ready(self) -> "Config":
        if self.run is None:
            self.run = self.build()
        return self

    @property
    def prov(self) -> Any:
        return self.run.prov

    def step(self, rank: int, trace: Trace, i: int) -> float:
        return self.run.step(rank, trace, i)

    def close(self) -> None:
        if self.run is not None:
            self.run.close()
        self.run = None


def engine(name: str, args: argparse.Namespace) -> Engine:
    """The engine called ``name`` (its module imported only when asked for)."""
    if name == "torchtitan":
        from versus_static_torchtitan import TorchtitanEngine
        return TorchtitanEngine(args)
    if name == "megatron":
        from versus_static_megatron import MegatronEngine
        return MegatronEngine(args)
    from versus_static_pytorch import PyTorchEngine
    return PyTorchEngine(args)


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


def _all_min(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _timed_step(cfg: Config, rank: int, trace: Trace, i: int,
                meter: Optional[AllocationMeter] = None) -> Tuple[float, float]:
    """(slowest rank's seconds, loss) of micro-batch ``i``, under ``meter`` when given (its
    ``peak`` then that micro-batch's)."""
    dist.barrier()
    t0 = time.perf_counter()
    if meter is None:
        loss = cfg.step(rank, trace, i)
    else:
        meter.peak = meter.bytes
        with meter:
            loss = cfg.step(rank, trace, i)
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), loss


def _peaks(cfg: Config, rank: int, trace: Trace, which: Sequence[int]) -> Dict[int, int]:
    out = {}
    for i in which:
        _, out[i] = allocation_peak(lambda: cfg.step(rank, trace, i))
    return out


def _rank_main(rank: int, world: int, args: argparse.Namespace, engine_name: str, out_path: str) -> None:
    eng = engine(engine_name, args)
    trace = Trace.make(args.micro_batches, args.spike_rate, args.imbalance, eng.cfg.num_experts, args.warmup,
                       paper=args.regime == "paper")
    probes = trace.probes()
    calm = [i for i in range(args.warmup) if i not in trace.spikes]
    grid = eng.grid()

    def static(name: Optional[str]) -> Config:
        return Config(name or "keep_all", functools.partial(eng.static, grid[name] if name else None))

    def provisioned(policy: str, budget: Optional[int], allocator: Any = None) -> Config:
        return Config(policy, functools.partial(eng.provisioned, policy, budget, allocator))

    row: Dict[str, Any] = {"engine": eng.name, "rank": rank, "grid": list(grid), "left_out": eng.left_out()}

    # The budget: headroom above the largest calm peak of keeping everything.
    keep = static(None).ready()
    keep.step(rank, trace, calm[0])  # first-call allocations out of the measurement
    calm_peak = max(_peaks(keep, rank, trace, calm).values())
    budget = int(calm_peak * (1.0 + args.headroom))
    keep_probe = _peaks(keep, rank, trace, probes)
    # Keep-all's losses on the probes: every static configuration must compute the same.
    keep_losses = {i: keep.step(rank, trace, i) for i in probes}
    row.update(calm_peak_bytes=calm_peak, budget_bytes=budget, probes=probes)
    keep.close()

    # 1. Every static configuration on the probes; survivors hold the budget on every rank.
    static_peaks: Dict[str, Dict[int, int]] = {}
    probe_losses_equal: Dict[str, bool] = {}
    survivors: List[str] = []
    for name in grid:
        c = static(name).ready()
        c.step(rank, trace, calm[0])
        static_peaks[name] = _peaks(c, rank, trace, probes)
        probe_losses_equal[name] = all(c.step(rank, trace, i) == keep_losses[i] for i in probes)
        c.close()
        if _all_min(max(static_peaks[name].values()) <= budget):
            survivors.append(name)
    row["static_peaks"] = static_peaks
    row["probe_losses_equal"] = probe_losses_equal
    row["keep_all_probe_peaks"] = keep_probe
    row["survivors"] = survivors

    # 2. The fastest survivor on calm micro-batches, interleaved.
    calm_s: Dict[str, List[float]] = {name: [] for name in survivors}
    configs = {name: static(name).ready() for name in survivors}
    for r in range(args.pick_rounds):
        for k in range(len(survivors)):
            name = survivors[(r + k) % len(survivors)]
            calm_s[name].append(_timed_step(configs[name], rank, trace, calm[r % len(calm)])[0])
    for c in configs.values():
        c.close()
    fastest = min(survivors, key=lambda n: statistics.median(calm_s[n])) if survivors else None
    row["pick_seconds"] = {n: statistics.median(v) for n, v in calm_s.items()}
    row["fastest_static"] = fastest

    # 3. The whole trace, interleaved: fastest survivor, adaptive, keep-all, full recompute, each
    # under its own meter (adaptive reads its own as its allocator view).
    meters: Dict[str, AllocationMeter] = {n: AllocationMeter() for n in ("adaptive", "keep_all", "recompute_all",
                                                                          "static")}
    contenders: Dict[str, Config] = {
        "adaptive": provisioned("adaptive", budget, meters["adaptive"].read),
        "keep_all": static(None),
        "recompute_all": static(eng.full),
    }
    if fastest is not None:
        contenders["static"] = static(fastest)
    for c in contenders.values():
        c.ready()
    # Adaptive meets the probes the static configurations were chosen on, once, before the trace
    # (a calm micro-batch first): it learns from them as from any micro-batch; nothing is tuned.
    for i in [calm[0], *probes]:
        _timed_step(contenders["adaptive"], rank, trace, i, meters["adaptive"])
    seconds: Dict[str, List[float]] = {n: [] for n in contenders}
    losses: Dict[str, List[float]] = {n: [] for n in contenders}
    peaks: Dict[str, List[int]] = {n: [] for n in contenders}
    excess: List[int] = []
    traced: List[bool] = []
    released: List[Dict[str, int]] = []  # adaptive's bytes kept, offloaded and recomputed
    names = list(contenders)
    for i in range(trace.micro_batches):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            s, loss = _timed_step(contenders[name], rank, trace, i, meters[name])
            seconds[name].append(s)
            losses[name].append(loss)
            peaks[name].append(meters[name].peak)
            if name == "adaptive":  # what it left outside its activations, and whether it traced
                prov = contenders[name].prov
                excess.append(prov.report()["excess_bytes"])
                traced.append(prov.telemetry.micro_batches[-1].traced)
                released.append(dict(prov.telemetry.micro_batches[-1].bytes_by_choice))
    row["seconds"] = seconds
    row["trace_peaks"] = peaks
    row["adaptive_excess"], row["adaptive_traced"], row["adaptive_released"] = excess, traced, released
    row["losses_equal"] = {n: losses[n] == losses["keep_all"] for n in names}

    # Violations of the two that claim to hold the budget, in the run that was timed.
    metered = ["adaptive"] + (["static"] if fastest is not None else [])
    row["over_budget"] = {n: [i for i, p in enumerate(peaks[n]) if p > budget] for n in metered}
    row["trace_peak_bytes"] = {n: max(peaks[n]) for n in names}
    report = contenders["adaptive"].prov.report()
    row["adaptive_report"] = {k: report[k] for k in ("decisions", "traced_micro_batches", "violations",
                                                       "decision_latency_us", "memory_violations",
                                                       "memory_peak_bytes", "excess_bytes")}
    for c in contenders.values():
        c.close()

    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _segments(values: Sequence[float], n: int) -> List[float]:
    """Sums of ``n`` consecutive parts of ``values`` (the last takes the remainder)."""
    size = max(1, len(values) // n)
    cuts = list(range(0, len(values), size))[:n]
    return [sum(values[a:b]) for a, b in zip(cuts, cuts[1:] + [len(values)])]


def summarize(ranks: List[Dict[str, Any]], segments: int, regime: str = "default") -> Dict[str, Any]:
    """Paired ratios (each run's time over adaptive's, per segment of the trace), violations
    across ranks, and whether every run's losses equal keep-all's."""
    r0 = ranks[0]
    seconds = r0["seconds"]  # the slowest rank's seconds: the same on every rank
    ref = _segments(seconds["adaptive"], segments)
    rows: Dict[str, Any] = {}
    for name, values in seconds.items():
        ratios = sorted(s / a for s, a in zip(_segments(values, segments), ref))
        # Paired per micro-batch too (adjacent in time, in one round): robust to the stalls a
        # busy machine puts into a few micro-batches, which a segment's sum carries whole.
        each = statistics.quantiles([s / a for s, a in zip(values, seconds["adaptive"])], n=4)
        metered = name in r0["over_budget"]
        rows[name] = {
            "config": r0["fastest_static"] if name == "static" else name,
            "total_s": sum(values),
            "speedup_median": statistics.median(ratios),
            "speedup_range": [ratios[0], ratios[-1]],
            "segments": len(ratios),
            "per_micro_batch_median": each[1],
            "per_micro_batch_quartiles": [each[0], each[2]],
            # micro-batches over the budget on any rank (metered over the whole trace), or, for
            # keep_all, probes over it
            "violations": len(set().union(*(r["over_budget"][name] for r in ranks))) if metered else None,
            "losses_equal_keep_all": all(r["losses_equal"][name] for r in ranks),
        }
    keep_over = max(max(r["keep_all_probe_peaks"].values()) / r["budget_bytes"] for r in ranks)
    rows["keep_all"]["probe_peak_over_budget"] = keep_over
    rows["keep_all"]["violations"] = sum(
        1 for i in r0["probes"] if any(r["keep_all_probe_peaks"][str(i)] > r["budget_bytes"] for r in ranks))
    return {"engine": r0["engine"], "regime": regime, "fastest_static": r0["fastest_static"], "survivors": r0["survivors"],
            "grid": r0["grid"], "left_out": r0["left_out"], "rows": rows,
            # every static configuration's losses at the probes equal keep-all's, on every rank
            "probe_losses_equal": {n: all(r["probe_losses_equal"][n] for r in ranks) for n in r0["grid"]}}


def closing_line(summary: Dict[str, Any]) -> str:
    engine, rows = summary["engine"], summary["rows"]
    adaptive = rows["adaptive"]
    static = rows.get("static")
    if static is None:
        return (f"{engine} {summary['regime']} oracle: no static configuration held the budget; adaptive held it "
                f"with {adaptive['violations']} violations")
    lo, hi = static["speedup_range"]
    verdict = "a tie within the spread" if lo <= 1.0 <= hi else ("faster" if lo > 1.0 else "slower")
    return (f"{engine} {summary['regime']} oracle: adaptive {static['speedup_median']:.2f}x over {static['config']} "
            f"(the fastest static configuration that held the budget), {adaptive['violations']} violations "
            f"(range {lo:.2f}-{hi:.2f} over {static['segments']} segments: {verdict}; "
            f"per micro-batch median {static['per_micro_batch_median']:.2f}x)")


def print_engine(summary: Dict[str, Any], ranks: List[Dict[str, Any]]) -> None:
    print(f"\n{summary['engine']}: per-rank budget " + ", ".join(
        f"rank {r['rank']} {r['budget_bytes'] / 2**20:.2f} MiB (calm keep-all peak "
        f"{r['calm_peak_bytes'] / 2**20:.2f} MiB; adaptive left "
        f"{r['adaptive_report']['excess_bytes'] / 2**20:.2f} MiB for what lies outside its activations at the "
        f"end, learned)" for r in ranks))
    print(f"grid ({len(summary['grid'])} static configurations): {'; '.join(summary['grid'])}")
    for option, why in summary["left_out"].items():
        print(f"left out: {option}: {why}")
    differ = [n for n, equal in summary["probe_losses_equal"].items() if not equal]
    if differ:
        print(f"losses differ from keeping everything at the probes: {'; '.join(differ)}")
    print(f"held the budget on every rank at the calm micro-batch and the spikes: "
          f"{'; '.join(summary['survivors']) or 'none'}")
    head = (f"{'run':<15}{'configuration':<38}{'time s':>8}{'time / adaptive [range]':>26}"
            f"{'per micro-batch [IQR]':>24}{'violations':>12}{'losses':>8}")
    print(head)
    print("-" * len(head))
    for name in ("adaptive", "static", "keep_all", "recompute_all"):
        row = summary["rows"].get(name)
        if row is None:
            continue
        lo, hi = row["speedup_range"]
        ratio = "1.00" if name == "adaptive" else f"{row['speedup_median']:.2f}x [{lo:.2f}, {hi:.2f}]"
        q1, q3 = row["per_micro_batch_quartiles"]
        each = "1.00" if name == "adaptive" else f"{row['per_micro_batch_median']:.2f}x [{q1:.2f}, {q3:.2f}]"
        viol = "-" if row["violations"] is None else str(row["violations"])
        if name == "keep_all":
            viol += " (probes)"
        print(f"{name:<15}{row['config'][:37]:<38}{row['total_s']:>8.2f}{ratio:>26}{each:>24}{viol:>12}"
              f"{'equal' if row['losses_equal_keep_all'] else 'DIFFER':>8}")


# The environment an engine's ranks run in, for every configuration alike. Megatron's
# ``jit_fuser`` is ``torch.compile``: a compiled function called inside a provisioned forward
# makes dynamo trace into bagualu2's dispatch mode and recompile until its limit, which would
# charge adaptive for compiles the static configurations pay once (Megatron's tests run so too).
ENVIRONMENT: Dict[str, Dict[str, str]] = {"megatron": {"TORCHDYNAMO_DISABLE": "1"}}


def run_engine(engine: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    env = ENVIRONMENT.get(engine, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned ranks
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ranks.json")
            launch(_rank_main, args.world, args, engine, path, timeout_s=args.timeout)
            with open(path) as f:
                return json.load(f)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    ap.add_argument("--world", type=int, default=2, help="expert-parallel ranks (gloo processes)")
    ap.add_argument("--config", default="small", choices=("tiny", "small", "bench"))
    ap.add_argument("--layers", type=int, default=3, help="transformer blocks")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8, help="calm micro-batches first (adaptive profiles, calibrates)")
    ap.add_argument("--spike-rate", type=float, default=0.03)
    ap.add_argument("--imbalance", type=float, default=2.6)
    ap.add_argument("--regime", default="default", choices=sorted(REGIMES),
                    help="default: the trace above, the budget 5%% above the calm keep-all peak; tight: 35%% "
                         "below it (no single block's checkpoint is enough); paper: the BaGuaLu-2 paper's load "
                         "(every micro-batch up to 1.2x, 3%% spikes up to --imbalance), 5%% above a balanced "
                         "micro-batch's keep-all peak")
    ap.add_argument("--releases", default="operators", choices=("operators", "reruns"),
                    help="how adaptive releases (enable's releases=)")
    ap.add_argument("--headroom", type=float, default=None,
                    help="budget above the calm keep-all peak (default: the regime's)")
    ap.add_argument("--pick-rounds", type=int, default=4, help="calm rounds that pick the fastest survivor")
    ap.add_argument("--segments", type=int, default=4, help="parts of the trace the paired ratios come from")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--quick", action="store_true", help="a short trace (the slow lane's form)")
    ap.add_argument("--out", default="versus_static.json")
    args = ap.parse_args(argv)
    if args.headroom is None:
        args.headroom = REGIMES[args.regime]
    if args.quick:
        args.config, args.layers, args.batch, args.seq = "tiny", 2, 2, 32
        args.micro_batches, args.warmup, args.pick_rounds, args.segments = 16, 6, 2, 2
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    results: Dict[str, Any] = {"args": vars(args), "machine": platform.platform(), "torch": torch.__version__,
                               "engines": {}}
    lines = []
    for engine in engines:
        ranks = run_engine(engine, args)
        summary = summarize(ranks, args.segments, args.regime)
        results["engines"][engine] = {"summary": summary, "ranks": ranks}
        print_engine(summary, ranks)
        lines.append(closing_line(summary))
    print()
    for line in lines:
        print(line)
    results["lines"] = lines
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
