"""Soak: a long adaptive training run through random routing spikes, for leaks and violations.

Trains the reference MoE model for ``--micro-batches`` micro-batches (default 10,000; one
forward, backward and SGD step each) under a budget ``--slack`` (5%) above the calm peak (the
all-keep activation high-water mark of calm micro-batches). About ``--spike-rate`` (3%) of the
micro-batches are spikes: one local expert, chosen at random, gets 1.5x to 3x the mean load
(``routing_spike``). Reports:

* budget violations (must be 0) and the peak against the budget;
* the process's resident set (RSS), the host arena (in use, capacity) and the ledger (resident
  activation bytes) at the start (after the first micro-batch), the middle and the end (with
  the last graph dropped): RSS and arena growth from the middle to the end must stay under 1%,
  ledger and arena in use must be 0 at the end;
* decision latency p50/p99 (every decision of the run, not only the telemetry's window);
* how many micro-batches were traced (calm ones need not be), and the step time.

Prints a table and writes JSON::

    python benchmarks/soak.py --config tiny --micro-batches 10000 --out soak.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import random
import statistics
import time
from typing import Any, Dict, List

import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.telemetry import Decision


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
        if i == 0:
            snapshots["start"] = _snapshot(prov)
        elif i == args.micro_batches // 2:
            snapshots["middle"] = _snapshot(prov)
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
    args = parser.parse_args()
    result = run(args)
    s = result["snapshots"]
    print()
    print(f"{args.micro_batches} micro-batches of {args.config} ({args.batch} x {args.seq}), {result['spikes']} spikes, "
          f"budget {result['budget_bytes'] / 2**20:.2f} MiB (calm peak + {args.slack:.0%})")
    print(f"{'':<10}{'RSS MiB':>10}{'arena in use':>14}{'arena cap. MiB':>16}{'ledger bytes':>14}")
    for name in ("start", "middle", "end"):
        print(f"{name:<10}{s[name]['rss_bytes'] / 2**20:>10.1f}{s[name]['arena_in_use_bytes']:>14}"
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
