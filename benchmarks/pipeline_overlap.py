"""Pipeline step time, exposed copy time and recompute time with the overlap scheduler on and off.

A gloo pipeline (2 or 4 CPU processes, 127.0.0.1) of the reference MoE model under one
schedule (1F1B by default). Every mode runs the same steps from the same weights:

  plain              the pipeline without bagualu2
  keep_all           bagualu2 enabled, everything kept (the machinery's own cost)
  offload_all        everything releasable offloaded to the host arena; backward reloads with
                     the runtime's own prefetch (from the first unpack on, 64 MiB ahead)
  recompute_all      everything releasable recomputed in backward
  adaptive           tight budget per rank (halfway between recompute_all's and keep_all's
                     peaks by default)
  <mode>+ovl         the same with the overlap scheduler (enable_bagualu2(pipe, overlap=True)):
                     each forward that precedes another micro-batch's backward is planned with
                     it; reloads are issued during that forward and the bubble, recomputes may
                     run in the bubble

Per rank and mode it measures, over --steps timed steps after one warm-up step:
  step_s       wall time of schedule.step (the slowest rank's is the pipeline's)
  reload_s     time backward's unpack hooks spent on offloaded activations (exposed copy, H2D side)
  offload_s    time forward's pack hooks spent offloading (submitting copies, waiting for them
               where the budget leaves no room beside them: exposed copy, D2H side)
  recompute_s  time backward's unpack hooks spent rebuilding recomputed activations
  idle_s       time between this rank's compute actions (bubbles and p2p waits)
  peak_bytes   the rank's activation high-water mark (bagualu2's exact accounting)
The three exposed times come from the runtime's hook timing (a ``runtime.on_hook`` subscriber).
With the scheduler, the driver's counters say where reloads were issued, how many recomputes
ran early, the DP's decision time and its predicted exposed time against lazy issue.

Prints a table and writes JSON (--json, default benchmarks/results/pipeline_overlap.json).
On this CPU machine copies are memcpy by worker threads and compete with compute for the same
two cores; on a GPU they would use the copy engines (see docs/pipeline.md). Reloads copy back
here as on a device (``runtime.residency.reload_in_place = False``), though on cpu bagualu2 otherwise
reads offloaded bytes in place.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bagualu2.integrations import pipeline as pp
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches

# The tests' multi-process harness (spawned gloo ranks on 127.0.0.1, a free port, hard timeouts);
# the spawned ranks find it on the sys.path they inherit.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from pipeline_harness import launch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, choices=(2, 4))
    p.add_argument("--schedule", default="1f1b", choices=sorted(pp.SCHEDULES))
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="adaptive budget = floor + fraction x (keep_all peak - floor), floor = recompute_all peak")
    p.add_argument("--modes", default="plain,keep_all,offload_all,offload_all+ovl,recompute_all,"
                                      "recompute_all+ovl,adaptive,adaptive+ovl")
    p.add_argument("--small", action="store_true", help="MoEConfig.small instead of bench (quick check)")
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "pipeline_overlap.json"))
    p.add_argument("--timeout", type=float, default=1800.0)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Timers around bagualu2's activation runtime (this script only)
# ---------------------------------------------------------------------------------------------

TIMERS: dict[str, float] = collections.defaultdict(float)


def _timed(hook: str, record: str, seconds: float) -> None:
    """The runtime's ``on_hook`` subscriber: pack hooks that offloaded (submitting the copy, and
    waiting for copies where the budget leaves no room beside them) and unpack hooks that
    reloaded or rebuilt."""
    name = {("pack", "offloaded"): "offload_s", ("unpack", "offloaded"): "reload_s",
            ("unpack", "recomputed"): "recompute_s"}.get((hook, record))
    if name is not None:
        TIMERS[name] += seconds


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


def _mode_kwargs(mode: str, budget: int | None) -> dict | None:
    """enable_bagualu2 keyword arguments of a mode (None: plain)."""
    if mode == "plain":
        return None
    policy, _, ovl = mode.partition("+")
    if policy not in ("keep_all", "recompute_all", "offload_all", "adaptive") or ovl not in ("", "ovl"):
        raise ValueError(f"unknown mode {mode!r}")
    kw = {"policy": policy, "overlap": ovl == "ovl"}
    if policy == "adaptive":
        kw["budget"] = budget
    return kw


def _report_value(report: dict, *names, default=None):
    for n in names:
        if n in report:
            return report[n]
    return default


def _run_mode(rank, world_size, args, mode, budget) -> dict:
    spec = pp.SCHEDULES[args.schedule]
    n_stages = spec.num_stages(world_size)
    base = MoEConfig.small if args.small else MoEConfig.bench
    cfg = base(num_layers=max(n_stages, 4), max_seq_len=max(256, args.seq))
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    bsz = args.microbatch_size * args.microbatches
    batches = list(synthetic_batches(cfg.vocab_size, bsz, args.seq + 1, seed=0, num_batches=args.steps + 1))
    pipe = pp.build_pipeline(model, args.schedule, n_microbatches=args.microbatches,
                             microbatch_example=batches[0][: args.microbatch_size, :-1])
    kwargs = _mode_kwargs(mode, budget)
    prov = pp.enable_bagualu2(pipe, arena_bytes=64 << 20, **kwargs) if kwargs is not None else None
    if prov is not None:
        prov.runtime.residency.reload_in_place = False  # copy back as on a device: the scheduler has reloads to place
        prov.runtime.on_hook.subscribe(_timed)
    # Idle time between this rank's compute actions (pipeline bubbles and p2p waits).
    idle = {"s": 0.0, "last": None}

    def on_event(event, state):
        now = time.perf_counter()
        if event == "step_begin":
            idle["last"] = None
        elif event == "action_begin":
            if idle["last"] is not None:
                idle["s"] += now - idle["last"]
        elif event == "action_end":
            idle["last"] = now

    pipe.tracker.subscribe(on_event)
    steps = []
    TIMERS.clear()
    for i, batch in enumerate(batches):
        if i == 1:
            TIMERS.clear()
            idle["s"] = 0.0
        tokens, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        pipe.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        pipe.train_step(tokens, targets)
        dt = time.perf_counter() - t0
        if i >= 1:
            steps.append(dt)
    out = {
        "mode": mode,
        "step_s": statistics.median(steps),
        "reload_s": TIMERS["reload_s"] / len(steps),
        "offload_s": TIMERS["offload_s"] / len(steps),
        "recompute_s": TIMERS["recompute_s"] / len(steps),
        "idle_s": idle["s"] / len(steps),
        "peak_bytes": None,
        "budget_bytes": budget if kwargs and "budget" in kwargs else None,
        "decision_ms": None,
        "report": None,
    }
    if prov is not None:
        rep = prov.report()
        out["peak_bytes"] = _report_value(rep, "peak_bytes", "peak", "peak_resident")
        lat = rep.get("decision_latency_us")
        out["decision_ms"] = lat["mean"] / 1e3 if isinstance(lat, dict) and rep.get("decisions") else None
        out["overlap"] = rep.get("overlap")
        out["report"] = {k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool))}
        prov.disable()
    pipe.close()
    return out


def _rank_main(rank: int, world_size: int, args: argparse.Namespace, out_path: str) -> None:
    modes = [m for m in args.modes.split(",") if m]
    results, budget = [], None
    for mode in modes:
        if mode.startswith("adaptive") and budget is None:
            peaks = {}
            for static in ("keep_all", "recompute_all"):
                mine = next((r for r in results if r["mode"] == static and r.get("rank") == rank), None)
                peaks[static] = (mine or _run_mode(rank, world_size, args, static, None))["peak_bytes"]
            # Between releasing everything and keeping everything: the plan has to choose.
            f = args.budget_fraction
            budget = int(peaks["recompute_all"] + f * (peaks["keep_all"] - peaks["recompute_all"]))
        r = _run_mode(rank, world_size, args, mode, budget)
        r["rank"] = rank
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(r, gathered, dst=0)
        if rank == 0:
            results.append(r)
            results.extend(g for g in gathered[1:])
            print(f"  {mode}: done", flush=True)
        else:
            results.append(r)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    tmp = args.json + ".ranks.tmp"
    print(f"pipeline_overlap: {args.ranks} ranks, {args.schedule}, {args.microbatches} micro-batches of "
          f"{args.microbatch_size}x{args.seq}, {'small' if args.small else 'bench'} model, gloo/CPU", flush=True)
    t0 = time.perf_counter()
    launch(_rank_main, args.ranks, args, tmp, timeout_s=args.timeout)
    with open(tmp) as f:
        rows = json.load(f)
    os.remove(tmp)
    by_mode: dict[str, list[dict]] = collections.OrderedDict()
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    plain = max((r["step_s"] for r in by_mode.get("plain", [])), default=None)
    summary = []
    hdr = (f"{'mode':<14} {'step ms':>9} {'vs plain':>8} {'reload ms':>10} {'offload ms':>10} "
           f"{'recomp ms':>10} {'idle ms':>8} {'peak KiB':>14} {'budget KiB':>14} {'decide ms':>9}")
    print(hdr)
    print("-" * len(hdr))
    for mode, rs in by_mode.items():
        step = max(r["step_s"] for r in rs)  # the pipeline runs at its slowest rank
        row = {
            "mode": mode,
            "step_s": step,
            "vs_plain": (step / plain) if plain else None,
            "reload_s": sum(r["reload_s"] for r in rs),
            "offload_s": sum(r["offload_s"] for r in rs),
            "recompute_s": sum(r["recompute_s"] for r in rs),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in sorted(rs, key=lambda r: r["rank"])],
            "budget_bytes_per_rank": [r["budget_bytes"] for r in sorted(rs, key=lambda r: r["rank"])],
            "idle_s": sum(r.get("idle_s", 0.0) for r in rs),
            "decision_ms": [r["decision_ms"] for r in rs],
        }
        summary.append(row)
        peaks = "/".join("-" if p is None else f"{p / 1024:.0f}" for p in row["peak_bytes_per_rank"])
        budgets = "/".join("-" if b is None else f"{b / 1024:.0f}" for b in row["budget_bytes_per_rank"])
        lat = [d for d in row["decision_ms"] if isinstance(d, (int, float))]
        print(f"{mode:<14} {step * 1e3:9.1f} {row['vs_plain'] or float('nan'):8.3f} "
              f"{row['reload_s'] * 1e3:10.1f} {row['offload_s'] * 1e3:10.1f} {row['recompute_s'] * 1e3:10.1f} "
              f"{row['idle_s'] * 1e3:8.1f} {peaks:>14} {budgets:>14} {(max(lat) if lat else float('nan')):9.3f}")
    print("(reload/offload/recompute/idle: summed over ranks, per step; peak/budget: per rank)")
    steps = {row["mode"]: row["step_s"] for row in summary}
    pairs = [(m, m + "+ovl") for m in steps if m + "+ovl" in steps]
    if pairs:
        print("\nscheduler on vs off (step time of the pipeline, exposed times summed over ranks):")
        print(f"{'mode':<14} {'step on/off':>11} {'reload ms off':>13} {'on':>8} {'recomp ms off':>13} {'on':>8}")
        by = {row["mode"]: row for row in summary}
        for off, on in pairs:
            a, b = by[off], by[on]
            print(f"{off:<14} {b['step_s'] / a['step_s']:11.3f} {a['reload_s'] * 1e3:13.1f} {b['reload_s'] * 1e3:8.1f} "
                  f"{a['recompute_s'] * 1e3:13.1f} {b['recompute_s'] * 1e3:8.1f}")
            for row in summary:
                if row["mode"] == on:
                    row["vs_scheduler_off"] = b["step_s"] / a["step_s"]
    ovl = [(r["mode"], r["rank"], r["overlap"]) for r in rows if r.get("overlap")]
    if ovl:
        print("\noverlap driver per rank (totals over the timed and warm-up steps):")
        print(f"{'mode':<18} {'rank':>4} {'pairs':>5} {'hits':>5} {'rel fwd':>7} {'rel bub':>7} {'rel bwd':>7} "
              f"{'deferred':>8} {'early rec':>9} {'DP ms':>7} {'pred exp ms':>11} {'lazy exp ms':>11}")
        for mode, rank, o in sorted(ovl, key=lambda x: (x[0], x[1])):
            print(f"{mode:<18} {rank:>4} {o['pairs']:>5} {o['cache_hits']:>5} {o['reloads_forward']:>7} "
                  f"{o['reloads_bubble']:>7} {o['reloads_backward']:>7} {o['reloads_deferred']:>8} "
                  f"{o['early_recomputes']:>9} {o['mean_decision_ms']:7.3f} {o['predicted_exposed_s'] * 1e3:11.2f} "
                  f"{o['predicted_lazy_exposed_s'] * 1e3:11.2f}")
    out = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "summary": summary,
        "per_rank": rows,
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
