"""``bagualu2 demo``: train the reference MoE model through routing spikes under four policies.

The model is seen from one expert-parallel rank (``ep_size`` ranks, this rank hosting its
share of the experts), which is where a routing spike turns into a memory spike: when the
router sends 2.6x the mean load to a local expert, that expert's activations grow 2.6x.
Spikes hit about 3% of micro-batches, as measured in production MoE training.

Every policy trains the same model from the same initial weights on the same batches, so
their losses must agree bit for bit (the table says so); what differs is memory and time.
The budget is set just above the calm micro-batches' all-keep peak: calm phases fit, spikes
do not. A budget violation is what would have been an out-of-memory crash on a device. The peak
is the activation ledger's over the run, backward's rebuilt and reloaded storages included.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from bagualu2.errors import InfeasibleBudgetError

POLICY_ORDER = ("keep_all", "recompute_all", "static", "adaptive")


@dataclass
class PolicyResult:
    policy: str
    tokens_per_s: float
    calm_tokens_per_s: float
    peak_bytes: int
    budget_bytes: int
    violations: int
    violating_micro_batches: int
    final_loss: float
    losses_match_keep_all: Optional[bool]
    decision_latency_us: float
    traced_micro_batches: int
    seconds: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--micro-batches", type=int, default=200, help="micro-batches per policy (default 200)")
    p.add_argument("--spike-rate", type=float, default=0.03, help="share of micro-batches with a routing spike")
    p.add_argument("--imbalance", type=float, default=2.6, help="load of the spiked expert over the mean")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--ep-size", type=int, default=4, help="expert-parallel ranks; this rank hosts 1/ep of the experts")
    p.add_argument("--budget", type=int, default=None,
                   help="activation budget in bytes (default: 5%% above the calm all-keep peak)")
    p.add_argument("--policies", default=",".join(POLICY_ORDER),
                   help=f"comma-separated subset of {','.join(POLICY_ORDER)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bagualu2-demo"), help="folder for JSON, telemetry and plot")


def _spike_schedule(n: int, rate: float, seed: int, warmup: int) -> List[int]:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"--spike-rate {rate} must be in [0, 1]")
    count = max(2, round(rate * n)) if rate > 0 else 0
    candidates = list(range(warmup, n))
    if count > len(candidates):
        raise ValueError(f"{count} spikes do not fit in {n} micro-batches after {warmup} warm-up ones; "
                         f"raise --micro-batches")
    return sorted(random.Random(seed).sample(candidates, count))


class _Trainer:
    """One policy's copy of the model, optimizer and provisioner, stepped one micro-batch at a time."""

    def __init__(self, model: torch.nn.Module, policy, budget: int) -> None:
        import bagualu2

        self.model = copy.deepcopy(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.prov = bagualu2.enable(self.model, budget=budget, policy=policy)
        self.losses: List[float] = []
        self.times: List[float] = []

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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.prov.step()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_ORDER]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICY_ORDER)}")
    if args.micro_batches < 20:
        raise SystemExit(f"--micro-batches {args.micro_batches} is too few; use at least 20")
    warmup = 5
    try:
        spikes = _spike_schedule(args.micro_batches, args.spike_rate, args.seed, warmup)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.budget is not None and args.budget <= 0:
        raise SystemExit(f"--budget {args.budget} must be a positive number of bytes")
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
        batch_size, seq_len = args.batch_size, args.seq_len
        batches = list(synthetic_batches(cfg.vocab_size, batch_size, seq_len, seed=args.seed,
                                         num_batches=args.micro_batches))
    except ValueError as e:
        raise SystemExit(str(e)) from None

    budget = args.budget
    if budget is None:
        calm_peak = _calm_peak(model, batches[0])
        budget = int(calm_peak * 1.05)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"bagualu2 demo: {args.micro_batches} micro-batches of {batch_size}x{seq_len} tokens, "
          f"{len(spikes)} routing spikes ({args.imbalance}x on a local expert, EP {args.ep_size}), "
          f"activation budget {budget / 2**20:.2f} MiB")

    # Policies take turns micro-batch by micro-batch, so machine noise falls on all alike, the
    # order rotating so that none always runs right after the same one.
    order = [p for p in POLICY_ORDER if p in policies]
    try:
        trainers = {p: _Trainer(model, _static_plan(model, batches[0], budget) if p == "static" else p, budget)
                    for p in order}
        with tqdm(total=len(order) * len(batches), unit="mb", desc="training", dynamic_ncols=True) as bar:
            for i, batch in enumerate(batches):
                spike = args.imbalance if i in spikes else None
                for policy in order[i % len(order):] + order[:i % len(order)]:
                    trainers[policy].step(i, batch, spike, spiked_expert)
                    bar.update(1)
    except InfeasibleBudgetError as e:
        raise SystemExit(f"--budget: {e}") from None
    results = {p: _summarize(p, t.prov, t.times, batches, spikes, warmup, budget) for p, t in trainers.items()}
    reference = trainers["keep_all"].losses if "keep_all" in trainers else None
    for name, r in results.items():
        r.final_loss = trainers[name].losses[-1]
        if reference is not None:
            r.losses_match_keep_all = trainers[name].losses == reference
    _print_table(results, budget)
    summary = _ratios(results)
    for line in summary["lines"]:
        print(line)
    out = {
        "budget_bytes": budget, "micro_batches": args.micro_batches, "spikes": spikes,
        "imbalance": args.imbalance, "ep_size": args.ep_size,
        "results": {k: asdict(v) for k, v in results.items()}, "ratios": summary["ratios"],
    }
    (args.out / "demo_results.json").write_text(json.dumps(out, indent=2))
    png = _plot({p: t.prov for p, t in trainers.items()}, budget, args.out / "memory_timeline.png")
    print(f"wrote {args.out / 'demo_results.json'} and {png}")
    return 0


