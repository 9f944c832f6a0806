"""Activation policies across cluster sizes (128 to 12,288 accelerators), simulated.

For each scenario (model, layout on the 64 GB DCU-class preset) the aggressive baseline's
micro-batch is tuned the usual way (longest sequence whose calm keep_all peak leaves 3% of
memory free), a seeded trace with the default spike pattern (2.9% of steps, up to 2.6x) is
generated, and the five policies are simulated. Prints a table, writes JSON and a plot of
throughput by policy across cluster sizes, and reports each policy's ratio to recompute_all
(the published ablation's baseline) and to the static plan.

    python benchmarks/sim_policies.py --steps 1000 --out out/sim_policies
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Dict, List

from bagualu2.sim.clusters import get_cluster
from bagualu2.sim.engine import POLICIES, Simulator
from bagualu2.sim.layout import Layout
from bagualu2.sim.models import get_model
from bagualu2.sim.results import plot_scaling
from bagualu2.sim.sizing import fit_seq_for_keep_all
from bagualu2.sim.traces import generate_trace

SCENARIOS = [  # (model, tp, pp, vpp, ep, dp)
    ("deepseek-v3-188b", 2, 8, 1, 8, 1),
    ("deepseek-v3-188b", 2, 8, 1, 32, 1),
    ("deepseek-v3-671b", 2, 16, 1, 32, 1),
    ("deepseek-v3-671b", 2, 16, 2, 64, 2),
    ("deepseek-v3-671b", 2, 16, 2, 64, 6),
    ("deepseek-v3-1.04t", 2, 16, 2, 64, 6),
]


PUBLISHED = {"static": 1.16, "adaptive": 1.22, "adaptive_overlap": 1.38}
PUBLISHED_VS_TUNED_STATIC = 1.14


def run_ablation(cluster, steps: int, seed: int) -> List[Dict[str, object]]:  # noqa: ANN001
    """Predicted vs published ablation on the calibration scenario, at the aggressive
    baseline's tuned micro-batch and at a memory-tight one (2.5x longer sequences)."""
    from bagualu2.sim.calibrate import reference_setup

    model, _, ref = reference_setup(cluster)
    out: List[Dict[str, object]] = []
    print()
    print("ablation over full recompute (recompute_all) and over the static plan, "
          f"{model.name}, {ref.world:,} accelerators; published: fine-grained 1.16x, "
          f"+dynamic 1.22x, +overlap 1.38x, 1.14x over the tuned static baseline")
    print(f"{'scenario':34s} {'static':>8s} {'adaptive':>9s} {'+overlap':>9s} "
          f"{'ovl/static':>10s} {'ovl/keep_all':>12s}")
    for label, seq in (("tuned aggressive micro-batch", ref.seq),
                       ("memory-tight (2.5x tokens)", int(ref.seq * 2.5) // 64 * 64)):
        lay = dataclasses.replace(ref, seq=seq)
        sim = Simulator(model, cluster, lay)
        res = sim.run(generate_trace(steps, lay.m, len(sim.moe_units), ep=lay.ep, seed=seed))
        t = {p: r.summary["tokens_per_s"] for p, r in res.policies.items()}
        row = {"scenario": label, "seq": seq,
               **{f"{p}_vs_recompute": t[p] / t["recompute_all"] for p in PUBLISHED},
               "overlap_vs_static": t["adaptive_overlap"] / t["static"],
               "overlap_vs_keep_all": (t["adaptive_overlap"] / t["keep_all"]
                                       if t["keep_all"] else float("inf")),
               "mfu": {p: r.summary["mfu"] for p, r in res.policies.items()},
               "keep_all_ooms": res.policies["keep_all"].summary["oom_count"]}
        out.append(row)
        print(f"{label + f' (seq {seq})':34s} {row['static_vs_recompute']:8.3f} "
              f"{row['adaptive_vs_recompute']:9.3f} {row['adaptive_overlap_vs_recompute']:9.3f} "
              f"{row['overlap_vs_static']:10.3f} {row['overlap_vs_keep_all']:12.3f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="dcu-64g")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/sim_policies")
    args = ap.parse_args()
    cluster = get_cluster(args.cluster)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: List[Dict[str, object]] = []
    print(f"{'model':18s} {'world':>6s} {'layout':24s} {'seq':>5s} {'policy':17s} "
          f"{'tokens/s':>12s} {'MFU':>6s} {'OOMs':>4s} {'x recomp':>8s} {'x static':>8s} "
          f"{'sim s':>6s}")
    for name, tp, pp, vpp, ep, dp in SCENARIOS:
        model = get_model(name)
        lay = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=dp)
        lay = dataclasses.replace(lay, seq=fit_seq_for_keep_all(model, cluster, lay))
        sim = Simulator(model, cluster, lay)
        trace = generate_trace(args.steps, lay.m, len(sim.moe_units), ep=ep, seed=args.seed)
        t0 = time.perf_counter()
        res = sim.run(trace, POLICIES)
        wall = time.perf_counter() - t0
        base = {p: res.policies[p].summary["tokens_per_s"] for p in ("recompute_all", "static")}
        for p, r in res.policies.items():
            s = r.summary
            row = dict(model=name, world=lay.world, tp=tp, pp=pp, vpp=vpp, ep=ep, dp=dp,
                       seq=lay.seq, policy=p, sim_wall_s=wall, **s,
                       vs_recompute=s["tokens_per_s"] / base["recompute_all"],
                       vs_static=s["tokens_per_s"] / base["static"])
            rows.append(row)
            shape = f"tp{tp} pp{pp}x{vpp} ep{ep} dp{dp}"
            print(f"{name:18s} {lay.world:6d} {shape:24s} {lay.seq:5d} {p:17s} "
                  f"{s['tokens_per_s']:12,.0f} {s['mfu']:6.1%} {s['oom_count']:4d} "
                  f"{row['vs_recompute']:8.3f} {row['vs_static']:8.3f} {wall:6.1f}")
    ablation = run_ablation(cluster, args.steps, args.seed)
    (out / "sim_policies.json").write_text(json.dumps(
        {"cluster": args.cluster, "steps": args.steps, "seed": args.seed, "rows": rows,
         "ablation": ablation}, indent=1, default=float))
    # one line per policy; where two models share a size the larger model is plotted
    largest: Dict[tuple, Dict[str, object]] = {}
    for r in rows:
        largest[(r["world"], r["policy"])] = r
    plot_scaling(list(largest.values()), out / "sim_policies.png", metric="vs_recompute",
                 title=f"throughput over full recompute ({args.cluster}, OOM restarts included)")
    print(f"wrote {out / 'sim_policies.json'} and {out / 'sim_policies.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
