"""Soak: a long adaptive training run through random routing spikes, for leaks and violations.

Trains the reference MoE model for ``--micro-batches`` micro-batches (default 10,000; one
forward, backward and SGD step each) under a budget ``--slack`` (5%) above the calm peak (the
all-keep activation high-water mark of calm micro-batches). About ``--spike-rate`` (3%) of the
micro-batches are spikes: one local expert, chosen at random, gets 1.5x to 3x the mean load
(``routing_spike``). Reports:

* budget violations (must be 0) and the peak against the budget;
* the process's anonymous resident set (RSS: heap, arena and tensors, not the libraries' pages),
  the host arena (in use, capacity) and the ledger (resident activation bytes) at the start
  (after the first micro-batch), the middle and the end (with the last graph dropped): RSS and
  arena growth from the middle to the end must stay under 1%,
  ledger and arena in use must be 0 at the end;
* decision latency p50/p99 (every decision of the run, not only the telemetry's window);
* how many micro-batches were traced (calm ones need not be), and the step time.

Prints a table and writes JSON::

    python benchmarks/soak.py --config tiny --micro-batches 10000 --out soak.json

``--pressure``: the reference model with real expert parallelism on 2 gloo ranks (experts
``--expert-hidden`` wide), each rank under its own budget ``--slack`` above its calm keep-all
peak; about ``--spike-rate`` of the micro-batches spike (every rank's tokens give one expert,
on a rank drawn at random, ``--pressure-spike`` x the mean load, for ``--burst`` micro-batches in a
row, as a hot expert stays hot for a while), and the routing drifts slowly
(a bias on the router's logits that turns once over the run). Per rank: violations,
micro-batches planned (a gate's plan released something), the cost model's peak-prediction
error (relative, on micro-batches that released nothing: its prediction is the all-keep peak)
over the first and the last 1000 (or tenth), arena/ledger/RSS at start, middle and end, and
decision latency p50/p99::

    python benchmarks/soak.py --pressure --micro-batches 10000 --out soak_pressure.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import json
import math
import os
import tempfile
import random
import statistics
import time
from typing import Any, Dict, List

import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.telemetry import Decision


# The telemetry keeps its last records in memory (100,000 of each kind by default): a window
# that fills over the first tens of thousands of micro-batches, and would read as growth here.
_TELEMETRY_KEEP = 200


def _rss_bytes() -> int:
    """The anonymous resident set (heap, arena, tensors): where a leak grows. The whole RSS also
    counts file-backed pages (the libraries' code), which the kernel drops and reloads as other
    processes need memory, and which moved it by a fifth in a long run on a busy machine."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line: the soak needs Linux's procfs")


def _batch(cfg: MoEConfig, args: argparse.Namespace, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
    return torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)


def _calm_peak(model: MoETransformer, cfg: MoEConfig, args: argparse.Namespace) -> int:
    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    for i in range(4):
        probe(_batch(cfg, args, -1 - i)).backward()
    peak = prov.report()["peak_bytes"]
    prov.disable()
    return peak


def _note_snapshot(snapshots: Dict[str, Any], i: int, micro_batches: int, prov: Any) -> None:
    """The start and middle snapshots of a run, taken after micro-batch ``i``."""
    if i == 0:
        snapshots["start"] = _snapshot(prov)
    elif i == micro_batches // 2:
        snapshots["middle"] = _snapshot(prov)


