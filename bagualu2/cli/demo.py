"""``bagualu2 demo``: train the reference MoE model through routing spikes under four policies.

The model is seen from one expert-parallel rank (``ep_size`` ranks, this rank hosting its
share of the experts), which is where a routing spike turns into a memory spike: when the
router sends 2.6x the mean load to a local expert, that expert's activations grow 2.6x.
Spikes hit about 3% of micro-batches, as measured in production MoE training.

The four policies (``POLICY_NOTES``, printed with the table): ``keep_all`` keeps every
activation, ``recompute_all`` recomputes every block in backward, ``static`` runs one
per-operator plan solved for the average load and then frozen, ``adaptive`` is bagualu2's
plan per micro-batch. Every policy trains the same model from the same initial weights on the
same batches, so their losses must agree bit for bit (the table says so); what differs is
memory and time. The budget is set just above the calm micro-batches' all-keep peak: calm
phases fit, spikes do not. Going over it is what would have been an out-of-memory crash on a
device.

One definition of peak, in the table, the plot and the JSON: a micro-batch's peak is the
activation ledger's high-water mark from its forward's start to its backward's end (what
backward rebuilds and reloads included); a policy's peak is the largest of them.

Time: the policies take turns micro-batch by micro-batch, so machine noise falls on all alike.
The run is cut into rounds; each round gives one paired ratio between two policies (the same
micro-batches, the same minutes of machine load), and the spread of a ratio is its lowest to
highest round. A ratio whose spread holds 1.0 is a tie: the run cannot tell the two apart.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from bagualu2.errors import InfeasibleBudgetError

POLICY_ORDER = ("keep_all", "recompute_all", "static", "adaptive")
POLICY_NOTES = {
    "keep_all": "keeps every activation: fastest while it fits, over the budget on spikes",
    "recompute_all": "recomputes every block in backward (checkpointing every layer): never over, slow",
    "static": "one keep/offload/recompute plan per operator, solved once for the average load, then frozen",
    "adaptive": "bagualu2: a plan per micro-batch, decided at each MoE gate from the routing it sees",
}
WARMUP = 5  # adaptive's profiling and calibrating micro-batches: not timed (the plot marks them)
QUICK, FULL = (200, 5), (1000, 10)  # micro-batches per policy, rounds: the default and --full
# How much longer than a calm keep_all micro-batch the four policies' turns take, on average:
# recompute_all reruns its blocks, adaptive traces through spikes. Only for the time announced.
POLICY_COST = {"keep_all": 1.0, "recompute_all": 1.4, "static": 1.1, "adaptive": 1.1}
BUSY_SLOWDOWN = 1.5  # calm micro-batches this much slower than the first ones: the machine got busy


@dataclass
class Ratio:
    """One policy's throughput over another's: over the whole run and per paired round."""

    value: float
    low: float
    high: float

    @property
    def tie(self) -> bool:
        """Inside the run-to-run spread: the rounds do not agree on which is faster."""
        return self.low <= 1.0 <= self.high

    def text(self) -> str:
        said = f"{self.value:.2f}x (rounds {self.low:.2f}x to {self.high:.2f}x)"
        return said + (": a tie, inside the run-to-run spread" if self.tie else "")


@dataclass
class PolicyResult:
    policy: str
    tokens_per_s: float
    calm_tokens_per_s: float
    peak_bytes: int              # largest micro-batch peak, forward through backward
    budget_bytes: int
    over_budget_micro_batches: int  # micro-batches whose peak crossed the budget
    violations: int              # saves over the budget (the provisioner's count)
    final_loss: float
    losses_match_keep_all: Optional[bool]
    decision_latency_us: float
    traced_micro_batches: int
    seconds: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Train the reference MoE model through routing spikes under four policies (keep_all, "
        "recompute_all, static, adaptive) and compare their activation peaks against a memory "
        f"budget, their speed and their losses. About a minute on a quiet machine ({QUICK[0]} "
        f"micro-batches per policy); --full runs {FULL[0]}.")
    p.add_argument("--micro-batches", type=int, default=None,
                   help=f"micro-batches per policy (default {QUICK[0]}; {FULL[0]} with --full)")
    p.add_argument("--full", action="store_true",
                   help=f"the long run: {FULL[0]} micro-batches per policy in {FULL[1]} rounds")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"paired rounds the timing is cut into (default {QUICK[1]}; {FULL[1]} with --full)")
    p.add_argument("--spike-rate", type=float, default=0.03, help="share of micro-batches with a routing spike")
    p.add_argument("--imbalance", type=float, default=2.6, help="load of the spiked expert over the mean")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--ep-size", type=int, default=4, help="expert-parallel ranks; this rank hosts 1/ep of the experts")
    p.add_argument("--budget", type=int, default=None,
                   help="activation budget in bytes (default: 5%% above the calm all-keep peak)")
    p.add_argument("--policies", default=",".join(POLICY_ORDER),
                   help=f"comma-separated subset of {','.join(POLICY_ORDER)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and spikes")
    p.add_argument("--out", type=Path, default=Path("bagualu2-demo"),
                   help="folder for demo_results.json, memory_timeline.png and telemetry_<policy>.jsonl")


def _spike_schedule(n: int, rate: float, seed: int, warmup: int) -> List[int]:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"--spike-rate {rate} must be in [0, 1]")
    count = max(2, round(rate * n)) if rate > 0 else 0
    candidates = list(range(warmup, n))
    if count > len(candidates):
        raise ValueError(f"{count} spikes do not fit in {n} micro-batches after {warmup} warm-up ones; "
                         f"raise --micro-batches")
    return sorted(random.Random(seed).sample(candidates, count))


def rounds_of(n: int, rounds: int, warmup: int = WARMUP) -> List[range]:
    """The timed micro-batches (``warmup`` on) cut into ``rounds`` contiguous, near-equal rounds."""
    timed = n - warmup
    if not 1 <= rounds <= timed:
        raise ValueError(f"--rounds {rounds} must be in [1, {timed}] for {n} micro-batches")
    bounds = [warmup + timed * r // rounds for r in range(rounds + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def paired_ratio(times_a: Sequence[float], times_b: Sequence[float], rounds: Sequence[range],
                 keep: Optional[set] = None) -> Ratio:
    """Throughput of ``a`` over ``b`` (their seconds per micro-batch, same micro-batches):
    over every micro-batch of ``rounds`` (those in ``keep`` only, when given) and per round.
    A round with none of them gives no ratio (``_settings`` keeps half the timed micro-batches
    calm, so some round has them)."""
    def seconds(times: Sequence[float], r: range) -> float:
        return sum(times[i] for i in r if keep is None or i in keep)

    per_round = [seconds(times_b, r) / seconds(times_a, r) for r in rounds if seconds(times_a, r) > 0]
    total = sum(seconds(times_b, r) for r in rounds) / sum(seconds(times_a, r) for r in rounds)
    return Ratio(total, min(per_round), max(per_round))


def busy_note(first_s: float, calm_s: float, load: float, cpus: int, threads: int) -> Optional[str]:
    """What to say when the machine was busy: calm micro-batches much slower than the first one
    measured before training, or more runnable processes than cores. None when quiet."""
    slower = calm_s / first_s if first_s > 0 else 1.0
    if slower < BUSY_SLOWDOWN and load <= cpus:
        return None
    return (f"note: the machine is busy (load average {load:.1f} on {cpus} cores; calm micro-batches took "
            f"{slower:.1f}x as long as the first one measured): torch's {threads} threads share the cores "
            f"with other processes, so times are slower and noisier than on a quiet machine. The rounds' "
            f"spread shows how much; ratios inside it are called ties.")


class _Trainer:
    """One policy's copy of the model, optimizer and provisioner, stepped one micro-batch at a time."""

    def __init__(self, model: torch.nn.Module, policy, budget: int, telemetry: Path) -> None:
        import bagualu2

        self.model = copy.deepcopy(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.prov = bagualu2.enable(self.model, budget=budget, policy=policy, telemetry_path=telemetry)
        self.losses: List[float] = []
        self.times: List[float] = []
        self.peaks: List[int] = []  # per micro-batch, forward through backward

    def step(self, i: int, batch: torch.Tensor, spike: Optional[float], expert: int) -> None:
        start = time.perf_counter()
        torch.manual_seed(i)
        if spike:
            with self.model.routing_spike(spike, experts=(expert,)):
                loss = self.model(batch)
                loss.backward()
        else:
            loss = self.model(batch)
            loss.backward()
        # The ledger's high-water mark restarts as each forward begins: read after backward, it
        # is this micro-batch's, rebuilt and reloaded storages included.
        self.peaks.append(self.prov.runtime.ledger.peak)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.prov.step()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def _settings(args: argparse.Namespace):
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_ORDER]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICY_ORDER)}")
    n = args.micro_batches if args.micro_batches is not None else (FULL if args.full else QUICK)[0]
    if n < 20:
        raise SystemExit(f"--micro-batches {n} is too few; use at least 20")
    rounds = args.rounds if args.rounds is not None else min((FULL if args.full else QUICK)[1], n - WARMUP)
    try:
        spans = rounds_of(n, rounds)
        spikes = _spike_schedule(n, args.spike_rate, args.seed, WARMUP)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if 2 * len(spikes) > n - WARMUP:
        raise SystemExit(f"--spike-rate {args.spike_rate} spikes {len(spikes)} of {n - WARMUP} timed micro-batches; "
                         f"at most half may spike, to leave calm ones to compare")
    if args.budget is not None and args.budget <= 0:
        raise SystemExit(f"--budget {args.budget} must be a positive number of bytes")
    return [p for p in POLICY_ORDER if p in policies], n, spans, spikes


