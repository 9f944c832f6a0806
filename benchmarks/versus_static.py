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
``AllocationMeter``: a counting CPU allocator (``bagualu2._saves``, csrc/meter/) charges every
storage allocated from the start of a micro-batch's forward to the end of its backward to the
configuration running, while it lives (the stand-in on this machine for
``torch.cuda.max_memory_allocated``: activations, temporaries and gradients). It costs an atomic
add per allocation and nothing per op, so the timings are those of the configurations alone.
The per-rank budget is ``--headroom`` above the largest calm micro-batch's peak without any
activation option (keep everything). ``adaptive`` gets that budget whole, and the meter as its
allocator view (``enable(allocator=meter.read)``: the bytes the meter counts now and its peak since
the last reading), as a GPU run gets ``allocator="cuda"``: it learns, micro-batch by micro-batch,
what lies outside its activations at the peak (the forward's working set, the gradients) and how
that grows with the routed load, and holds its activations to what that leaves. Nothing is tuned
for it; it is judged by the meter like everything else.

For each engine the script:

1. measures every static configuration of its grid, and keeping everything (a user's first
   option), on the calm micro-batch and on one spike aimed at each rank, and records where each
   stays within the budget on every rank (``adaptive`` runs the same micro-batches once before
   the trace, and learns from them what it learns from any);
2. times the candidates on a few calm micro-batches, interleaved, and picks the fastest (below);
3. runs the whole trace once per configuration (the picks, ``adaptive``, keep-all and full
   recompute), one micro-batch of each per round in a rotating order, timing each micro-batch
   (the slowest rank's time, the ranks aligned by a barrier), each configuration under its own
   meter (``adaptive`` reads its own as its allocator view), and counts the
   micro-batches over the budget on any rank (violations) in that same run.

Two protocols pick the static configuration (``--protocol``; both by default):

* ``oracle``: the fastest configuration that held the calm micro-batch and the first spike aimed
  at each rank: it knows the spikes in advance, which no user does.
* ``tuned``: what a user does: the fastest configuration that held the first calm micro-batches
  (those the pick times it on, no spike seen; their peaks measured like the probes'), run
  through the trace. A micro-batch where it crosses the budget on some rank is an
  out-of-memory crash: the user restarts with the fastest configuration that held those calm
  micro-batches and every micro-batch that crashed so far, the crashing one included (a user
  re-tunes on what failed; the micro-batches that ran fine gave no sign, and the new
  configuration is judged on them by the meter as the trace goes on: it may crash again). Where
  a configuration's peak at a crashing micro-batch was not measured yet (it was no probe), it is
  measured then, out of every timing; the first spike aimed at each rank was a probe, so most
  re-picks measure nothing new. The new configuration reruns the crashing micro-batch in the
  timed run (the crashed attempt is not charged: out of memory strikes before the step ends), and
  each crash is charged a restart, every part of it measured here, per engine: a new process
  (python importing torch and the engine's modules, timed in a fresh process before the ranks
  start; the least of two), building the model of the new configuration (each configuration's
  build is timed when step 1 builds it), saving and loading a checkpoint with the engine's own
  checkpointing (torch.save / torch.load of the state_dict for pytorch and Megatron; DCP for
  torchtitan, torch.save where DCP fails, as the JSON says), and redoing the micro-batches since
  the last checkpoint (``--checkpoint-every``: a crash at micro-batch ``i`` redoes ``i`` mod that
  many) at the new configuration's own median seconds per micro-batch in the trace. The charge
  is added at the crashing micro-batch, so the paired segments carry it; the headline ratio under
  ``tuned`` is total time over total time. Nothing charges a process group's set-up or a job
  scheduler's queue: a restart costs a user more than this.

The pick is robust: a configuration that recomputes a superset of what another recomputes
(``Engine.recomputes_superset``: checkpointing blocks 0 and 1 over block 0, full recompute over
any, a selective set over its subsets) is never picked over it when both held, however the
timings of the two fall. The oracle alone times only the undominated survivors; the tuned
protocol times every configuration that held the first calm micro-batches too, since a re-pick
after a crash chooses among those that held what crashed, where one dominated before may no
longer be.

Each micro-batch of the trace is a ``spike`` (one of the trace's spikes), ``after a spike`` (one of
the ``AFTER_SPIKE`` micro-batches that follow a spike) or ``calm``, and ``adaptive``'s seconds over
keep-all's, the oracle pick's and the tuned run's (its restarts charged) are reported per kind:
the median of the per-micro-batch ratios and their quartiles.

The goals, per engine in the JSON (``goals``; each with ``met`` and ``by``, the signed margin,
at least 0 where met): no violations; under the oracle, a captured share of the ceiling
(static/adaptive - 1) / (static/keep_all - 1) of at least 0.8; adaptive at least 1.14x over the
best static configuration in the tight regime, and over the tuned run.

Speedups are paired: the trace is cut into ``--segments`` consecutive parts and each part's time
of a static run is divided by ``adaptive``'s over the same micro-batches; the table gives the
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
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from bagualu2 import _saves
from bagualu2.models import MoEConfig

# The tests' multi-process harness (spawned gloo ranks on 127.0.0.1, a free port, hard timeouts);
# the spawned ranks find it on the sys.path they inherit.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from pipeline_harness import launch  # noqa: E402

SEED = 0
ENGINES = ("pytorch", "torchtitan", "megatron")
REGIMES = {"default": 0.05, "tight": -0.35, "paper": 0.05}  # the budget above the calm keep-all peak
PROTOCOLS = ("oracle", "tuned")
KEEP = "keep_all"  # the option every engine has: no activation option at all
# Micro-batches after a spike reported as their own kind: the one right after a spike may be
# traced anew (a routing not seen before) and the next is the first planned with what the spike
# taught adaptive about the memory outside its activations.
AFTER_SPIKE = 2

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


class AllocationMeter:
    """What the CPU storages allocated while it is on hold now, and their high-water mark: an
    account of ``bagualu2._saves``' CPU allocation meter (csrc/meter/cpu_meter.h), a counting
    allocator that is torch's CPU allocator once any meter exists.

    It counts as a GPU's caching allocator does, at the allocator: every storage allocated while
    the meter is on (``with meter:``) is charged to it, whatever allocates it (an aten op, a
    backward pass rebuilding what it saved, a process group's thread, bagualu2's runtime), from
    its allocation until it dies, whenever that is and whichever meter is on then. What the
    allocator does not hand out is not counted: bagualu2's pinned host arena, which its copy
    engine fills (host memory). A wrapper subclass (a functional collective's result, a
    ``DTensor``) allocates nothing of its own; the tensors it wraps are counted. Counting costs
    an atomic add per allocation and nothing per op, so it leaves each configuration's speed as
    it is (a meter written as a dispatch mode costs every op a Python call, a tax heaviest on
    whatever issues the most ops).
    """

    _taken: Set[int] = set()  # accounts of the meters alive

    def __init__(self) -> None:
        _saves.meter_install()
        # An account no live meter holds and none of whose storages is alive: a fresh one.
        free = [a for a in range(1, _METER_ACCOUNTS) if a not in self._taken and _saves.meter_bytes(a) == 0]
        if not free:
            raise RuntimeError(f"every one of the CPU meter's {_METER_ACCOUNTS - 1} accounts is taken")
        self.account = free[0]
        self._taken.add(self.account)
        weakref.finalize(self, self._taken.discard, self.account)
        self.start()
        _saves.meter_reset_mark(self.account, _WINDOW)
        self._outer: List[int] = []

    def __enter__(self) -> "AllocationMeter":
        self._outer.append(_saves.meter_charge_to(self.account))
        return self

    def __exit__(self, *exc: Any) -> None:
        _saves.meter_charge_to(self._outer.pop())

    @property
    def bytes(self) -> int:
        """The bytes of its storages alive now."""
        return _saves.meter_bytes(self.account)

    @property
    def peak(self) -> int:
        """The most they held at once since ``start``."""
        return _saves.meter_high_water(self.account, _STEP)

    def start(self) -> None:
        """Begin a new ``peak`` (at what is held now)."""
        _saves.meter_reset_mark(self.account, _STEP)

    def read(self) -> Tuple[int, int]:
        """An allocator view for ``bagualu2.enable(allocator=...)``: the bytes held now and the
        peak since the last call (then reset to what is held)."""
        now = self.bytes
        return now, max(now, _saves.meter_reset_mark(self.account, _WINDOW))


_METER_ACCOUNTS = 64  # the meter's accounts (csrc/meter/cpu_meter.h); 0 is charged outside every meter
_STEP, _WINDOW = 0, 1  # an account's two high-water marks: the step's peak, the allocator view's window


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
    keep everything) or under bagualu2, the options it leaves out, with why, which option
    recomputes a superset of which, and what a restart costs its user (the modules a fresh
    process imports, its checkpointing)."""

    name = ""
    full = ""
    # What a restarted process imports before it can build the model (timed in a fresh process).
    process_modules: Tuple[str, ...] = ()
    checkpointing = "torch.save / torch.load of the model's state_dict, one file per rank"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = getattr(MoEConfig, args.config)(num_layers=args.layers)

    def grid(self) -> Dict[str, Any]:
        raise NotImplementedError

    def left_out(self) -> Dict[str, str]:
        return {}

    def recomputes_superset(self, a: str, b: str) -> bool:
        """Whether option ``a`` recomputes everything ``b`` recomputes and more (names of the
        grid, or ``KEEP``, which recomputes nothing). A strict partial order: such an ``a`` is
        never picked over ``b`` when both hold the budget, however the timings fall. Every
        engine's full recompute recomputes every op of every block."""
        return a != b and (b == KEEP or a == self.full)

    def releases_option(self) -> Dict[str, str]:
        """enable's ``releases=`` when ``--releases`` names one; else nothing (the library's default)."""
        releases = getattr(self.args, "releases", None)
        return {} if releases is None else {"releases": releases}

    def save_checkpoint(self, run: "Run", directory: str, rank: int) -> None:
        torch.save(run.model.state_dict(), os.path.join(directory, f"rank{rank}.pt"))

    def load_checkpoint(self, run: "Run", directory: str, rank: int) -> None:
        # The file this rank just wrote; an engine's state_dict may hold non-tensor extra state.
        run.model.load_state_dict(torch.load(os.path.join(directory, f"rank{rank}.pt"), weights_only=False))

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
        meter.start()
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


def _timed(fn: Callable[[], Any]) -> float:
    """The slowest rank's seconds for ``fn()`` (the ranks aligned by a barrier first)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def undominated(names: Sequence[str], superset: Callable[[str, str], bool]) -> List[str]:
    """``names`` less every one that recomputes a superset of another's (in their order)."""
    return [a for a in names if not any(superset(a, b) for b in names)]


def fastest(names: Sequence[str], superset: Callable[[str, str], bool],
            seconds: Dict[str, float]) -> Optional[str]:
    """The robust pick: the fastest of ``names`` by ``seconds`` once the dominated are dropped
    (a configuration that recomputes more than another that also held is never picked, however
    close the timings)."""
    kept = undominated(names, superset)
    return min(kept, key=lambda n: seconds[n]) if kept else None


def _rank_main(rank: int, world: int, args: argparse.Namespace, engine_name: str, out_path: str) -> None:
    eng = engine(engine_name, args)
    trace = Trace.make(args.micro_batches, args.spike_rate, args.imbalance, eng.cfg.num_experts, args.warmup,
                       paper=args.regime == "paper")
    probes = trace.probes()
    calm = [i for i in range(args.warmup) if i not in trace.spikes]
    grid = eng.grid()
    protocols = PROTOCOLS if args.protocol == "both" else (args.protocol,)

    def static(name: Optional[str]) -> Config:
        option = None if name in (None, KEEP) else grid[name]
        return Config(name or KEEP, functools.partial(eng.static, option))

    def provisioned(policy: str, budget: Optional[int], allocator: Any = None) -> Config:
        return Config(policy, functools.partial(eng.provisioned, policy, budget, allocator))

    row: Dict[str, Any] = {"engine": eng.name, "rank": rank, "grid": list(grid), "left_out": eng.left_out(),
                           "spikes": sorted(trace.spikes), "protocols": list(protocols)}

    # The budget: headroom above the largest calm peak of keeping everything.
    keep = static(None)
    setup_s = {KEEP: _timed(keep.ready)}  # building the model: what a restart redoes
    keep.step(rank, trace, calm[0])  # first-call allocations out of the measurement
    calm_peaks = _peaks(keep, rank, trace, calm)
    calm_peak = max(calm_peaks.values())
    budget = int(calm_peak * (1.0 + args.headroom))
    keep_probe = _peaks(keep, rank, trace, probes)
    # Keep-all's losses on the probes: every static configuration must compute the same.
    keep_losses = {i: keep.step(rank, trace, i) for i in probes}
    row.update(calm_peak_bytes=calm_peak, budget_bytes=budget, probes=probes)
    if "tuned" in protocols:
        # What a restart reloads: the engine's own checkpoint of this model, saved and loaded.
        directory = os.path.join(os.path.dirname(out_path), "checkpoint")
        os.makedirs(directory, exist_ok=True)
        save_s = _timed(lambda: eng.save_checkpoint(keep.run, directory, rank))
        load_s = _timed(lambda: eng.load_checkpoint(keep.run, directory, rank))
        row["checkpoint"] = {"how": eng.checkpointing, "save_s": save_s, "load_s": load_s}
    keep.close()

    # 1. Every static configuration on the probes (keeping everything is one: a user's first);
    # whether each holds the budget on every rank at each micro-batch, agreed by every rank.
    # The tuned protocol's user watched memory on the calm micro-batches the pick times.
    tune_on = calm[:max(1, min(args.pick_rounds, len(calm)))] if "tuned" in protocols else []
    measure = probes + [i for i in tune_on if i not in probes]
    static_peaks: Dict[str, Dict[int, int]] = {KEEP: {**{i: calm_peaks[i] for i in tune_on}, **keep_probe}}
    probe_losses_equal: Dict[str, bool] = {}
    for name in grid:
        c = static(name)
        setup_s[name] = _timed(c.ready)
        c.step(rank, trace, calm[0])
        static_peaks[name] = _peaks(c, rank, trace, measure)
        probe_losses_equal[name] = all(c.step(rank, trace, i) == keep_losses[i] for i in probes)
        c.close()
    held: Dict[str, Dict[int, bool]] = {n: {i: _all_min(p <= budget) for i, p in peaks.items()}
                                        for n, peaks in static_peaks.items()}

    def holds(name: str, i: int) -> bool:
        """Whether ``name`` held the budget at micro-batch ``i`` on every rank (measured now if
        it was not: a model of it built, warmed on a calm micro-batch, out of every timing)."""
        if i not in held[name]:
            c = static(name).ready()
            c.step(rank, trace, calm[0])
            static_peaks[name].update(_peaks(c, rank, trace, [i]))
            c.close()
            held[name][i] = _all_min(static_peaks[name][i] <= budget)
        return held[name][i]

    candidates = [KEEP, *grid]
    survivors = [n for n in candidates if all(holds(n, i) for i in probes)]  # the oracle's
    calm_holders = [n for n in candidates if all(holds(n, i) for i in tune_on)]  # the tuned protocol's
    row["static_peaks"] = static_peaks
    row["probe_losses_equal"] = probe_losses_equal
    row["keep_all_probe_peaks"] = keep_probe
    row["survivors"] = survivors
    row["survivors_undominated"] = undominated(survivors, eng.recomputes_superset)
    row["calm_holders"] = calm_holders
    row["tuned_on"] = tune_on
    row["setup_s"] = setup_s

    # 2. The candidates on calm micro-batches, interleaved. The oracle needs only the survivors
    # that recompute no superset of another survivor's; the tuned protocol times every
    # configuration that held the first calm micro-batches too (a survivor may not have: they are
    # no probes), since after a crash it re-picks among those that held the crashing micro-batch
    # as well, and one dominated now may be the fastest undominated then.
    timed = list(row["survivors_undominated"])
    if "tuned" in protocols:
        timed += [n for n in calm_holders if n not in timed]
    calm_s: Dict[str, List[float]] = {name: [] for name in timed}
    configs = {name: static(name).ready() for name in timed}
    for r in range(args.pick_rounds):
        for k in range(len(timed)):
            name = timed[(r + k) % len(timed)]
            calm_s[name].append(_timed_step(configs[name], rank, trace, calm[r % len(calm)])[0])
    for c in configs.values():
        c.close()
    pick_s = {n: statistics.median(v) for n, v in calm_s.items()}
    best = fastest(survivors, eng.recomputes_superset, pick_s)
    row["pick_seconds"] = pick_s
    row["fastest_static"] = best if "oracle" in protocols else None
    row["tuned_start"] = fastest(calm_holders, eng.recomputes_superset, pick_s) if "tuned" in protocols else None

    # 3. The whole trace, interleaved: the picks, adaptive, keep-all, full recompute, each under
    # its own meter (adaptive reads its own as its allocator view).
    meters: Dict[str, AllocationMeter] = {n: AllocationMeter() for n in ("adaptive", "keep_all", "recompute_all",
                                                                          "static", "tuned")}
    contenders: Dict[str, Config] = {
        "adaptive": provisioned("adaptive", budget, meters["adaptive"].read),
        "keep_all": static(None),
        "recompute_all": static(eng.full),
    }
    if row["fastest_static"] is not None:
        contenders["static"] = static(best)
    if row["tuned_start"] is not None:
        contenders["tuned"] = static(row["tuned_start"])
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
    # The tuned run: the configuration in effect at each micro-batch, its crashes (over the
    # budget on some rank: out of memory), and where it gave up (nothing held what crashed).
    tuned: Dict[str, Any] = {"start": row["tuned_start"], "config_at": [], "crashes": [], "gave_up_at": None}
    names = list(contenders)
    for i in range(trace.micro_batches):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            if name == "tuned":
                if tuned["gave_up_at"] is None:
                    _tuned_step(tuned, contenders, meters, rank, trace, i, budget, calm_holders, holds,
                                lambda ns: fastest(ns, eng.recomputes_superset, pick_s), static,
                                seconds, losses, peaks)
                continue
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
    n_tuned = len(losses.get("tuned", []))  # short where it gave up
    row["losses_equal"] = {n: losses[n] == losses["keep_all"][:len(losses[n])] for n in names}
    if "tuned" in contenders:
        row["tuned"] = tuned
        row["losses_equal"]["tuned"] = losses["tuned"] == losses["keep_all"][:n_tuned]

    # Violations of the runs that claim to hold the budget, in the run that was timed (the tuned
    # run's are its crashes: each was restarted from, and the micro-batch rerun).
    metered = ["adaptive"] + (["static"] if "static" in contenders else [])
    row["over_budget"] = {n: [i for i, p in enumerate(peaks[n]) if p > budget] for n in metered}
    if "tuned" in contenders:
        row["over_budget"]["tuned"] = sorted({c["at"] for c in tuned["crashes"]})
    row["trace_peak_bytes"] = {n: max(peaks[n]) for n in names if peaks[n]}
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


def _tuned_step(tuned: Dict[str, Any], contenders: Dict[str, Config], meters: Dict[str, AllocationMeter],
                rank: int, trace: Trace, i: int, budget: int, calm_holders: Sequence[str],
                holds: Callable[[str, int], bool], pick: Callable[[Sequence[str]], Optional[str]],
                static: Callable[[Optional[str]], Config], seconds: Dict[str, List[float]],
                losses: Dict[str, List[float]], peaks: Dict[str, List[int]]) -> None:
    """Micro-batch ``i`` of the tuned run. Where it crosses the budget on some rank it crashes:
    the user restarts with the fastest configuration (undominated) among those that held the
    calm micro-batches it was tuned on and every micro-batch that crashed so far (this one
    included), and reruns it; the restart's cost is charged in the summary, from what was
    measured. The crashed attempt is not charged (out of memory strikes before the step ends)."""
    while True:
        current = contenders["tuned"]
        s, loss = _timed_step(current, rank, trace, i, meters["tuned"])
        if _all_min(meters["tuned"].peak <= budget):
            break
        tuned["crashes"].append({"at": i, "config": current.name, "restart_with": None, "attempt_s": s})
        crashed = [c["at"] for c in tuned["crashes"]]
        # What crashed in the trace did not hold there, whatever its peak measured alone said
        # (a probe's meter starts empty; the trace's carries what the last step left alive).
        failed = {c["config"] for c in tuned["crashes"]}
        nxt = pick([n for n in calm_holders if n not in failed and all(holds(n, j) for j in crashed)])
        tuned["crashes"][-1]["restart_with"] = nxt
        current.close()
        if nxt is None:
            tuned["gave_up_at"] = i
            return
        contenders["tuned"] = static(nxt).ready()
        meters["tuned"] = AllocationMeter()  # the new process's allocator, nothing of the old
    tuned["config_at"].append(contenders["tuned"].name)
    seconds["tuned"].append(s)
    losses["tuned"].append(loss)
    peaks["tuned"].append(meters["tuned"].peak)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _segments(values: Sequence[float], n: int) -> List[float]:
    """Sums of ``n`` consecutive parts of ``values`` (the last takes the remainder)."""
    size = max(1, len(values) // n)
    cuts = list(range(0, len(values), size))[:n]
    return [sum(values[a:b]) for a, b in zip(cuts, cuts[1:] + [len(values)])]


KINDS = ("calm", "spike", "after a spike")


def micro_batch_kinds(n: int, spikes: Sequence[int], after: int = AFTER_SPIKE) -> List[str]:
    """Each of ``n`` micro-batches' kind: ``spike`` (in the trace's spikes), ``after a spike``
    (one of the ``after`` micro-batches that follow one and are no spike themselves), or
    ``calm`` (the rest; in the paper regime these carry its mild skew)."""
    kinds = ["calm"] * n
    for i in spikes:
        for j in range(i + 1, min(n, i + 1 + after)):
            kinds[j] = "after a spike"
    for i in spikes:
        kinds[i] = "spike"
    return kinds


def _spread(values: Sequence[float]) -> Optional[Dict[str, Any]]:
    """Median, quartiles and count of ``values`` (None when empty; one value is its own quartiles)."""
    if not values:
        return None
    # Inclusive: the quartiles of a few values lie between them (the default extrapolates past them).
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "quartiles": [q[0], q[2]], "n": len(values)}


def per_kind(kinds: Sequence[str], cost: Sequence[float],
             other: Sequence[float]) -> Dict[str, Optional[Dict[str, Any]]]:
    """``cost / other`` per micro-batch (paired: one round), summarized per kind."""
    return {k: _spread([a / b for kind, a, b in zip(kinds, cost, other) if kind == k]) for k in KINDS}


def restart_charges(crashes: Sequence[Dict[str, Any]], config_at: Sequence[str], seconds: Sequence[float],
                    setup_s: Dict[str, float], process_s: float, save_s: float, load_s: float,
                    every: int) -> List[Dict[str, Any]]:
    """What each crash of the tuned run costs its user, from what was measured: a new process
    (``process_s``: python importing torch and the engine), building the model of the
    configuration restarted with (its ``setup_s``), writing the checkpoint restarted from and
    loading it, and redoing the micro-batches since that checkpoint (one every ``every``: a crash
    at micro-batch ``i`` redoes ``i % every``) at the restarted configuration's own median
    seconds per micro-batch in the trace (``seconds``, with ``config_at`` naming each one's
    configuration; where it ran none, the whole run's median). A crash nothing could restart
    from (``restart_with`` None) is not charged: the run ends there."""
    out = []
    for crash in crashes:
        new = crash["restart_with"]
        if new is None:
            continue
        own = [s for s, name in zip(seconds, config_at) if name == new] or list(seconds)
        redo = crash["at"] % every
        charge = {"at": crash["at"], "restart_with": new, "process_s": process_s, "setup_s": setup_s[new],
                  "checkpoint_s": save_s + load_s, "redo_micro_batches": redo,
                  "redo_s": redo * statistics.median(own) if own else 0.0}
        charge["total_s"] = charge["process_s"] + charge["setup_s"] + charge["checkpoint_s"] + charge["redo_s"]
        out.append(charge)
    return out


def _at_least(value: Optional[float], goal: float) -> Optional[Dict[str, Any]]:
    if value is None:
        return None
    return {"value": value, "goal": goal, "direction": "at least", "met": value >= goal, "by": value - goal}


def goals(regime: str, violations: int, captured_share: Optional[float], oracle_ratio: Optional[float],
          tuned_ratio: Optional[float]) -> Dict[str, Optional[Dict[str, Any]]]:
    """The head to head's goals and how far from each: ``by`` is the signed margin, at least 0
    where the goal is met (value - goal for a floor, goal - value for a ceiling); None where a
    goal does not apply (the tight goal outside the tight regime, a protocol not run)."""
    return {
        "violations": {"value": violations, "goal": 0, "direction": "at most", "met": violations <= 0,
                       "by": 0 - violations},
        # (static / adaptive - 1) / (static / keep_all - 1) under the oracle
        "captured_share_of_ceiling": _at_least(captured_share, 0.8),
        "over_best_static_tight": _at_least(oracle_ratio if regime == "tight" else None, 1.14),
        "over_tuned": _at_least(tuned_ratio, 1.14),
    }


def captured_share(static_over_adaptive: float, keep_over_adaptive: float) -> Optional[float]:
    """How much of the ceiling adaptive takes: (static/adaptive - 1) / (static/keep_all - 1),
    where keeping everything (were memory free) is the ceiling; None where the static pick is no
    slower than keeping everything (no ceiling to take)."""
    static_over_keep = static_over_adaptive / keep_over_adaptive
    if static_over_keep <= 1.0:
        return None
    return (static_over_adaptive - 1.0) / (static_over_keep - 1.0)


def summarize(ranks: List[Dict[str, Any]], segments: int, regime: str = "default", process_s: float = 0.0,
              checkpoint_every: int = 50) -> Dict[str, Any]:
    """Paired ratios (each run's time over adaptive's, per segment of the trace), violations
    across ranks, whether every run's losses equal keep-all's, the tuned run's restarts charged
    where it crashed (``process_s``: a new process's start, measured by the caller), adaptive's
    cost per kind of micro-batch, and the goals."""
    r0 = ranks[0]
    seconds = dict(r0["seconds"])  # the slowest rank's seconds: the same on every rank
    tuned = r0.get("tuned")
    charges: List[Dict[str, Any]] = []
    if tuned is not None and tuned["gave_up_at"] is None:
        ck = r0["checkpoint"]
        charges = restart_charges(tuned["crashes"], tuned["config_at"], seconds["tuned"], r0["setup_s"], process_s,
                                  ck["save_s"], ck["load_s"], checkpoint_every)
        charged = list(seconds["tuned"])
        for charge in charges:  # where it crashed, so the paired segments carry it
            charged[charge["at"]] += charge["total_s"]
        seconds["tuned"] = charged
    elif tuned is not None:
        seconds.pop("tuned")  # it did not finish the trace: no time to compare
    ref = _segments(seconds["adaptive"], segments)
    rows: Dict[str, Any] = {}
    for name, values in seconds.items():
        ratios = sorted(s / a for s, a in zip(_segments(values, segments), ref))
        # Paired per micro-batch too (adjacent in time, in one round): robust to the stalls a
        # busy machine puts into a few micro-batches, which a segment's sum carries whole.
        each = statistics.quantiles([s / a for s, a in zip(values, seconds["adaptive"])], n=4)
        metered = name in r0["over_budget"]
        rows[name] = {
            "config": {"static": r0["fastest_static"], "tuned": (tuned or {}).get("start")}.get(name, name),
            "total_s": sum(values),
            "speedup_median": statistics.median(ratios),
            "speedup_range": [ratios[0], ratios[-1]],
            "speedup_total": sum(values) / sum(seconds["adaptive"]),
            "segments": len(ratios),
            "per_micro_batch_median": each[1],
            "per_micro_batch_quartiles": [each[0], each[2]],
            # micro-batches over the budget on any rank (metered over the whole trace; the tuned
            # run's crashes), or, for keep_all, probes over it
            "violations": len(set().union(*(r["over_budget"][name] for r in ranks))) if metered else None,
            "losses_equal_keep_all": all(r["losses_equal"][name] for r in ranks),
        }
    keep_over = max(max(r["keep_all_probe_peaks"].values()) / r["budget_bytes"] for r in ranks)
    rows["keep_all"]["probe_peak_over_budget"] = keep_over
    rows["keep_all"]["violations"] = sum(
        1 for i in r0["probes"] if any(r["keep_all_probe_peaks"][str(i)] > r["budget_bytes"] for r in ranks))
    if tuned is not None:
        row = rows.setdefault("tuned", {"config": tuned["start"], "violations": len(tuned["crashes"])})
        row.update(crashes=tuned["crashes"], gave_up_at=tuned["gave_up_at"], restarts=charges,
                   restart_s=sum(c["total_s"] for c in charges), trace_s=sum(r0["seconds"]["tuned"]),
                   checkpointing=r0["checkpoint"]["how"], checkpoint_every=checkpoint_every,
                   restart_breakdown_s={part: sum(c[part] for c in charges)
                                        for part in ("process_s", "setup_s", "checkpoint_s", "redo_s")})

    # Adaptive's cost over the others per kind of micro-batch (its seconds over theirs, paired).
    kinds = micro_batch_kinds(len(seconds["adaptive"]), r0["spikes"])
    by_kind = {f"over {name}": per_kind(kinds, seconds["adaptive"], seconds[name])
               for name in ("keep_all", "static", "tuned") if name in seconds}

    static, keep = rows.get("static"), rows["keep_all"]
    share = captured_share(static["speedup_median"], keep["speedup_median"]) if static else None
    tuned_row = rows.get("tuned")
    tuned_ratio = tuned_row.get("speedup_total") if tuned_row else None
    return {"engine": r0["engine"], "regime": regime, "protocols": r0["protocols"],
            "fastest_static": r0["fastest_static"], "survivors": r0["survivors"],
            "survivors_undominated": r0["survivors_undominated"], "calm_holders": r0["calm_holders"],
            "tuned_on": r0["tuned_on"],
            "grid": r0["grid"], "left_out": r0["left_out"], "rows": rows,
            "kinds": {"after_spike": AFTER_SPIKE, "counts": {k: kinds.count(k) for k in KINDS},
                      "adaptive_cost": by_kind},
            "goals": goals(regime, rows["adaptive"]["violations"], share,
                           static["speedup_median"] if static else None, tuned_ratio),
            # every static configuration's losses at the probes equal keep-all's, on every rank
            "probe_losses_equal": {n: all(r["probe_losses_equal"][n] for r in ranks) for n in r0["grid"]}}


def closing_lines(summary: Dict[str, Any]) -> List[str]:
    """One line per protocol run: ``ENGINE REGIME PROTOCOL: adaptive X.XXx over NAME, N violations (...)``."""
    engine, regime, rows = summary["engine"], summary["regime"], summary["rows"]
    violations = rows["adaptive"]["violations"]
    lines = []
    for protocol in summary["protocols"]:
        head = f"{engine} {regime} {protocol}: adaptive"
        row = rows.get("static" if protocol == "oracle" else "tuned")
        if row is None:
            seen = "the calm micro-batch and the spikes" if protocol == "oracle" else "the first calm micro-batches"
            lines.append(f"{head} -x over none, {violations} violations (no static configuration held the "
                         f"budget at {seen})")
            continue
        if protocol == "tuned" and row.get("gave_up_at") is not None:
            lines.append(f"{head} -x over {row['config']}, {violations} violations (tuned on the first calm "
                         f"micro-batches alone; it crashed at micro-batch {row['gave_up_at']} and no "
                         f"configuration held what crashed: the run cannot finish)")
            continue
        lo, hi = row["speedup_range"]
        spread = f"range {lo:.2f}-{hi:.2f} over {row['segments']} segments"
        if protocol == "oracle":
            verdict = "a tie within the spread" if lo <= 1.0 <= hi else ("faster" if lo > 1.0 else "slower")
            lines.append(f"{head} {row['speedup_median']:.2f}x over {row['config']}, {violations} violations "
                         f"(the fastest static configuration that held the budget, knowing the spikes; "
                         f"{spread}: {verdict}; per micro-batch median {row['per_micro_batch_median']:.2f}x)")
            continue
        crashes = "; ".join(f"at {c['at']} -> {c['restart_with']}" for c in row["crashes"])
        parts = row["restart_breakdown_s"]
        lines.append(f"{head} {row['speedup_total']:.2f}x over {row['config']}, {violations} violations "
                     f"(tuned on the first calm micro-batches alone, it crashed {len(row['crashes'])} times"
                     f"{': ' + crashes if crashes else ''}; total time with {row['restart_s']:.2f} s of restarts: "
                     f"process {parts['process_s']:.2f}, set-up {parts['setup_s']:.2f}, checkpoint "
                     f"{parts['checkpoint_s']:.2f}, redo {parts['redo_s']:.2f}; {spread})")
    return lines


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
    if "tuned" in summary["protocols"]:
        print(f"held it at the first calm micro-batches {summary['tuned_on']} (the tuned protocol's candidates): "
              f"{'; '.join(summary['calm_holders']) or 'none'}")
    head = (f"{'run':<15}{'configuration':<38}{'time s':>8}{'time / adaptive [range]':>26}"
            f"{'per micro-batch [IQR]':>24}{'violations':>12}{'losses':>8}")
    print(head)
    print("-" * len(head))
    for name in ("adaptive", "static", "tuned", "keep_all", "recompute_all"):
        row = summary["rows"].get(name)
        if row is None or "speedup_range" not in row:  # a tuned run that gave up has no time
            continue
        lo, hi = row["speedup_range"]
        ratio = "1.00" if name == "adaptive" else f"{row['speedup_median']:.2f}x [{lo:.2f}, {hi:.2f}]"
        q1, q3 = row["per_micro_batch_quartiles"]
        each = "1.00" if name == "adaptive" else f"{row['per_micro_batch_median']:.2f}x [{q1:.2f}, {q3:.2f}]"
        viol = "-" if row["violations"] is None else str(row["violations"])
        if name == "keep_all":
            viol += " (probes)"
        if name == "tuned":
            viol += " (crashes)"
        print(f"{name:<15}{row['config'][:37]:<38}{row['total_s']:>8.2f}{ratio:>26}{each:>24}{viol:>12}"
              f"{'equal' if row['losses_equal_keep_all'] else 'DIFFER':>8}")
    tuned = summary["rows"].get("tuned")
    if tuned is not None:
        print(f"tuned (on the first calm micro-batches alone, {summary['tuned_on']}; its time includes each "
              f"restart, checkpoint every {tuned['checkpoint_every']} micro-batches, {tuned['checkpointing']}):")
        for c in tuned["restarts"]:
            print(f"  crashed at {c['at']}, restarted with {c['restart_with']}: {c['total_s']:.2f} s = process "
                  f"{c['process_s']:.2f} + set-up {c['setup_s']:.2f} + checkpoint save and load "
                  f"{c['checkpoint_s']:.2f} + redo of {c['redo_micro_batches']} micro-batches {c['redo_s']:.2f}")
        if tuned["gave_up_at"] is not None:
            print(f"  crashed at {tuned['gave_up_at']} and no configuration held what crashed: it gave up")
    kinds = summary["kinds"]
    print(f"adaptive's seconds over another run's, per micro-batch, by kind (median [quartiles]; 'after a spike': "
          f"the {kinds['after_spike']} micro-batches after one; over tuned: its restarts charged where it crashed)")
    others = list(kinds["adaptive_cost"])
    print(f"{'kind':<22}" + "".join(f"{o:>24}" for o in others))
    for kind, count in kinds["counts"].items():
        cells = []
        for o in others:
            cell = kinds["adaptive_cost"][o][kind]
            cells.append("-" if cell is None else
                         f"{cell['median']:.2f}x [{cell['quartiles'][0]:.2f}, {cell['quartiles'][1]:.2f}]")
        print(f"{kind + f' ({count})':<22}" + "".join(f"{c:>24}" for c in cells))


# The environment an engine's ranks run in, for every configuration alike. Megatron's
# ``jit_fuser`` is ``torch.compile``: a compiled function called inside a provisioned forward
# makes dynamo trace into bagualu2's dispatch mode and recompile until its limit, which would
# charge adaptive for compiles the static configurations pay once (Megatron's tests run so too).
ENVIRONMENT: Dict[str, Dict[str, str]] = {"megatron": {"TORCHDYNAMO_DISABLE": "1"}}


def process_start_seconds(modules: Sequence[str], samples: int = 2) -> float:
    """A restarted rank's process start: a fresh python importing torch and ``modules``, the
    least of ``samples`` (the warmest file cache: the cheapest restart, in static's favour)."""
    code = "import " + ", ".join(("torch", *modules))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return min(times)


def run_engine(engine_name: str, args: argparse.Namespace) -> Tuple[List[Dict[str, Any]], float]:
    """Every rank's row, and a process start's seconds (0.0 where no tuned run needs it)."""
    env = ENVIRONMENT.get(engine_name, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned ranks
    try:
        # Timed before the ranks start, so that nothing else runs beside it.
        process_s = process_start_seconds(engine(engine_name, args).process_modules) \
            if args.protocol in ("tuned", "both") else 0.0
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ranks.json")
            launch(_rank_main, args.world, args, engine_name, path, timeout_s=args.timeout)
            with open(path) as f:
                return json.load(f), process_s
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
    ap.add_argument("--releases", default=None, choices=("operators", "reruns"),
                    help="how adaptive releases (enable's releases=; default: not passed, the library's default)")
    ap.add_argument("--protocol", default="both", choices=("oracle", "tuned", "both"),
                    help="how the static configuration is picked: oracle, the fastest that held the calm "
                         "micro-batch and the first spike on each rank (knowing them in advance); tuned, the "
                         "fastest that held the first calm micro-batches, run until it crashes, restarted (charged as "
                         "measured) with the fastest that held what crashed. Both by default: the tuned run is "
                         "one more contender in the same interleaved trace, and needs every measurement the "
                         "oracle does")
    ap.add_argument("--checkpoint-every", type=int, default=50,
                    help="micro-batches between the tuned run's checkpoints (a crash redoes those since the last)")
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
    for name in engines:
        ranks, process_s = run_engine(name, args)
        summary = summarize(ranks, args.segments, args.regime, process_s, args.checkpoint_every)
        results["engines"][name] = {"summary": summary, "ranks": ranks, "process_start_s": process_s}
        print_engine(summary, ranks)
        lines.extend(closing_lines(summary))
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
