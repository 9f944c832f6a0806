"""What an offload plan costs, by what it offloads: storages, saved tensors, bytes.

On the reference MoE model (the small config, 4-way expert parallelism, batch 4 x 64: the time
part of ``cost_model_accuracy.py``), one provisioner runs plans that offload different sets of
operators (the largest storages, the smallest, a middle slice, every other one, all of them),
each between two all-keep steps as in ``cost_model_accuracy.py``, in an order drawn anew each
round. For each plan it reports:

* what it offloads: storages, saved tensors that read them (each costs a pack and an unpack
  call), and bytes;
* the cost model's predicted overhead (``CostModel.plan_seconds``), learned as in
  training from every plan this provisioner ran;
* the mechanism: the seconds the runtime measured copying (offloading, reloading, releasing the
  host copies) and the provisioner learning from them, per step;
* the step delta: the median over rounds of the plan's step minus each all-keep step beside
  it, with its 95% bootstrap interval;
* the residual: the step delta less the mechanism, which no timer of the runtime sees.

Least-squares fits of the mechanism and of the residual on (1 per micro-batch, per storage,
per saved tensor, per MiB) over the plans show which of these each cost follows; the
prediction is priced per micro-batch, per storage and per byte (``CostModel.plan_seconds``).

    python benchmarks/offload_cost_structure.py --repeats 200 --out offload_cost_structure.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Dict, List, Tuple

import numpy as np
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches
from cost_model_accuracy import median_ci, run_step

FEATURES = ("per micro-batch", "per storage", "per saved tensor", "per MiB")


def compositions(sizes: List[Tuple[int, str]]) -> Dict[str, List[str]]:
    """Sets of operator keys to offload, ``sizes`` being (predicted bytes, key), largest first."""
    keys = [k for _, k in sizes]
    middle = len(keys) // 2
    return {"largest 1": keys[:1], "largest 5": keys[:5], "largest 10": keys[:10],
            "middle 10": keys[middle - 5:middle + 5], "smallest 10": keys[-10:], "smallest 30": keys[-30:],
            "even half": keys[0::2], "odd half": keys[1::2], "all": keys}


def fit(rows: List[List[float]], values: List[float]) -> List[float]:
    """Least-squares coefficients of ``values`` on ``rows``."""
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(values), rcond=None)
    return [float(c) for c in coef]


def measure(repeats: int, seed: int) -> Dict:
    """Every composition's rows (see the module's note) over ``repeats`` rounds, the fits of
    the mechanism and of the residual, and the copy coefficients the cost model learned."""
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.small(ep_size=4))
    batch = next(iter(synthetic_batches(model.cfg.vocab_size, 4, 64, seed=0, num_batches=1)))
    prov = bagualu2.enable(model, budget=None, policy=bagualu2.Plan({}), min_bytes=0)
    for i in range(prov.profile_frames + 1):  # the profiling forwards time every op; then one warm-up
        run_step(model, batch, 0.0, i)
    cost, counts = prov.cost, prov.mean_counts()
    sizes = sorted(((cost.predict_bytes(k, counts), k) for k in cost.ops), reverse=True)
    sizes = [(b, k) for b, k in sizes if b > 0]
    plans = {name: bagualu2.Plan({k: bagualu2.Choice.OFFLOAD for k in keys})
             for name, keys in compositions(sizes).items()}
    names = list(plans)

    # The mechanism, as the provisioner takes it to learn from (as each backward ends), and the
    # saved tensors packed as offloads.
    measured = [0.0, 0, 0]  # seconds, storages offloaded, their bytes
    saves = [0]
    take_copies, learn = prov.runtime.residency.take_copy_times, prov.learning.fn

    def copies_noted() -> tuple:
        times = take_copies()
        measured[:] = [measured[0] + times[0], measured[1] + times[1], measured[2] + times[2]]
        return times

    def learning_noted() -> None:
        start = time.perf_counter()
        learn()
        measured[0] += time.perf_counter() - start

    def pack_counted(hook: str, record: str, seconds: float) -> None:
        saves[0] += hook == "pack" and record == "offloaded"

    prov.runtime.residency.take_copy_times = copies_noted
    prov.learning.unsubscribe()
    prov.runtime.residency.on_backward_end.subscribe(learning_noted)
    prov.runtime.on_hook.subscribe(pack_counted)

    keep = bagualu2.Plan({})
    deltas: Dict[str, List[List[float]]] = {n: [] for n in names}
    mechanism: Dict[str, List[float]] = {n: [] for n in names}
    predicted: Dict[str, List[float]] = {n: [] for n in names}
    packed: Dict[str, List[int]] = {n: [] for n in names}
    offloaded: Dict[str, List[Tuple[int, int]]] = {n: [] for n in names}
    order = random.Random(seed)
    for r in range(repeats):
        for name in names:
            predicted[name].append(prov.cost.plan_seconds(plans[name].choices, counts, *prov.cost.windows(1.0)))
        sequence = [None]
        for name in order.sample(names, len(names)):
            sequence += [name, None]
        seconds = []
        for name in sequence:
            prov.policy = keep if name is None else plans[name]
            measured[:], saves[0] = [0.0, 0, 0], 0
            start = time.perf_counter()
            run_step(model, batch, 0.0, r)
            seconds.append(time.perf_counter() - start)
            if name is not None:
                mechanism[name].append(measured[0])
                packed[name].append(saves[0])
                offloaded[name].append((measured[1], measured[2]))
        for j in range(1, len(sequence), 2):
            deltas[sequence[j]].append([seconds[j] - seconds[j - 1], seconds[j] - seconds[j + 1]])
    prov.disable()

    rows = []
    for name in names:
        diffs = [d for pair in deltas[name] for d in pair]
        step, mech = statistics.median(diffs), statistics.median(mechanism[name])
        rows.append({"plan": name, "storages": statistics.median(o[0] for o in offloaded[name]),
                     "saved_tensors": statistics.median(packed[name]),
                     "offloaded_bytes": statistics.median(o[1] for o in offloaded[name]),
                     "predicted_overhead_s": statistics.median(predicted[name]),
                     "measured_mechanism_s": mech, "measured_overhead_s": step,
                     "measured_ci95_s": median_ci(deltas[name]), "residual_s": step - mech})
    features = [[1.0, r["storages"], r["saved_tensors"], r["offloaded_bytes"] / 2**20] for r in rows]
    return {"rows": rows,
            "mechanism_fit_s": dict(zip(FEATURES, fit(features, [r["measured_mechanism_s"] for r in rows]))),
            "residual_fit_s": dict(zip(FEATURES, fit(features, [r["residual_s"] for r in rows]))),
            "learned": {name: getattr(cost, name) for name in ("copy_frame_s", "copy_overhead_s", "copy_factor")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200,
                        help="rounds (one step of each plan, each between two all-keep steps)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plans' order in each round")
    parser.add_argument("--out", default="offload_cost_structure.json")
    args = parser.parse_args()

    result = measure(args.repeats, args.seed)
    print(f"{'plan':>12}{'storages':>10}{'saved':>7}{'MiB':>7}{'predicted ms':>14}{'mechanism ms':>14}"
          f"{'step delta ms':>15}{'95% CI ms':>16}{'residual ms':>13}{'vs mechanism':>14}{'vs step':>9}")
    for r in result["rows"]:
        pred, mech, step = r["predicted_overhead_s"], r["measured_mechanism_s"], r["measured_overhead_s"]
        lo, hi = r["measured_ci95_s"]
        print(f"{r['plan']:>12}{r['storages']:>10.0f}{r['saved_tensors']:>7.0f}{r['offloaded_bytes'] / 2**20:>7.2f}"
              f"{pred * 1e3:>14.3f}{mech * 1e3:>14.3f}{step * 1e3:>15.3f}{lo * 1e3:>8.2f}..{hi * 1e3:<6.2f}"
              f"{r['residual_s'] * 1e3:>13.3f}{(pred - mech) / mech:>14.0%}{(pred - step) / step:>9.0%}")
    for label, key in (("mechanism", "mechanism_fit_s"), ("residual", "residual_fit_s")):
        print(f"{label} fit: " + ", ".join(f"{v * 1e6:.1f} us {k}" for k, v in result[key].items()))
    learned = result["learned"]
    print(f"cost model: copy_frame_s {learned['copy_frame_s'] * 1e6:.1f} us, copy_overhead_s "
          f"{learned['copy_overhead_s'] * 1e6:.1f} us, copy_factor {learned['copy_factor']:.3f}")
    print(f"(step delta: median over {args.repeats} rounds of the plan's step minus each all-keep step beside "
          f"it; mechanism: median per step of the runtime's copy seconds and its provisioner's learning; "
          f"residual = step delta - mechanism; saved = saved tensors packed as offloads per step)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