def run(args: argparse.Namespace) -> int:
    from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches

    order, n, spans, spikes = _settings(args)
    # Arguments the model and the data check: their messages, without a traceback.
    spiked_expert = 0  # hosted by this rank
    try:
        cfg = MoEConfig.small(ep_size=args.ep_size)
        if not 1 <= args.seq_len <= cfg.max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} must be in [1, {cfg.max_seq_len}] for the demo model")
        torch.manual_seed(args.seed)
        model = MoETransformer(cfg)
        with model.routing_spike(args.imbalance, experts=(spiked_expert,)):
            pass
        batches = list(synthetic_batches(cfg.vocab_size, args.batch_size, args.seq_len, seed=args.seed,
                                         num_batches=n))
    except ValueError as e:
        raise SystemExit(str(e)) from None

    calm_peak, first_s = _calm_peak(model, batches[0])
    budget = args.budget if args.budget is not None else int(calm_peak * 1.05)
    args.out.mkdir(parents=True, exist_ok=True)
    cpus, threads, load_before = os.cpu_count() or 1, torch.get_num_threads(), os.getloadavg()[0]
    expected = first_s * n * sum(POLICY_COST[p] for p in order)
    print(f"bagualu2 demo: {len(order)} policies x {n} micro-batches of {args.batch_size}x{args.seq_len} tokens, "
          f"{len(spikes)} routing spikes ({args.imbalance}x the mean load on a local expert, EP {args.ep_size}), "
          f"activation budget {budget / 2**20:.2f} MiB" +
          (" (5% above a calm micro-batch's peak)" if args.budget is None else ""))
    print(f"expect about {_duration(expected)} here: one calm micro-batch took {first_s * 1e3:.0f} ms "
          f"({threads} torch threads, {cpus} cores)" + ("" if args.full else "; --full runs the long version"))
    if load_before > cpus:
        print(f"note: the machine is busy before the start (load average {load_before:.1f} on {cpus} cores): "
              f"expect longer, and noisier times")
    for name in order:
        print(f"  {name:<14}{POLICY_NOTES[name]}")

    try:
        with warnings.catch_warnings():
            # Crossing the budget is what the static policies are here to show: the table counts it.
            warnings.filterwarnings("ignore", message="bagualu2: micro-batch .* went over the activation budget")
            trainers = {p: _Trainer(model, _static_plan(model, batches[0], budget) if p == "static" else p, budget,
                                    args.out / f"telemetry_{p}.jsonl") for p in order}
            _train(trainers, order, batches, spikes, args.imbalance, spiked_expert)
    except InfeasibleBudgetError as e:
        raise SystemExit(f"--budget: {e}") from None

    calm = set(range(WARMUP, n)) - set(spikes)
    results = {p: _summarize(p, t, args.batch_size * args.seq_len, spans, calm, budget) for p, t in trainers.items()}
    reference = trainers["keep_all"].losses if "keep_all" in trainers else None
    for name, r in results.items():
        if reference is not None:
            r.losses_match_keep_all = trainers[name].losses == reference
    times = {p: t.times for p, t in trainers.items()}
    comparisons = _comparisons(times, spans, calm)
    _print_table(results, budget)
    adaptive = trainers.get("adaptive")
    for line in _verdict(results, comparisons, _warm(adaptive) if adaptive is not None else []):
        print(line)
    # The first micro-batch measured was keep_all's: another policy's calm ones, scaled to it.
    calm_s = statistics.median(trainers[order[0]].times[i] for i in calm) / POLICY_COST[order[0]]
    load_after = os.getloadavg()[0]
    note = busy_note(first_s, calm_s, max(load_before, load_after), cpus, threads)
    if note:
        print(note)
    out = {
        "budget_bytes": budget, "micro_batches": n, "spikes": spikes, "imbalance": args.imbalance,
        "ep_size": args.ep_size, "rounds": [[r.start, r.stop] for r in spans], "warmup": WARMUP,
        "results": {k: asdict(v) for k, v in results.items()},
        "comparisons": {k: {**asdict(v), "tie": v.tie} for k, v in comparisons.items()},
        "peaks": {p: t.peaks for p, t in trainers.items()},
        "machine": {"cpus": cpus, "torch_threads": threads, "load_before": load_before, "load_after": load_after,
                    "first_micro_batch_s": first_s, "busy": note is not None},
    }
    (args.out / "demo_results.json").write_text(json.dumps(out, indent=2))
    png = _plot(trainers, spikes, budget, args.out / "memory_timeline.png")
    print(f"wrote {args.out / 'demo_results.json'}, {png} and the telemetry of each policy "
          f"({args.out / 'telemetry_<policy>.jsonl'})")
    return 0


