"""Decision latency of the planner and of the overlap scheduler.

Cold decisions: Planner.solve on random MoE-like candidate sets of 8..256 operators, timed
through the Python facade and through the bare C++ binding (``bagualu2._C.Planner``, the DP
the facade calls, on columns prebuilt: the "C++ us" column), and with an
offload setup cost (a plan that offloads anything pays it once): small (10% of the plan's
exposed time: the recompute-only bound usually rules out a plan without offloads) and large
(10x: the plan without offloads is solved too, a second DP). Baselines in
the same run: a pure-Python brute force (only where 3^n is small) and a pure-Python greedy;
the table gives their time as a ratio to the DP and their exposed time against the DP's.
The provisioner solves the planner at every decision (nothing is reused between decisions);
its ``report()["decision_latency_us"]`` measures whole decisions in a run.

    python benchmarks/decision_latency.py --out decision_latency.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from typing import Callable, Dict, List, Sequence

import numpy as np

from bagualu2 import _C
from bagualu2.plan.overlap import OverlapOp, OverlapScheduler, OverlapTask, TaskKind
from bagualu2.plan.planner import Candidate, Choice, Planner


def make_candidates(n: int, rng: np.random.Generator) -> List[Candidate]:
    """Expert-sized activations (1..64 MiB), recompute ~ 1 ms per 16 MiB, copies at ~20 GB/s."""
    cands = []
    for i in range(n):
        nbytes = int(rng.integers(1 << 20, 1 << 26))
        cands.append(Candidate(
            key=f"layer{i // 8}.op{i % 8}", nbytes=nbytes,
            recompute_s=nbytes / 16e9 * float(rng.uniform(0.5, 2.0)),
            offload_s=nbytes / 20e9, reload_s=nbytes / 20e9,
            can_offload=bool(rng.random() > 0.1), can_recompute=bool(rng.random() > 0.1)))
    return cands


def exposed(cands: Sequence[Candidate], choice: Dict[str, Choice], wf: float, wb: float) -> float:
    return Planner.exposed_time(cands, choice, wf, wb)


def brute_force(cands: Sequence[Candidate], must: int, wf: float, wb: float) -> float:
    best = float("inf")
    for combo in itertools.product(list(Choice), repeat=len(cands)):
        if any((c == Choice.OFFLOAD and not x.can_offload) or
               (c == Choice.RECOMPUTE and not x.can_recompute) for c, x in zip(combo, cands)):
            continue
        if sum(x.nbytes for c, x in zip(combo, cands) if c != Choice.KEEP) < must:
            continue
        best = min(best, exposed(cands, {x.key: c for c, x in zip(combo, cands)}, wf, wb))
    return best


def greedy(cands: Sequence[Candidate], must: int, wf: float, wb: float) -> float:
    """Release the op with the least marginal exposed time per byte until enough is freed."""
    choice = {c.key: Choice.KEEP for c in cands}
    freed, left = 0, list(cands)
    cur = 0.0
    while freed < must and left:
        best = None
        for c in left:
            for ch in (Choice.OFFLOAD, Choice.RECOMPUTE):
                if (ch == Choice.OFFLOAD and not c.can_offload) or \
                        (ch == Choice.RECOMPUTE and not c.can_recompute):
                    continue
                choice[c.key] = ch
                delta = exposed(cands, choice, wf, wb) - cur
                choice[c.key] = Choice.KEEP
                score = delta / max(1, min(c.nbytes, must - freed))
                if best is None or score < best[0]:
                    best = (score, c, ch, delta)
        if best is None:
            break
        _, c, ch, delta = best
        choice[c.key] = ch
        cur += delta
        freed += c.nbytes
        left.remove(c)
    return exposed(cands, choice, wf, wb)


def timed(fn: Callable[[], object], reps: int) -> List[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="decision_latency.json")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"{'ops':>5} {'DP us (median)':>15} {'p90 us':>8} {'C++ us':>8} {'setup us':>9} "
          f"{'large setup us':>15} {'greedy us':>10} "
          f"{'greedy/DP':>9} {'greedy gap':>10} {'brute/DP':>9} {'DP gap vs brute':>15}")
    for n in [int(s) for s in args.sizes.split(",")]:
        cands = make_candidates(n, rng)
        total = sum(c.nbytes for c in cands)
        must = total // 2
        wf = wb = 0.25 * sum(c.offload_s for c in cands)  # copies only partly hidden
        planner = Planner()
        bare = _C.Planner(0, 0.0, 0)  # what Planner() wraps: automatic quanta and cell cap
        dp = timed(lambda: planner.solve(cands, must, wf, wb), args.reps)
        cols = ([c.key for c in cands], [c.nbytes for c in cands], [c.recompute_s for c in cands],
                [c.offload_s for c in cands], [c.reload_s for c in cands],
                [c.can_offload for c in cands], [c.can_recompute for c in cands])
        raw = timed(lambda: bare.solve_columns(*cols, must, wf, wb), args.reps)
        plan = planner.solve(cands, must, wf, wb)
        # setups the best plan pays (it offloads): a small one, and a large one for which the
        # planner also solves the plan without offloads
        with_setup = timed(lambda: planner.solve(cands, must, wf, wb, 0.1 * plan.exposed_s), args.reps)
        large_setup = timed(lambda: planner.solve(cands, must, wf, wb, 10 * plan.exposed_s), args.reps)
        g_reps = max(1, min(args.reps, 2000 // n))
        gt = timed(lambda: greedy(cands, must, wf, wb), g_reps)
        g_exp = greedy(cands, must, wf, wb)
        row = dict(ops=n, dp_median_us=statistics.median(dp) * 1e6,
                   dp_p90_us=float(np.percentile(dp, 90)) * 1e6,
                   cpp_median_us=statistics.median(raw) * 1e6,
                   setup_median_us=statistics.median(with_setup) * 1e6,
                   large_setup_median_us=statistics.median(large_setup) * 1e6,
                   setup_plan_offloads=plan.mix()[Choice.OFFLOAD] > 0,
                   greedy_median_us=statistics.median(gt) * 1e6,
                   dp_exposed_s=plan.exposed_s, greedy_exposed_s=g_exp,
                   quantum_bytes=plan.quantum_bytes, feasible=plan.feasible)
        row["greedy_over_dp_time"] = row["greedy_median_us"] / row["dp_median_us"]
        row["greedy_gap_pct"] = 100 * (g_exp - plan.exposed_s) / max(plan.exposed_s, 1e-12)
        brute = ""
        if n <= 8:
            bt = timed(lambda: brute_force(cands, must, wf, wb), 1)[0]
            b_exp = brute_force(cands, must, wf, wb)
            row.update(brute_us=bt * 1e6, brute_exposed_s=b_exp,
                       brute_over_dp_time=bt * 1e6 / row["dp_median_us"],
                       dp_gap_vs_brute_pct=100 * (plan.exposed_s - b_exp) / max(b_exp, 1e-12))
            brute = f"{row['brute_over_dp_time']:>9.0f} {row['dp_gap_vs_brute_pct']:>14.2f}%"
        rows.append(row)
        print(f"{n:>5} {row['dp_median_us']:>15.1f} {row['dp_p90_us']:>8.1f} "
              f"{row['cpp_median_us']:>8.1f} {row['setup_median_us']:>9.1f} "
              f"{row['large_setup_median_us']:>15.1f} {row['greedy_median_us']:>10.1f} "
              f"{row['greedy_over_dp_time']:>9.1f} {row['greedy_gap_pct']:>9.2f}% {brute}")
    print("(DP us: Planner.solve; C++ us: bagualu2._C.Planner.solve_columns, the DP it calls, on prebuilt columns)")

    # overlap scheduler: a 1F1B steady-state step (forward of A, bubble, backward of B)
    ops = [OverlapOp(1e-3, 1 << 30) for _ in range(16)] + [OverlapOp(2e-3, 0, bubble=True)] + \
          [OverlapOp(2e-3, 1 << 30) for _ in range(16)]
    tasks = [OverlapTask(TaskKind.OFFLOAD, i, 1.5e-3, 64 << 20) for i in range(0, 16, 2)] + \
            [OverlapTask(TaskKind.RELOAD, 17 + i, 2.5e-3, 64 << 20) for i in range(0, 16, 2)] + \
            [OverlapTask(TaskKind.RECOMPUTE, 18 + i, 1e-3, 64 << 20) for i in range(0, 16, 4)]
    sch = OverlapScheduler()
    ov = timed(lambda: sch.schedule(ops, tasks, (1 << 30) + (320 << 20)), max(5, args.reps // 5))
    s = sch.schedule(ops, tasks, (1 << 30) + (320 << 20))
    hit = timed(lambda: sch.schedule(ops, tasks, 0, cache_key=(0, 0, 1, 5)), args.reps)
    print(f"\noverlap scheduler, {len(ops)} ops / {len(tasks)} tasks: "
          f"{statistics.median(ov) * 1e6:.0f} us cold (exposed {s.exposed_s * 1e3:.2f} ms, "
          f"feasible {s.feasible}), {statistics.median(hit[1:]) * 1e6:.1f} us cached")

    result = dict(machine=platform.platform(), processor=platform.processor(), reps=args.reps,
                  planner=rows,
                  overlap=dict(ops=len(ops), tasks=len(tasks),
                               cold_median_us=statistics.median(ov) * 1e6,
                               cached_median_us=statistics.median(hit[1:]) * 1e6,
                               exposed_s=s.exposed_s, feasible=s.feasible))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
