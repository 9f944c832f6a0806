"""A routing spike on one EP rank's experts: per-rank peak against the budget, step time of
adaptive, recompute_all and keep_all, decision latency with the count exchange.

The reference model with real expert parallelism (``MoETransformer(cfg, ep_group=...)``) runs on
``--world`` gloo processes (127.0.0.1, one thread each). Every ``--spike-every``-th step rank 0's
tokens all pick the last expert of rank 1 (``routing_spike(4.0, experts=[e], ranks=[0])``), so
rank 1's experts compute more while its own routing stays calm: only the count exchange tells it.
Each rank's budget is ``--headroom`` above what keeping everything needs on that rank without
the spike (a calm keep_all pass first, after its ``--warmup`` steps).

Per policy (``plain``: no bagualu2; ``keep_all`` under the budget, recorded not raised, to show
what it would do on a device; ``recompute_all``; ``adaptive`` under the budget), over the same
steps on a fresh model from the same seed: the median step time (forward + backward, the ranks
aligned by a barrier before each step, the slowest rank's time), and per rank the activation
peak against the budget and the violations. The first ``--warmup`` steps (adaptive's profiling
and calibration) are not timed.

Decision latency on an EP rank is the count exchange (an ``all_to_all`` of ``num_experts`` ints,
timed inside the dispatcher's forward, which the token exchange needs in any case) plus the
provisioner's decision at the dispatcher's hook (``report()["decision_latency_us"]``). A rank
that reaches the exchange first waits there for the others (the skew that the token exchange
would wait for anyway): the exchange's own cost is the time of the rank that came last, the
smallest of the ranks' times for the same exchange, reported beside the median wait of all
ranks. Beside it, ``--exchange-reps`` bare ``all_to_all_single`` and ``all_reduce`` of the
counts (the alternative the design names for engines without a count exchange).

    python benchmarks/ep_spike.py --world 2,4 --out ep_spike.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import bagualu2
from bagualu2 import pipeline as pp
from bagualu2.models import MoEConfig, MoETransformer

POLICIES = ("plain", "keep_all", "recompute_all", "adaptive")
SEED = 0


def _tokens(cfg: MoEConfig, rank: int, step: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _time_exchange(model: MoETransformer) -> List[float]:
    """Seconds of every count exchange (dispatcher forward) of the model, appended as they run."""
    times: List[float] = []
    for layer in model.layers:
        dispatcher = layer.moe.dispatcher
        dispatcher.register_forward_pre_hook(lambda m, a: setattr(m, "_t0", time.perf_counter()))
        dispatcher.register_forward_hook(lambda m, a, o: times.append(time.perf_counter() - m._t0))
    return times


def _run_policy(rank: int, world: int, args: argparse.Namespace, policy: str, budget: Any,
                calm: bool = False) -> Dict[str, Any]:
    cfg = getattr(MoEConfig, args.config)()
    torch.manual_seed(SEED)
    model = MoETransformer(cfg, ep_group=dist.group.WORLD)
    exchange = _time_exchange(model)
    prov = None
    if policy != "plain":
        prov = bagualu2.enable(model, budget=None if policy == "keep_all" and calm else budget,
                               policy=policy, min_bytes=0)
    target = model.experts_on_rank(1)[-1]
    step_s: List[float] = []
    for i in range(args.warmup + args.steps):
        spiked = not calm and i >= args.warmup and (i - args.warmup) % args.spike_every == args.spike_every - 1
        spike = (model.routing_spike(4.0, experts=[target], ranks=[0]) if spiked else contextlib.nullcontext())
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        with spike:
            loss = model(_tokens(cfg, rank, i, args.batch, args.seq))
            loss.backward()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        if i >= args.warmup:
            step_s.append(float(elapsed))
        if prov is not None:
            prov.step()
    out: Dict[str, Any] = {"step_s": statistics.median(step_s) if step_s else 0.0, "exchange_s": exchange}
    if prov is not None:
        gc.collect()
        prov.runtime.settle(wait=True)
        report = prov.report()
        # The steady calm peak: profiled micro-batches (the first, traced) hold more than the
        # untraced ones of keep_all at the same load, which would hide the spike in the budget.
        steady = [m.peak_bytes for m in prov.telemetry.micro_batches[args.warmup:]]
        out.update(peak_bytes=report["peak_bytes"], budget_bytes=report["budget_bytes"],
                   steady_peak_bytes=max(steady, default=report["peak_bytes"]),
                   violations=report["violations"], decisions=report["decisions"],
                   decision_us=report["decision_latency_us"],
                   saved_bytes_by_choice=report["saved_bytes_by_choice"],
                   resident_after=report["resident_bytes"])
        prov.disable()
    return out


def _bare_exchange(world: int, num_experts: int, reps: int) -> Dict[str, float]:
    counts = torch.arange(num_experts, dtype=torch.int64)
    received = torch.empty_like(counts)
    result = {}
    for name, op in (("all_to_all_us", lambda: dist.all_to_all_single(received, counts)),
                     ("all_reduce_us", lambda: dist.all_reduce(counts.clone()))):
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        result[name] = statistics.median(times) * 1e6
    return result


def _rank_main(rank: int, world: int, args: argparse.Namespace, out_path: str) -> None:
    calm = _run_policy(rank, world, args, "keep_all", None, calm=True)
    budget = int(calm["steady_peak_bytes"] * (1.0 + args.headroom))
    rows = {policy: _run_policy(rank, world, args, policy, budget) for policy in POLICIES}
    rows["bare"] = _bare_exchange(world, getattr(MoEConfig, args.config)().num_experts, args.exchange_reps)
    rows["calm_peak_bytes"] = calm["steady_peak_bytes"]
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def run_world(world: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.json")
        pp.launch(_rank_main, world, args, path, timeout_s=args.timeout)
        with open(path) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="2,4", help="comma-separated EP group sizes (gloo processes)")
    ap.add_argument("--config", default="small", choices=("tiny", "small", "bench"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per policy")
    ap.add_argument("--warmup", type=int, default=6, help="untimed calm steps first (profiling, calibration)")
    ap.add_argument("--spike-every", type=int, default=3)
    ap.add_argument("--headroom", type=float, default=0.05, help="budget above the calm keep_all peak")
    ap.add_argument("--exchange-reps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default="ep_spike.json")
    args = ap.parse_args()
    results: Dict[str, Any] = {"args": vars(args), "machine": platform.platform(),
                               "torch": torch.__version__, "worlds": {}}
    for world in [int(w) for w in args.world.split(",")]:
        ranks = run_world(world, args)
        results["worlds"][str(world)] = ranks
        plain = ranks[0]["plain"]["step_s"]
        print(f"\nEP={world}, config {args.config}, batch {args.batch}x{args.seq}, spike every "
              f"{args.spike_every} steps: rank 0's tokens -> last expert of rank 1")
        print(f"{'policy':<14} {'step ms':>8} {'vs plain':>9}  " + "  ".join(
            f"{f'rank {r} peak/budget':>19} {'viol':>4}" for r in range(world)))
        for policy in POLICIES:
            row = ranks[0][policy]
            cells = []
            for r in range(world):
                got = ranks[r][policy]
                if "peak_bytes" in got:
                    cells.append(f"{got['peak_bytes'] / got['budget_bytes']:>19.3f} {got['violations']:>4}")
                else:
                    cells.append(f"{'-':>19} {'-':>4}")
            print(f"{policy:<14} {row['step_s'] * 1e3:>8.1f} {row['step_s'] / plain:>8.3f}x  " + "  ".join(cells))
        # One exchange per layer per forward, in the same order on every rank.
        per_rank = [ranks[r]["adaptive"]["exchange_s"] for r in range(world)]
        last = [min(times) for times in zip(*per_rank)]
        exchange_us = statistics.median(last) * 1e6
        best_us = min(last) * 1e6
        waits_us = statistics.median(t for times in per_rank for t in times) * 1e6
        ranks[0]["adaptive"]["exchange_us"] = {"last_arriver_median": exchange_us, "last_arriver_min": best_us,
                                               "all_ranks_median": waits_us}
        print(f"count exchange per layer: {exchange_us:.1f} us median, {best_us:.1f} us best (the last rank "
              f"to arrive); median wait over all ranks {waits_us:.1f} us")
        print(f"{'rank':<6} {'decide us (mean/p50/max)':>26} {'decisions':>10} "
              f"{'decide + exchange us':>21} {'bare a2a us':>12} {'bare allreduce us':>18}")
        for r in range(world):
            ad = ranks[r]["adaptive"]
            d = ad["decision_us"]
            print(f"{r:<6} {d['mean']:>10.1f}/{d['p50']:>6.1f}/{d['max']:>7.1f} {ad['decisions']:>10} "
                  f"{d['mean'] + exchange_us:>21.1f} {ranks[r]['bare']['all_to_all_us']:>12.1f} "
                  f"{ranks[r]['bare']['all_reduce_us']:>18.1f}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