def _train(trainers: Dict[str, _Trainer], order: List[str], batches: List[torch.Tensor], spikes: List[int],
           imbalance: float, expert: int) -> None:
    """The policies take turns micro-batch by micro-batch, so machine noise falls on all alike,
    the order rotating so that none always runs right after the same one."""
    from tqdm import tqdm

    with tqdm(total=len(order) * len(batches), unit="micro-batch", desc="training", dynamic_ncols=True) as bar:
        for i, batch in enumerate(batches):
            spike = imbalance if i in spikes else None
            for policy in order[i % len(order):] + order[:i % len(order)]:
                trainers[policy].step(i, batch, spike, expert)
                bar.update(1)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


def _calm_peak(model: torch.nn.Module, batch: torch.Tensor):
    """All-keep activation peak of one calm micro-batch (the provisioner's ledger), and the
    seconds the faster of two such micro-batches took (the first runs cold)."""
    import bagualu2

    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all")
    seconds = []
    for i in range(2):
        start = time.perf_counter()
        torch.manual_seed(i)
        probe(batch).backward()
        seconds.append(time.perf_counter() - start)
    peak = prov.report()["peak_bytes_with_backward"]
    prov.disable()
    return peak, min(seconds)


def _static_plan(model: torch.nn.Module, batch: torch.Tensor, budget: int):
    """The per-operator plan the planner picks for the average (calm) load, then frozen."""
    import bagualu2

    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=budget, policy="adaptive")
    for i in range(prov.profile_frames):
        torch.manual_seed(i)
        probe(batch).backward()
    plan = prov.plan_for(prov.mean_counts())
    prov.disable()
    return plan