def _snapshot(prov: Any) -> Dict[str, int]:
    gc.collect()
    report = prov.report()
    return {"rss_bytes": _rss_bytes(), "arena_in_use_bytes": report["arena_in_use_bytes"],
            "arena_capacity_bytes": report["arena_capacity_bytes"], "ledger_bytes": report["resident_bytes"]}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """The soak run; returns the result dict (what ``main`` prints and writes)."""
    cfg = getattr(MoEConfig, args.config)()
    torch.manual_seed(args.seed)
    model = MoETransformer(cfg)
    calm = _calm_peak(model, cfg, args)
    budget = int(calm * (1.0 + args.slack))
    prov = bagualu2.enable(model, budget=budget)
    prov.telemetry.keep = _TELEMETRY_KEEP
    latencies: List[float] = []
    add = prov.telemetry.add

    def record(item: Any) -> None:  # every decision's latency, not only the telemetry's window
        if isinstance(item, Decision):
            latencies.append(item.latency_us)
        add(item)

    prov.telemetry.add = record  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    rng = random.Random(args.seed)
    limit = cfg.num_experts / cfg.top_k  # an expert takes each token at most once
    snapshots: Dict[str, Dict[str, int]] = {}
    spikes = 0
    start = time.perf_counter()
    for i in range(args.micro_batches):
        tokens = _batch(cfg, args, i)
        spike = rng.random() < args.spike_rate
        optimizer.zero_grad(set_to_none=True)
        if spike:
            spikes += 1
            factor = min(limit, rng.uniform(args.spike_min, args.spike_max))
            with model.routing_spike(factor, experts=(rng.randrange(cfg.num_experts),)):
                model(tokens).backward()
        else:
            model(tokens).backward()
        optimizer.step()
        prov.step()
        _note_snapshot(snapshots, i, args.micro_batches, prov)
        if args.progress and (i + 1) % args.progress == 0:
            r = prov.report()
            print(f"  {i + 1:>7} micro-batches  violations {r['violations']}  traced {r['traced_micro_batches']}"
                  f"  RSS {_rss_bytes() / 2**20:.1f} MiB", flush=True)
    seconds = time.perf_counter() - start
    snapshots["end"] = _snapshot(prov)
    snapshots.setdefault("middle", snapshots["end"])
    report = prov.report()

    def growth(key: str, a: str, b: str) -> float:
        return (snapshots[b][key] - snapshots[a][key]) / max(1, snapshots[a][key])

    lat = sorted(latencies)
    result = {
        "config": args.config, "micro_batches": args.micro_batches, "batch": args.batch, "seq": args.seq,
        "seed": args.seed, "spike_rate": args.spike_rate, "spikes": spikes, "calm_peak_bytes": calm,
        "budget_bytes": budget, "peak_bytes": report["peak_bytes"],
        "peak_bytes_with_backward": report["peak_bytes_with_backward"], "violations": report["violations"],
        "traced_micro_batches": report["traced_micro_batches"], "decisions": len(lat),
        "decision_latency_us": {"p50": lat[len(lat) // 2] if lat else 0.0,
                                "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
                                "max": lat[-1] if lat else 0.0},
        "seconds": seconds, "ms_per_micro_batch": 1000 * seconds / max(1, args.micro_batches),
        "snapshots": snapshots,
        "rss_growth_middle_to_end": growth("rss_bytes", "middle", "end"),
        "rss_growth_start_to_end": growth("rss_bytes", "start", "end"),
        "arena_capacity_growth_middle_to_end": growth("arena_capacity_bytes", "middle", "end"),
        "saved_bytes_by_choice": report["saved_bytes_by_choice"], "fallbacks": report["fallbacks"],
    }
    result["ok"] = (result["violations"] == 0 and snapshots["end"]["ledger_bytes"] == 0
                    and snapshots["end"]["arena_in_use_bytes"] == 0
                    and result["rss_growth_middle_to_end"] < 0.01
                    and result["arena_capacity_growth_middle_to_end"] < 0.01)
    return result


# -- --pressure: 2 expert-parallel gloo ranks ---------------------------------------------------


def _recorder(prov: Any, window: int) -> Dict[str, Any]:
    """Every decision's latency and plan, and the peak and prediction of the first and the last
    ``window`` micro-batches (only those: the recorder must not grow with the run it measures)."""
    seen: Dict[str, Any] = {"latency": [], "planned": set(), "first": [],
                            "last": collections.deque(maxlen=window)}
    add = prov.telemetry.add

    def record(item: Any) -> None:
        if isinstance(item, Decision):
            seen["latency"].append(item.latency_us)
            if item.planned_bytes < item.predicted_bytes:
                seen["planned"].add(item.micro_batch)
        else:
            released = item.bytes_by_choice.get("offload", 0) + item.bytes_by_choice.get("recompute", 0)
            peak = (item.peak_bytes, item.predicted_peak_bytes, released)
            seen["first" if len(seen["first"]) < window else "last"].append(peak)
        add(item)

    prov.telemetry.add = record  # type: ignore[method-assign]
    return seen


def _prediction_error(peaks: List[Any]) -> Dict[str, Any]:
    """Mean relative error of the predicted all-keep peak on micro-batches that kept all."""
    errors = [abs(pred - peak) / peak for peak, pred, released in peaks if pred and peak and not released]
    return {"mean": statistics.fmean(errors) if errors else None, "n": len(errors)}


def _pressure_rank(rank: int, world: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file store, not a TCP one: the reason is at tests/pipeline_harness.py's store_init_method.
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"), rank=rank,
                            world_size=world)
    cfg = getattr(MoEConfig, args.config)(expert_hidden_size=args.expert_hidden)

    def build() -> MoETransformer:
        torch.manual_seed(args.seed)
        return MoETransformer(cfg, ep_group=dist.group.WORLD)

    probe = build()
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    for i in range(4):
        probe(_batch(cfg, args, -1 - i - 100 * rank)).backward()
    calm = prov.report()["peak_bytes"]
    prov.disable()
    budget = int(calm * (1.0 + args.slack))
    model = build()
    # Every save of this small model is under the default min_bytes (64 KiB), which would leave
    # the planner nothing to choose from and the runtime's fallbacks all the work.
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    prov.telemetry.keep = _TELEMETRY_KEEP
    window = min(1000, max(1, args.micro_batches // 10))
    seen = _recorder(prov, window)
    drift = torch.zeros(cfg.num_experts)
    for layer in model.layers:  # the drift: every rank's routers lean the same slowly turning way
        layer.moe.router.proj.register_forward_hook(lambda m, a, out: out + drift)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    rng = random.Random(args.seed)  # the same draws on every rank: spikes are entered together
    local = cfg.num_experts // world
    limit = min(cfg.num_experts / cfg.top_k, args.pressure_spike)
    snapshots: Dict[str, Dict[str, int]] = {}
    spikes = [0] * world
    phases = [2 * math.pi * e / cfg.num_experts for e in range(cfg.num_experts)]
    start = time.perf_counter()
    burst_left, target, expert = 0, 0, 0
    for i in range(args.micro_batches):
        turn = 2 * math.pi * i / max(1, args.micro_batches)
        drift.copy_(torch.tensor([args.drift * math.sin(turn + p) for p in phases]))
        # A burst starts at spike_rate / burst per micro-batch, so that about spike_rate of them spike.
        if burst_left == 0 and rng.random() < args.spike_rate / args.burst:
            burst_left = args.burst
            target = rng.randrange(world)
            expert = target * local + rng.randrange(local)
        spike = burst_left > 0
        burst_left -= spike
        optimizer.zero_grad(set_to_none=True)
        tokens = _batch(cfg, args, 1_000_000 * rank + i)
        with model.routing_spike(limit, experts=(expert,)) if spike else contextlib.nullcontext():
            model(tokens).backward()
        spikes[target] += spike
        optimizer.step()
        prov.step()
        _note_snapshot(snapshots, i, args.micro_batches, prov)
        if rank == 0 and args.progress and (i + 1) % args.progress == 0:
            print(f"  {i + 1:>7} micro-batches  violations {prov.report()['violations']}  "
                  f"RSS {_rss_bytes() / 2**20:.1f} MiB", flush=True)
    seconds = time.perf_counter() - start
    snapshots["end"] = _snapshot(prov)
    snapshots.setdefault("middle", snapshots["end"])
    report = prov.report()
    lat = sorted(seen["latency"])
    result = {
        "rank": rank, "calm_peak_bytes": calm, "budget_bytes": budget, "peak_bytes": report["peak_bytes"],
        "violations": report["violations"], "fallbacks": report["fallbacks"], "spikes_aimed_here": spikes[rank],
        "planned_micro_batches": len(seen["planned"]), "traced_micro_batches": report["traced_micro_batches"],
        "decisions": len(lat), "prediction_window": window,
        "peak_prediction_error_first": _prediction_error(seen["first"]),
        "peak_prediction_error_last": _prediction_error(seen["last"]),
        "decision_latency_us": {"p50": lat[len(lat) // 2] if lat else 0.0,
                                "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0},
        "snapshots": snapshots, "ms_per_micro_batch": 1000 * seconds / max(1, args.micro_batches),
        "rss_growth_middle_to_end": (snapshots["end"]["rss_bytes"] - snapshots["middle"]["rss_bytes"])
        / max(1, snapshots["middle"]["rss_bytes"]),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_pressure(args: argparse.Namespace, world: int = 2) -> Dict[str, Any]:
    """The pressure soak on ``world`` gloo ranks; returns ``{"ranks": [per-rank result], ...}``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_pressure_rank, args=(world, args, out_dir), nprocs=world, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    ok = all(r["violations"] == 0 and r["snapshots"]["end"]["ledger_bytes"] == 0
             and r["snapshots"]["end"]["arena_in_use_bytes"] == 0 and r["rss_growth_middle_to_end"] < 0.01
             for r in ranks)
    return {"pressure": True, "config": args.config, "expert_hidden": args.expert_hidden,
            "micro_batches": args.micro_batches, "spike_rate": args.spike_rate, "spike": args.pressure_spike,
            "drift": args.drift, "burst": args.burst, "slack": args.slack, "seed": args.seed, "ranks": ranks, "ok": ok}


def _print_pressure(result: Dict[str, Any]) -> None:
    def err(e: Dict[str, Any]) -> str:
        return f"{e['mean']:.2%} (n={e['n']})" if e["mean"] is not None else "-"

    print(f"\n{result['micro_batches']} micro-batches, 2 EP ranks, spikes {result['spike']}x in bursts of "
          f"{result['burst']} at rate {result['spike_rate']}, budget calm peak + {result['slack']:.0%}")
    print(f"{'rank':<5}{'viol.':>6}{'planned':>8}{'fallbacks':>10}{'spikes':>7}{'pred. err first':>20}"
          f"{'pred. err last':>20}{'lat p50 us':>11}{'p99 us':>8}{'ms/mb':>7}")
    for r in result["ranks"]:
        lat = r["decision_latency_us"]
        print(f"{r['rank']:<5}{r['violations']:>6}{r['planned_micro_batches']:>8}{r['fallbacks']:>10}"
              f"{r['spikes_aimed_here']:>7}"
              f"{err(r['peak_prediction_error_first']):>20}{err(r['peak_prediction_error_last']):>20}"
              f"{lat['p50']:>11.0f}{lat['p99']:>8.0f}{r['ms_per_micro_batch']:>7.1f}")
    print(f"{'rank':<5}{'when':<8}{'anon RSS MiB':>13}{'arena in use':>14}{'arena cap. MiB':>16}{'ledger bytes':>14}")
    for r in result["ranks"]:
        for name in ("start", "middle", "end"):
            s = r["snapshots"][name]
            print(f"{r['rank']:<5}{name:<8}{s['rss_bytes'] / 2**20:>13.1f}{s['arena_in_use_bytes']:>14}"
                  f"{s['arena_capacity_bytes'] / 2**20:>16.1f}{s['ledger_bytes']:>14}")
    print("RSS growth middle->end: " + ", ".join(f"rank {r['rank']} {r['rss_growth_middle_to_end']:+.2%}"
                                                for r in result["ranks"]) + f"   {'OK' if result['ok'] else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=["tiny", "small", "bench"])
    parser.add_argument("--micro-batches", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--spike-rate", type=float, default=0.03)
    parser.add_argument("--spike-min", type=float, default=1.5)
    parser.add_argument("--spike-max", type=float, default=3.0)
    parser.add_argument("--slack", type=float, default=0.05, help="budget above the calm peak (fraction)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", type=int, default=1000, help="print a line every that many (0: never)")
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--pressure", action="store_true", help="2 expert-parallel gloo ranks under pressure")
    parser.add_argument("--expert-hidden", type=int, default=128, help="--pressure: expert width")
    parser.add_argument("--pressure-spike", type=float, default=2.6, help="--pressure: a spike's load (x mean)")
    parser.add_argument("--drift", type=float, default=0.5, help="--pressure: the drift's amplitude (logits)")
    parser.add_argument("--burst", type=int, default=4,
                        help="--pressure: micro-batches a spike lasts (a lone spike meets an untraced forward "
                             "and is held by offload; from a burst's second micro-batch on, gates plan)")
    args = parser.parse_args()
    if args.burst < 1:
        parser.error(f"--burst {args.burst}: a spike lasts at least 1 micro-batch")
    if args.pressure:
        result = run_pressure(args)
        _print_pressure(result)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
        return
    result = run(args)
    s = result["snapshots"]
    print()
    print(f"{args.micro_batches} micro-batches of {args.config} ({args.batch} x {args.seq}), {result['spikes']} spikes, "
          f"budget {result['budget_bytes'] / 2**20:.2f} MiB (calm peak + {args.slack:.0%})")
    print(f"{'':<10}{'anon RSS MiB':>13}{'arena in use':>14}{'arena cap. MiB':>16}{'ledger bytes':>14}")
    for name in ("start", "middle", "end"):
        print(f"{name:<10}{s[name]['rss_bytes'] / 2**20:>13.1f}{s[name]['arena_in_use_bytes']:>14}"
              f"{s[name]['arena_capacity_bytes'] / 2**20:>16.1f}{s[name]['ledger_bytes']:>14}")
    lat = result["decision_latency_us"]
    print(f"violations {result['violations']}   peak {result['peak_bytes'] / 2**20:.2f} MiB   "
          f"traced {result['traced_micro_batches']}   decisions {result['decisions']} "
          f"(p50 {lat['p50']:.0f} us, p99 {lat['p99']:.0f} us)   {result['ms_per_micro_batch']:.1f} ms/micro-batch")
    print(f"RSS growth middle->end {result['rss_growth_middle_to_end']:+.2%} (start->end "
          f"{result['rss_growth_start_to_end']:+.2%})   {'OK' if result['ok'] else 'FAIL'}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
