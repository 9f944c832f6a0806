"""``bagualu2 simulate``: command-line front end of the cluster-scale simulator.

Mounted by ``bagualu2/cli/__init__.py`` through :func:`add_arguments` and :func:`run`; also runnable as
``python -m bagualu2.sim``. Example::

    bagualu2 simulate --model deepseek-v3-671b --cluster dcu-64g --tp 2 --pp 16 --vpp 2 \\
        --ep 64 --dp 6 --seq auto --steps 1000 --policies all --out sim_out
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from bagualu2.sim.engine import SimResult

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``simulate`` options on ``parser``."""
    g = parser.add_argument_group("what to simulate")
    g.add_argument("--list", action="store_true", help="list model and cluster presets and exit")
    g.add_argument("--model", default="deepseek-v3-671b", help="model preset (see --list)")
    g.add_argument("--cluster", default="dcu-64g", help="cluster preset (see --list)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    g.add_argument("--pp", type=int, default=16, help="pipeline stages")
    g.add_argument("--vpp", type=int, default=1,
                   help="virtual stages per pipeline stage (interleaved 1F1B when > 1)")
    g.add_argument("--ep", type=int, default=None,
                   help="expert parallel size (default: the largest divisor of the model's experts up "
                        "to 64: 64 for DeepSeek-V3's 256, 8 for Mixtral's 8; 1 for a dense model)")
    g.add_argument("--dp", type=int, default=12, help="data parallel size (on top of ep)")
    g.add_argument("--microbatches", type=int, default=0,
                   help="micro-batches per step (default 4 * pp)")
    g.add_argument("--mbs", type=int, default=1, help="sequences per micro-batch")
    g.add_argument("--seq", default="model",
                   help="tokens per sequence: an integer, 'model' (the preset's), or 'auto' (the "
                        "longest that keep_all fits in calm phases, how the aggressive baseline is "
                        "tuned)")
    g = parser.add_argument_group("load and policies")
    g.add_argument("--steps", type=int, default=500, help="training steps to simulate")
    g.add_argument("--policies", default="all",
                   help="'all' or a comma list of keep_all,recompute_all,static,adaptive,"
                        "adaptive_overlap")
    g.add_argument("--spike-rate", type=float, default=0.029,
                   help="fraction of steps with a load spike")
    g.add_argument("--max-imbalance", type=float, default=2.6,
                   help="spike ceiling (max / mean EP rank load)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated load trace")
    g.add_argument("--trace", default=None,
                   help="replay a recorded trace: the provisioner's telemetry JSON lines")
    g.add_argument("--ckpt-interval", type=int, default=100, help="steps between checkpoints")
    g.add_argument("--restart-s", type=float, default=None,
                   help="cold restart cost (default: the cluster's, 284 s)")
    g.add_argument("--static-imbalance", type=float, default=None,
                   help="worst case the static plan is solved for (default: the trace maximum)")
    g = parser.add_argument_group("output")
    g.add_argument("--out", default=None, help="directory for result.json, table.txt and plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _policies(spec: str) -> List[str]:
    from bagualu2.sim.engine import POLICIES

    if spec.strip() == "all":
        return list(POLICIES)
    names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ValueError(f"unknown policies {bad or spec!r}; use 'all' or a comma list of "
                         f"{', '.join(POLICIES)}")
    return names


def run(args: argparse.Namespace) -> int:
    """Run one simulation from parsed ``args``; prints the table. Returns the exit status."""
    from bagualu2.sim.clusters import describe_clusters
    from bagualu2.sim.models import describe_models

    if args.list:
        print("models:")
        for line in describe_models():
            print("  " + line)
        print("clusters:")
        for line in describe_clusters():
            print("  " + line)
        print("policies: keep_all, recompute_all, static, adaptive, adaptive_overlap")
        return 0
    try:
        return _run(args)
    except ValueError as e:
        print(f"bagualu2 simulate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from bagualu2.sim.clusters import get_cluster
    from bagualu2.sim.engine import Simulator
    from bagualu2.sim.layout import Layout
    from bagualu2.sim.models import get_model
    from bagualu2.sim.results import format_table, write_outputs
    from bagualu2.sim.sizing import fit_seq_for_keep_all
    from bagualu2.sim.traces import generate_trace, read_telemetry

    model = get_model(args.model)
    cluster = get_cluster(args.cluster)
    policies = _policies(args.policies)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    ep = args.ep if args.ep is not None else default_ep(model.experts)
    layout = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=ep, dp=args.dp,
                    microbatches=args.microbatches, mbs=args.mbs, seq=model.seq)
    layout.validate(model)
    if args.seq == "auto":
        layout = dataclasses.replace(layout, seq=fit_seq_for_keep_all(model, cluster, layout))
    elif args.seq != "model":
        try:
            seq = int(args.seq)
        except ValueError:
            raise ValueError(
                f"--seq must be an integer, 'model' or 'auto', got {args.seq!r}") from None
        layout = dataclasses.replace(layout, seq=seq)
    sim = Simulator(model, cluster, layout, checkpoint_interval=args.ckpt_interval,
                    restart_s=args.restart_s, static_imbalance=args.static_imbalance)
    if args.trace:
        if not os.path.isfile(args.trace):
            raise ValueError(f"--trace {args.trace!r} is not a file; pass the telemetry JSON lines a "
                             f"provisioner wrote (enable(..., telemetry_path=...))")
        per_rank = max(1, model.experts // layout.ep)
        trace = read_telemetry(args.trace, ep=layout.ep, experts_per_rank=per_rank).fit(
            args.steps, layout.m, len(sim.moe_units))
    else:
        trace = generate_trace(args.steps, layout.m, len(sim.moe_units), ep=layout.ep,
                               spike_rate=args.spike_rate, max_imbalance=args.max_imbalance,
                               seed=args.seed)
    bar = None
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps * len(policies), unit="step", desc="simulating",
                   file=sys.stderr, leave=False, bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} "
                   "[{elapsed}<{remaining}]")
        progress = bar.update
    try:
        result = sim.run(trace, policies, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    print(format_table(result))
    note = _why_alike(result)
    if note:
        print(note)
    print(f"simulated {result.steps} steps x {len(policies)} policies in {result.wall_s:.1f} s")
    if args.out:
        paths = write_outputs(result, args.out)
        _plot_throughput(result, Path(args.out) / "throughput.png")
        print("wrote " + ", ".join(str(p) for p in paths + [Path(args.out) / "throughput.png"]))
    return 0


def default_ep(experts: int) -> int:
    """``--ep`` when not given: the largest divisor of the model's routed experts up to 64."""
    return max(d for d in range(1, 65) if experts % d == 0) if experts else 1


def _why_alike(result: "SimResult") -> Optional[str]:
    """Say why the policies look alike when no spike pushed keep_all past device memory."""
    keep = result.policies.get("keep_all")
    if keep is None or keep.summary.get("oom_count", 0) or float(keep.peak.max()) > result.device_memory:
        return None
    return (f"note: keep_all never ran out of memory here (highest stage peak "
            f"{float(keep.peak.max()) / 2**30:.1f} GiB of {result.device_memory / 2**30:.0f} GiB): every spike "
            f"fit, so adaptive keeps everything as keep_all does, and policies differ only by what they recompute "
            f"or offload without need. Raise the load (--seq auto, --seq, --mbs, --max-imbalance) to see them part.")


def _plot_throughput(result: "SimResult", path: Path) -> None:
    """Bar chart of effective tokens/s per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = list(result.policies)
    vals = [result.policies[p].summary["tokens_per_s"] for p in pol]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(pol, vals, color="tab:blue")
    ax.set_ylabel("tokens/s (OOM restarts included)")
    ax.set_title(f"{result.model} on {result.cluster}, {result.layout['world']:,} accelerators")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry (``python -m bagualu2.sim``)."""
    parser = argparse.ArgumentParser(prog="bagualu2 simulate",
                                     description="Cluster-scale simulator of activation policies")
    add_arguments(parser)
    return run(parser.parse_args(argv))