def _summarize(policy: str, trainer: _Trainer, tokens: int, spans: List[range], calm: set,
               budget: int) -> PolicyResult:
    report = trainer.prov.report()
    timed = [i for r in spans for i in r]
    times = trainer.times
    return PolicyResult(
        policy=policy,
        tokens_per_s=tokens * len(timed) / sum(times[i] for i in timed),
        calm_tokens_per_s=tokens * len(calm) / sum(times[i] for i in calm),
        peak_bytes=max(trainer.peaks),
        budget_bytes=budget,
        over_budget_micro_batches=sum(1 for p in trainer.peaks if p > budget),
        violations=report["violations"],
        final_loss=trainer.losses[-1],
        losses_match_keep_all=None,
        decision_latency_us=report["decision_latency_us"]["mean"],
        traced_micro_batches=report["traced_micro_batches"],
        seconds=sum(times),
    )


def _comparisons(times: Dict[str, List[float]], spans: List[range], calm: set) -> Dict[str, Ratio]:
    out: Dict[str, Ratio] = {}
    if "adaptive" in times and "recompute_all" in times:
        out["adaptive_over_recompute_all"] = paired_ratio(times["adaptive"], times["recompute_all"], spans)
    if "adaptive" in times and "keep_all" in times:
        out["adaptive_calm_over_keep_all"] = paired_ratio(times["adaptive"], times["keep_all"], spans, calm)
    return out


def _print_table(results: Dict[str, PolicyResult], budget: int) -> None:
    print(f"peak: a micro-batch's activation high-water mark, forward through backward, the largest of "
          f"the run; budget {budget / 2**20:.2f} MiB; tokens/s over the micro-batches after the first {WARMUP}")
    head = (f"{'policy':<14}{'tokens/s':>10}{'calm tok/s':>12}{'peak MiB':>10}"
            f"{'micro-batches over budget':>27}{'loss == keep_all':>18}")
    print(head)
    print("-" * len(head))
    for name in POLICY_ORDER:
        r = results.get(name)
        if r is None:
            continue
        match = "-" if r.losses_match_keep_all is None else ("yes" if r.losses_match_keep_all else "NO")
        print(f"{name:<14}{r.tokens_per_s:>10.0f}{r.calm_tokens_per_s:>12.0f}{r.peak_bytes / 2**20:>10.2f}"
              f"{r.over_budget_micro_batches:>27d}{match:>18}")


