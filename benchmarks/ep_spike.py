"""A routing spike on one EP rank's experts: per-rank peak against the budget, step time of
adaptive, recompute_all and keep_all, decision latency with the count exchange.

The reference model with real expert parallelism (``MoETransformer(cfg, ep_group=...)``) runs on
``--world`` gloo processes (127.0.0.1, one thread each). Every ``--spike-every``-th step rank 0's
tokens all pick the last expert of rank 1 (``routing_spike(4.0, experts=[e], ranks=[0])``), so
rank 1's experts compute more while its own routing stays calm: only the count exchange tells it.
Each rank's budget is ``--headroom`` above what keeping everything needs on that rank without
the spike (a calm keep_all pass first, after its ``--warmup`` steps).

Per policy (``plain``: no bagualu2; ``keep_all`` under the budget, recorded not raised, to show
what it would do on a device; ``recompute_all``; ``adaptive`` under the budget), each on its own
model built from the same seed, over the same steps, one step of each policy per round in an
order rotating every round: the median step time (forward + backward, the ranks aligned by a
barrier before each step, the slowest rank's time), and per rank the activation peak against
the budget and the violations. The first ``--warmup`` steps (profiling, adaptive's calibration)
are neither timed nor counted in the peaks: profiled micro-batches are traced, and a traced
micro-batch holds more than keep_all's untraced ones at the same load.

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
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer

# The tests' multi-process harness (spawned gloo ranks on 127.0.0.1, a free port, hard timeouts);
# the spawned ranks find it on the sys.path they inherit.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from pipeline_harness import launch  # noqa: E402

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


def _build(args: argparse.Namespace, policy: str, budget: Any) -> Tuple[MoETransformer, Any, List[float]]:
    torch.manual_seed(SEED)
    model = MoETransformer(getattr(MoEConfig, args.config)(), ep_group=dist.group.WORLD)
    exchange = _time_exchange(model)
    prov = None if policy == "plain" else bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0)
    return model, prov, exchange


def _step(model: MoETransformer, prov: Any, args: argparse.Namespace, rank: int, i: int, spiked: bool) -> float:
    """One forward + backward; the slowest rank's seconds (the ranks start together)."""
    target = model.experts_on_rank(1)[-1]
    spike = model.routing_spike(4.0, experts=[target], ranks=[0]) if spiked else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    with spike:
        loss = model(_tokens(model.cfg, rank, i, args.batch, args.seq))
        loss.backward()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if prov is not None:
        prov.step()
    return float(elapsed)


def _summary(prov: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """Peak and violations over the timed steps (the profiled first micro-batches are traced, and
    hold more than keep_all's untraced ones at the same load), and the whole run's report."""
    gc.collect()
    prov.runtime.residency.settle(wait=True)
    report = prov.report()
    timed = prov.telemetry.micro_batches[args.warmup:]
    out = dict(peak_bytes=max((m.peak_bytes for m in timed), default=0), budget_bytes=report["budget_bytes"],
               violations=sum(m.violations for m in timed), run_violations=report["violations"],
               decisions=report["decisions"], decision_us=report["decision_latency_us"],
               saved_bytes_by_choice=report["saved_bytes_by_choice"], resident_after=report["resident_bytes"])
    prov.disable()
    return out


def _run_policies(rank: int, args: argparse.Namespace, budget: int) -> Dict[str, Any]:
    """Every policy on its own model, one step of each per round, in an order that rotates every
    round: machine noise hits all of them alike."""
    runs = {policy: _build(args, policy, budget) for policy in POLICIES}
    step_s: Dict[str, List[float]] = {policy: [] for policy in POLICIES}
    for i in range(args.warmup + args.steps):
        spiked = i >= args.warmup and (i - args.warmup) % args.spike_every == args.spike_every - 1
        for k in range(len(POLICIES)):
            policy = POLICIES[(i + k) % len(POLICIES)]
            model, prov, _ = runs[policy]
            seconds = _step(model, prov, args, rank, i, spiked)
            if i >= args.warmup:
                step_s[policy].append(seconds)
    rows: Dict[str, Any] = {}
    for policy, (model, prov, exchange) in runs.items():
        rows[policy] = {"step_s": statistics.median(step_s[policy]), "exchange_s": exchange}
        if prov is not None:
            rows[policy].update(_summary(prov, args))
    return rows


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
    model, prov, _ = _build(args, "keep_all", None)
    for i in range(args.warmup + args.steps):
        _step(model, prov, args, rank, i, spiked=False)
    calm = _summary(prov, args)
    budget = int(calm["peak_bytes"] * (1.0 + args.headroom))
    rows = _run_policies(rank, args, budget)
    rows["bare"] = _bare_exchange(world, getattr(MoEConfig, args.config)().num_experts, args.exchange_reps)
    rows["calm_peak_bytes"] = calm["peak_bytes"]
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def run_world(world: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.json")
        launch(_rank_main, world, args, path, timeout_s=args.timeout)
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
