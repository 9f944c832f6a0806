"""The simulator against reality: the reference MoE model on this CPU, simulated and run.

1. A real run: the reference model (small config, one expert-parallel rank of 4) trains under
   the adaptive policy with a budget just above its calm peak, with routing spikes; the
   provisioner's telemetry records every gating decision and micro-batch.
2. The simulation: the runtime's own cost model (per-operator bytes and times fitted from the
   profiled micro-batches) becomes the simulator's measured tables
   (``bagualu2.sim.measured``); the recorded per-layer loads become its load trace; the
   simulator runs the same policy under the same budget.
3. Reported: predicted vs measured mean step time and peak activation bytes, as errors.

Only the split of step time into per-operator shares comes from the cost model; the forward
and backward totals of calm micro-batches calibrate the time scale (printed).

    python benchmarks/sim_validation.py --micro-batches 40 --out sim_validation.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import numpy as np
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches
from bagualu2.sim.measured import MeasuredOp, measured_simulator, model_from_moe_config, prediction_error
from bagualu2.sim.traces import LoadTrace


def real_run(cfg: MoEConfig, batches: List[torch.Tensor], spikes: Dict[int, float], budget: int, warmup: int):
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps: List[float] = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        torch.manual_seed(i)
        if i in spikes:
            with model.routing_spike(spikes[i], experts=(0,)):
                model(batch).backward()
        else:
            model(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        prov.step()
        steps.append(time.perf_counter() - start)
    return prov, steps


def calm_peak(cfg: MoEConfig, batch: torch.Tensor) -> int:
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    model(batch).backward()
    return prov.report()["peak_bytes"]


def tables_from_cost_model(prov: bagualu2.Provisioner, cfg: MoEConfig, fwd_s: float, bwd_s: float) -> List[MeasuredOp]:
    """One MoE layer's measured rows (layer 0's operators; work outside the layers is spread)."""
    cost = prov.cost
    counts = prov.mean_counts()
    rows: Dict[str, List[float]] = {}
    outside = [0.0, 0.0]
    for key in cost.order:
        op = cost.ops[key]
        tokens = 0.0 if op.layer is None else float(counts[op.layer][op.expert]) if op.expert is not None else 0.0
        nbytes, seconds = op.bytes(tokens), op.seconds(tokens)
        if key.startswith("layers.0."):
            rows[key[len("layers.0."):]] = [nbytes, seconds, float(op.expert is not None)]
        elif not key.startswith("layers."):
            outside[0] += nbytes / cfg.num_layers
            outside[1] += seconds / cfg.num_layers
    rows["outside the layers"] = [outside[0], outside[1], 0.0]
    measured = sum(r[1] for r in rows.values()) * cfg.num_layers
    scale = fwd_s / measured  # the cost model times only ops whose outputs are saved
    return [MeasuredOp(name, nbytes=b, fwd_s=s * scale, recompute_s=s, bwd_s=s * scale * bwd_s / fwd_s,
                       load_scaled=bool(scaled))
            for name, (b, s, scaled) in rows.items()]


def trace_from_telemetry(prov: bagualu2.Provisioner, steps: int, layers: int, experts_per_rank: int) -> LoadTrace:
    load = np.ones((steps, 1, layers))
    for d in prov.telemetry.decisions:
        load[d.step, 0, d.layer] = (d.imbalance + experts_per_rank - 1) / experts_per_rank
    return LoadTrace(load, load.reshape(steps, -1).max(axis=1) > 1.2, "telemetry of the real run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="sim_validation.json")
    args = parser.parse_args()

    cfg = MoEConfig.small(ep_size=4)
    batch_size, seq = 8, 128
    batches = list(synthetic_batches(cfg.vocab_size, batch_size, seq, seed=0, num_batches=args.micro_batches))
    spikes = {i: 2.6 for i in range(args.warmup + 3, args.micro_batches, 9)}
    keep_peak = calm_peak(cfg, batches[0])
    budget = int(keep_peak * 1.05)

    prov, steps = real_run(cfg, batches, spikes, budget, args.warmup)
    mbs = prov.telemetry.micro_batches
    calm = [i for i in range(args.warmup, args.micro_batches) if i not in spikes]
    fwd = statistics.fmean(mbs[i].forward_seconds for i in calm)
    bwd = statistics.fmean(steps[i] - mbs[i].forward_seconds for i in calm)
    measured_step = statistics.fmean(steps[args.warmup:])
    measured_peak = max(m.peak_bytes for m in mbs[args.warmup:])

    rows = tables_from_cost_model(prov, cfg, fwd, bwd)
    copy_bw = min(prov.cost.d2h_bandwidth, prov.cost.h2d_bandwidth)
    sim = measured_simulator(model_from_moe_config(cfg, seq=seq), {"moe": rows}, device_memory=budget,
                             microbatches=1, mbs=batch_size, seq=seq, copy_bw=copy_bw)
    trace = trace_from_telemetry(prov, args.micro_batches, cfg.num_layers, cfg.num_experts // cfg.ep_size)
    trace.load = trace.load[args.warmup:]
    trace.spike = trace.spike[args.warmup:]
    result = sim.run(trace, policies=["keep_all", "adaptive"])
    sim_keep_calm = float(result.policies["keep_all"].peak.min())
    err = prediction_error(result, "adaptive", measured_step_s=measured_step, measured_peak_bytes=measured_peak)

    print(f"real run: {args.micro_batches} micro-batches of {batch_size}x{seq}, {len(spikes)} spikes of 2.6x, "
          f"budget {budget:,} B; calm forward {fwd * 1e3:.1f} ms, backward {bwd * 1e3:.1f} ms (time scale)")
    print(f"{'':<24}{'measured':>14}{'simulated':>14}{'error':>9}")
    print(f"{'mean step time (ms)':<24}{measured_step * 1e3:>14.1f}{err['predicted_step_s'] * 1e3:>14.1f}"
          f"{err['step_time_error']:>9.1%}")
    print(f"{'peak activation (B)':<24}{measured_peak:>14,}{int(err['predicted_peak_bytes']):>14,}"
          f"{err['peak_error']:>9.1%}")
    print(f"{'keep-all calm peak (B)':<24}{keep_peak:>14,}{int(sim_keep_calm):>14,}"
          f"{(sim_keep_calm - keep_peak) / keep_peak:>9.1%}")
    with open(args.out, "w") as f:
        json.dump({"budget_bytes": budget, "measured_step_s": measured_step, "measured_peak_bytes": measured_peak,
                   "calm_forward_s": fwd, "calm_backward_s": bwd, "keep_all_calm_peak_bytes": keep_peak,
                   "simulated_keep_all_calm_peak_bytes": sim_keep_calm, **err}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