def _warm(trainer: _Trainer) -> List[int]:
    """Adaptive's micro-batches that profile the operators or calibrate (release all they can, to
    measure what that costs): slower and lower than the others, by design."""
    prov = trainer.prov
    return [m.micro_batch for m in prov.telemetry.micro_batches if m.calibrating or m.micro_batch < prov.profile_frames]


def _verdict(results: Dict[str, PolicyResult], comparisons: Dict[str, Ratio], warm: List[int]) -> List[str]:
    """What the run shows, in the demo's terms: who crossed the budget, who was faster."""
    lines = ["what this run shows:"]
    a = results.get("adaptive")
    crossed = [f"{name} on {r.over_budget_micro_batches}" for name, r in results.items()
               if name != "adaptive" and r.over_budget_micro_batches]
    if a is not None:
        held = "held the budget" if a.over_budget_micro_batches == 0 else \
            f"went over the budget on {a.over_budget_micro_batches} micro-batches"
        lines.append(f"  adaptive {held}" + (f"; over it: {', '.join(crossed)} micro-batches "
                                             f"(each an out-of-memory crash on a device)" if crossed else ""))
    if "adaptive_over_recompute_all" in comparisons:
        lines.append(f"  adaptive over recompute_all (the other policy that never crosses it), tokens/s: "
                     f"{comparisons['adaptive_over_recompute_all'].text()}")
    if "adaptive_calm_over_keep_all" in comparisons:
        lines.append(f"  adaptive over keep_all on calm micro-batches (where both keep everything), tokens/s: "
                     f"{comparisons['adaptive_calm_over_keep_all'].text()}")
    matches = [r.losses_match_keep_all for r in results.values() if r.losses_match_keep_all is not None]
    if matches:
        lines.append("  losses: " + ("equal bit for bit under every policy" if all(matches) else
                                     "NOT equal under every policy (a bug: please report it)"))
    if a is not None:
        lines.append(f"  adaptive decided in {a.decision_latency_us:.0f} us on average at each MoE gate; "
                     f"{a.traced_micro_batches} micro-batches traced (the others were calm)")
    if warm:
        lines.append(f"  adaptive's micro-batches {_spans(warm)} profiled the operators or calibrated (released all "
                     f"they could, to measure what that costs): the plot's gold band, lower than keep_all's")
    return lines


def _spans(indices: List[int]) -> str:
    """[0, 1, 2, 3, 4, 9] -> '0-4, 9'."""
    out: List[str] = []
    for i in indices:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _plot(trainers: Dict[str, _Trainer], spikes: List[int], budget: int, path: Path) -> Path:
    """One panel per policy (so that no line hides another), the budget, spikes and adaptive's
    profiling and calibrating micro-batches marked; the legend beside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = [p for p in POLICY_ORDER if p in trainers]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.7 * len(names) + 1.2), sharex=True, sharey=True,
                             squeeze=False)
    colors = dict(zip(POLICY_ORDER, ("tab:blue", "tab:orange", "tab:purple", "tab:green")))
    mib = 2**20
    for ax, name in zip(axes[:, 0], names):
        trainer = trainers[name]
        peaks = [p / mib for p in trainer.peaks]
        for i in spikes:
            ax.axvspan(i - 0.5, i + 0.5, color="red", alpha=0.18, lw=0)
        for i in _warm(trainer) if name == "adaptive" else []:
            ax.axvspan(i - 0.5, i + 0.5, color="gold", alpha=0.35, lw=0)
        ax.plot(range(len(peaks)), peaks, color=colors[name], lw=1.2)
        over = [i for i, p in enumerate(trainer.peaks) if p > budget]
        ax.plot(over, [peaks[i] for i in over], "x", color="red", ms=7, mew=2)
        ax.axhline(budget / mib, color="black", ls="--", lw=1)
        ax.set_ylabel("MiB")
        ax.set_title(f"{name}: {POLICY_NOTES[name]}", fontsize=9, loc="left")
        ax.set_ylim(0, 1.15 * max(budget, *(max(t.peaks) for t in trainers.values())) / mib)
    axes[-1, 0].set_xlabel("micro-batch")
    fig.suptitle("peak activation memory of each micro-batch, forward through backward", fontsize=11)
    legend = [Line2D([], [], color="black", ls="--", label="budget"),
              Line2D([], [], color="red", marker="x", ls="", mew=2, label="over the budget\n(a crash on a device)"),
              Patch(color="red", alpha=0.18, label="routing spike"),
              Patch(color="gold", alpha=0.35, label="adaptive profiling\nand calibrating")]
    fig.legend(handles=legend, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