def _calm_peak(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """All-keep activation peak of one calm micro-batch, measured by the provisioner's ledger."""
    import bagualu2

    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all")
    torch.manual_seed(0)
    probe(batch).backward()
    peak = prov.report()["peak_bytes"]
    prov.disable()
    return peak


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


def _summarize(policy: str, prov, times: List[float], batches, spikes, warmup: int,
               budget: int) -> PolicyResult:
    report = prov.report()
    tokens = batches[0].numel()
    measured = times[warmup:]
    calm = [t for i, t in enumerate(times) if i >= warmup and i not in set(spikes)]
    mbs = prov.telemetry.micro_batches
    return PolicyResult(
        policy=policy,
        tokens_per_s=tokens * len(measured) / sum(measured),
        calm_tokens_per_s=tokens * len(calm) / sum(calm),
        peak_bytes=report["peak_bytes_with_backward"],  # what backward rebuilds and reloads included
        budget_bytes=budget,
        violations=report["violations"],
        violating_micro_batches=sum(1 for m in mbs if m.violations),
        final_loss=float("nan"),
        losses_match_keep_all=None,
        decision_latency_us=report["decision_latency_us"]["mean"],
        traced_micro_batches=report["traced_micro_batches"],
        seconds=sum(times),
    )


def _print_table(results: Dict[str, PolicyResult], budget: int) -> None:
    head = (f"{'policy':<14}{'tokens/s':>10}{'calm tok/s':>12}{'peak MiB':>10}{'budget MiB':>12}"
            f"{'over-budget mb':>16}{'loss == keep_all':>18}")
    print(head)
    print("-" * len(head))
    for name in POLICY_ORDER:
        r = results.get(name)
        if r is None:
            continue
        match = "-" if r.losses_match_keep_all is None else ("yes" if r.losses_match_keep_all else "NO")
        print(f"{name:<14}{r.tokens_per_s:>10.0f}{r.calm_tokens_per_s:>12.0f}{r.peak_bytes / 2**20:>10.2f}"
              f"{budget / 2**20:>12.2f}{r.violating_micro_batches:>16d}{match:>18}")


def _ratios(results: Dict[str, PolicyResult]) -> Dict:
    ratios: Dict[str, float] = {}
    lines: List[str] = []
    a, rc, k = results.get("adaptive"), results.get("recompute_all"), results.get("keep_all")
    if a and rc:
        ratios["adaptive_over_recompute_all"] = a.tokens_per_s / rc.tokens_per_s
        lines.append(f"adaptive speedup over recompute_all: {ratios['adaptive_over_recompute_all']:.2f}x")
    if a and k:
        ratios["adaptive_calm_over_keep_all"] = a.calm_tokens_per_s / k.calm_tokens_per_s
        lines.append(f"adaptive on calm micro-batches: {ratios['adaptive_calm_over_keep_all']:.1%} of keep_all")
    if a:
        lines.append(f"adaptive decision latency: {a.decision_latency_us:.0f} us mean, "
                     f"{a.traced_micro_batches} micro-batches traced (the others were calm)")
    return {"ratios": ratios, "lines": lines}


def _plot(provs: Dict, budget: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for name in POLICY_ORDER:
        prov = provs.get(name)
        if prov is None:
            continue
        mbs = prov.telemetry.micro_batches
        ax.plot([m.peak_bytes / 2**20 for m in mbs], lw=1, label=name)
    ref = next(iter(provs.values())).telemetry.micro_batches
    spikes = [i for i, m in enumerate(ref) if m.imbalance >= 1.5]
    for i in spikes:
        ax.axvline(i, color="red", alpha=0.25, lw=3)
    ax.axhline(budget / 2**20, color="black", ls="--", lw=1, label="budget")
    ax.set_xlabel("micro-batch (red: routing spike)")
    ax.set_ylabel("peak activation MiB")
    ax.set_title("bagualu2 demo: activation memory per micro-batch")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
