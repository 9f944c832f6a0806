"""Cost model accuracy on the reference MoE model, across calm loads and routing spikes.

1. Memory: at each micro-batch's first gating event the provisioner predicts the micro-batch's
   all-keep activation high-water mark (what is resident + the cost model's bytes for every
   operator still to save). With a budget 30% above the calm peak nothing is released, so the
   ledger's measured high-water mark is the ground truth. Reported: error per micro-batch, mean and max;
   and the same prediction with the later layers' real routing in place of the first layer's
   (which the first gate cannot know): the error of the bytes model alone.
2. Time: for plans that release activations (at tighter budgets, the plan a provisioner that
   has learned from adaptive steps under that budget ran last, ``last_plan``; and four static
   plans: everything offloaded, everything recomputable recomputed (what the provisioner's
   calibrating micro-batches do), and, never measured as such, only the experts' operators or
   only the others recomputed, priced by the loosest budget's provisioner; and all-keep again,
   A/A, the measurement's own error), the predicted overhead (the provisioner's
   ``CostModel.plan_seconds``) is compared with the measured step-time overhead over a (traced)
   all-keep plan on the same batch, every plan run on one model through one provisioner (a
   fixed plan set as ``Provisioner.policy``): in each of ``--repeats`` rounds
   every plan's step runs between two all-keep steps, and the overhead is the median over
   rounds of the plan's step minus each of its neighbours (with its 95% bootstrap interval:
   what the machine's noise leaves of the measurement). Also
   shown: the bytes each plan releases (as the cost model predicts them), and the seconds
   each plan's runtime measured rebuilding in backward and copying on the training thread,
   and its provisioner spent learning from them as the backward ended (the overhead's
   mechanism, without the step-to-step noise); and how much more than the all-keep step each
   plan's step spent in the saved-tensor hooks (pack, unpack), and outside every one of them.

    python benchmarks/cost_model_accuracy.py --micro-batches 40 --out cost_model_accuracy.json
    python benchmarks/cost_model_accuracy.py --time-config bench --repeats 40   # 0.4 s steps
    python benchmarks/cost_model_accuracy.py --fractions 0.8 --budget-plans-only --repeats 1500  # one plan, a tight interval
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from typing import Dict, List

import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches


def run_step(model: MoETransformer, batch: torch.Tensor, spike: float, seed: int) -> None:
    torch.manual_seed(seed)
    if spike:
        with model.routing_spike(spike, experts=(0,)):
            model(batch).backward()
    else:
        model(batch).backward()
    model.zero_grad(set_to_none=True)


def memory_accuracy(model: MoETransformer, batches: List[torch.Tensor], spikes: Dict[int, float]) -> Dict:
    probe = copy.deepcopy(model)
    keep = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    run_step(probe, batches[0], 0.0, 0)
    # Room for every spike (nothing is released), but not for the worst routing there could be,
    # so every micro-batch is traced and predicted at its gates.
    budget = int(keep.report()["peak_bytes"] * 1.3)
    model = copy.deepcopy(model)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    # Each micro-batch's routing in every layer, to split the prediction's error: the first gate
    # takes the later layers to route like the first; with their real routing instead, what
    # is left is the error of the bytes model alone.
    routed: List[Dict[int, List[int]]] = []

    def capture(spec: "bagualu2.runtime.gates.GateSpec"):
        def hook(module, args, output) -> None:
            if not bagualu2.is_recomputing():
                with torch.no_grad():
                    routed[-1][spec.layer] = spec.counts_fn(module, args, output).tolist()
        return hook

    hooks = [spec.module.register_forward_hook(capture(spec)) for spec in prov.gates]
    for i, batch in enumerate(batches):
        routed.append({})
        run_step(model, batch, spikes.get(i, 0.0), i)
    for h in hooks:
        h.remove()
    cost = prov.cost
    first = min(routed[0])
    rows = []
    for mb in prov.telemetry.micro_batches:
        if mb.predicted_peak_bytes:
            counts = routed[mb.micro_batch]
            assumed = {layer: counts[first] for layer in counts}
            later = [k for k, op in cost.ops.items() if op.layer is not None and op.layer != first]
            known = mb.predicted_peak_bytes + sum(cost.predict_bytes(k, counts) - cost.predict_bytes(k, assumed)
                                                  for k in later)
            rows.append({"micro_batch": mb.micro_batch, "imbalance": mb.imbalance, "measured": mb.peak_bytes,
                         "predicted": mb.predicted_peak_bytes,
                         "error": (mb.predicted_peak_bytes - mb.peak_bytes) / mb.peak_bytes,
                         "predicted_known_routing": known, "error_known_routing": (known - mb.peak_bytes) / mb.peak_bytes})
    prov.disable()
    return {"rows": rows,
            "mean_abs_error": statistics.fmean(abs(r["error"]) for r in rows),
            "max_abs_error": max(abs(r["error"]) for r in rows),
            "spike_mean_abs_error": statistics.fmean([abs(r["error"]) for r in rows if r["imbalance"] >= 1.5] or [0.0]),
            "known_routing_mean_abs_error": statistics.fmean(abs(r["error_known_routing"]) for r in rows),
            "known_routing_max_abs_error": max(abs(r["error_known_routing"]) for r in rows)}


def median_ci(rounds: List[List[float]], resamples: int = 2000, seed: int = 0) -> List[float]:
    """95% bootstrap confidence interval of the median of the values of all ``rounds``, the
    rounds resampled (the values of one round are not independent of each other)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median([v for r in rng.choices(rounds, k=len(rounds)) for v in r])
                     for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def error_range(predicted: float, interval: List[float]) -> str:
    """The prediction's relative error against each end of the measurement's interval."""
    if interval[0] <= 0 or predicted <= 0:
        return "-"
    return f"{(predicted - interval[1]) / interval[1]:+.0%}..{(predicted - interval[0]) / interval[0]:+.0%}"


def only(plan: "bagualu2.Plan", choice: "bagualu2.Choice") -> Dict[str, "bagualu2.Choice"]:
    """The part of ``plan`` that makes ``choice``."""
    return {k: c for k, c in plan.choices.items() if c == choice}


def time_accuracy(model: MoETransformer, batch: torch.Tensor, fractions: List[float], repeats: int,
                  learn_steps: int, recalibrate_every: int, static_plans: bool = True) -> List[Dict]:
    """Each plan against an all-keep plan on the same batch: each round runs every plan's step
    between two all-keep steps (the plans in an order drawn anew each round, so that what the
    step before leaves in caches hits them alike), and the measured overhead is the median over
    rounds of (plan step - all-keep step) for each of the two. A step is compared with its
    neighbours because the machine drifts: on the reference model, the difference of two
    identical steps spread 1.4x to 1.7x as far (median absolute deviation) five steps apart as
    side by side, and a difference with the mean of both neighbours is skewed (the median of
    X - (Y + Z) / 2 is not 0 for step times with a long tail). The all-keep plan
    is traced like the plans (``Plan({})``, where ``keep_all`` would skip tracing): a plan's
    cost is measured against keeping in the same traced forward. Each budget's cost model keeps
    learning as in training, from one adaptive step per round, and the prediction is
    the median over rounds of its prediction in that round: this machine's speed drifts by
    tens of percent within seconds (the median all-keep step over 1.3 s windows ranged from 22
    to 39 ms in three minutes), so a model learned minutes before the measurement would be
    judged against a different machine. For the same reason the planners' provisioners
    recalibrate once every ``recalibrate_every`` adaptive steps, recomputing all they can (or
    every other key of it) and offloading all they can in turn: what their budget plans never
    replay, and many offloads of every size, are measured over the same minutes as the plans.
    The all-keep plan measured again as a plan (A/A) shows what the method measures where
    there is nothing to measure."""
    # One provisioner per budget, learning under it as in training (where the budget is fixed):
    # from adaptive steps first, then from one step per round. (A model learned under the
    # budgets in turn is not one a training run has: each of its calibrations ran under
    # whichever budget came up, and under the tighter ones backward cannot keep all it
    # rebuilds until read.)
    planners = []
    for fraction in fractions:
        probe = copy.deepcopy(model)
        planners.append(bagualu2.enable(probe, budget=1 << 40, min_bytes=0, recalibrate_every=recalibrate_every))
        for i in range(planners[-1].profile_frames):
            run_step(probe, batch, 0.0, i)
    keep_peak = max(m.peak_bytes for m in planners[0].telemetry.micro_batches)
    counts = planners[0].mean_counts()
    for fraction, prov in zip(fractions, planners):
        prov.budget = int(keep_peak * fraction)
        seed = 100
        while seed < 100 + learn_steps or prov.telemetry.micro_batches[-1].calibrating:
            run_step(prov.model, batch, 0.0, seed)
            seed += 1
        if prov.last_plan is None:
            raise RuntimeError(f"the provisioner under {fraction:.0%} of the all-keep peak never planned: "
                               f"its micro-batches were all calm; pass a tighter fraction")
    # Each budget's plan is the one its provisioner's gates made last (not ``plan_for``, which
    # plans the whole micro-batch at once and can differ: at 80% it recomputed 9 operators
    # where the gates offloaded 8, a plan the provisioner never ran).
    plans = [prov.last_plan for prov in planners]
    labels = [f"{fraction:.0%}" for fraction in fractions]
    cost = planners[0].cost
    if static_plans:
        # Two static plans at the ends of the space: every operator offloaded; every recomputable
        # one recomputed (the rest kept).
        plans.append(bagualu2.Plan({k: bagualu2.Choice.OFFLOAD for k in cost.ops}))
        plans.append(bagualu2.Plan({k: bagualu2.Choice.RECOMPUTE if op.recomputable else bagualu2.Choice.KEEP
                                    for k, op in cost.ops.items()}))
        # And two whose rebuilds the cost model never measured (its calibrating micro-batches
        # recompute everything, and the budget plans here little): only the experts' operators
        # recomputed, and only the others.
        for experts in (True, False):
            plans.append(bagualu2.Plan({
                k: bagualu2.Choice.RECOMPUTE if op.recomputable and (op.layer is not None) == experts else bagualu2.Choice.KEEP
                for k, op in cost.ops.items()}))
        labels += ["offload", "recompute", "rc experts", "rc others"]
    # And all-keep again: its "overhead" over itself is the measurement's own error.
    plans.append(bagualu2.Plan({}))
    labels.append("A/A")
    # The static plans are priced by the provisioner under the loosest budget, whose
    # calibrations (recomputing all) keep what they rebuild, as the plans do without a budget.
    predictors = planners + [planners[0]] * (len(plans) - len(planners))
    predictions: List[List[float]] = [[] for _ in plans]
    split: List[List[tuple]] = [[] for _ in plans]  # (rebuild, copy) predicted per round
    # Every plan runs on one model through one provisioner, switched between them step by step
    # (setting ``prov.policy``): two copies of the model differ in where their memory lies, which
    # moves a copy's step by as much as the smaller plans' overheads differ from predictions
    # (the A/A row shows it when each plan is given its own copy).
    shared = copy.deepcopy(model)
    prov = bagualu2.enable(shared, budget=None, policy=bagualu2.Plan({}), min_bytes=0)
    for i in range(prov.profile_frames + 1):  # the profiling forwards time every op; then one warm-up
        run_step(shared, batch, 0.0, i)
    policies = [bagualu2.Plan({})] + plans
    base: List[float] = []  # all-keep step seconds
    # per plan, per round: its step minus the all-keep step before it, and minus the one after
    deltas: List[List[List[float]]] = [[] for _ in plans]
    mechanism: List[List[tuple]] = [[] for _ in policies]  # (rebuild, copy, learning) seconds per step
    fell_back: List[int] = [0 for _ in policies]
    # What the runtime measured, as the provisioner takes it to learn from (as each backward
    # ends), and how long learning took.
    measured = [0.0, 0.0, 0.0]
    take_replays, take_copies, learn = prov.runtime.residency.take_replay_times, prov.runtime.residency.take_copy_times, prov.learning.fn

    def replays_noted() -> Dict[str, tuple]:
        times = take_replays()
        measured[0] += sum(s for s, _ in times.values())
        return times

    def copies_noted() -> tuple:
        times = take_copies()
        measured[1] += times[0]
        return times

    def learning_noted() -> None:
        start = time.perf_counter()
        learn()
        measured[2] += time.perf_counter() - start

    prov.runtime.residency.take_replay_times = replays_noted
    prov.runtime.residency.take_copy_times = copies_noted
    prov.learning.unsubscribe()
    prov.runtime.residency.on_backward_end.subscribe(learning_noted)
    # Seconds in the saved-tensor hooks (pack, unpack) this step: what of a plan's overhead
    # runs inside the hooks, and what outside every one of them.
    hooks = [0.0, 0.0]

    def hook_timed(hook: str, record: str, seconds: float) -> None:
        hooks[0 if hook == "pack" else 1] += seconds

    prov.runtime.on_hook.subscribe(hook_timed)
    # per plan, per round: (pack, unpack) hook seconds minus the all-keep step's before and after
    hook_deltas: List[List[List[tuple]]] = [[] for _ in plans]
    order = random.Random(0)
    for r in range(repeats):
        for planner in planners:
            run_step(planner.model, batch, 0.0, 200 + r)
        for plan, planner, out, parts in zip(plans, predictors, predictions, split):
            out.append(planner.cost.plan_seconds(plan.choices, counts, *planner.cost.windows(1.0)))
            parts.append(tuple(planner.cost.plan_seconds(only(plan, choice), counts)
                               for choice in (bagualu2.Choice.RECOMPUTE, bagualu2.Choice.OFFLOAD)))
        # The plans in an order drawn anew each round, each between two all-keep steps.
        sequence = [0]
        for i in order.sample(range(1, len(policies)), len(policies) - 1):
            sequence += [i, 0]
        seconds, in_hooks = [], []
        for i in sequence:
            prov.policy = policies[i]
            hooks[:] = [0.0, 0.0]
            start = time.perf_counter()
            run_step(shared, batch, 0.0, r)
            seconds.append(time.perf_counter() - start)
            in_hooks.append(tuple(hooks))
            mechanism[i].append(tuple(measured))
            measured[:] = [0.0, 0.0, 0.0]
            fell_back[i] += prov.telemetry.micro_batches[-1].fallbacks
        base.extend(seconds[0::2])
        for j in range(1, len(sequence), 2):
            deltas[sequence[j] - 1].append([seconds[j] - seconds[j - 1], seconds[j] - seconds[j + 1]])
            hook_deltas[sequence[j] - 1].append([tuple(a - b for a, b in zip(in_hooks[j], in_hooks[n]))
                                                 for n in (j - 1, j + 1)])
    fallbacks = [n / repeats for n in fell_back[1:]]  # per step
    prov.disable()
    learned = {label: {name: getattr(prov.cost, name) for name in (
        "replay_frame_s", "replay_fixed_s", "replay_entry_s", "replay_factor", "copy_frame_s",
        "copy_overhead_s", "copy_factor")} for label, prov in zip(labels, planners)}
    rows = []
    for label, plan, preds, parts, rounds, mech_parts, fell_back, hooked in zip(
            labels, plans, predictions, split, deltas, mechanism[1:], fallbacks, hook_deltas):
        pred = statistics.median(preds)
        diffs = [d for pair in rounds for d in pair]
        in_hooks = [h for pair in hooked for h in pair]
        q = statistics.quantiles(diffs, n=4)
        mech = [sum(m) for m in mech_parts]
        released = sum(cost.predict_bytes(k, counts) for k, c in plan.choices.items() if c != bagualu2.Choice.KEEP)
        rows.append({"plan": label, "mix": {c.name.lower(): n for c, n in plan.mix().items()},
                     "released_bytes": released,
                     "predicted_overhead_s": pred, "planner_exposed_s": plan.exposed_s, "measured_overhead_s": statistics.median(diffs),
                     "measured_mechanism_s": statistics.median(mech),
                     "predicted_rebuild_s": statistics.median(p[0] for p in parts),
                     "predicted_copy_s": statistics.median(p[1] for p in parts),
                     "measured_rebuild_s": statistics.median(m[0] for m in mech_parts),
                     "measured_copy_s": statistics.median(m[1] for m in mech_parts),
                     "measured_learning_s": statistics.median(m[2] for m in mech_parts),
                     "fallbacks_per_step": fell_back,
                     "pack_hooks_delta_s": statistics.median(h[0] for h in in_hooks),
                     "unpack_hooks_delta_s": statistics.median(h[1] for h in in_hooks),
                     "outside_hooks_delta_s": statistics.median(d - h[0] - h[1] for d, h in zip(diffs, in_hooks)),
                     "mechanism_error": (pred - statistics.median(mech)) / statistics.median(mech)
                     if statistics.median(mech) > 0 else None,
                     "measured_iqr_s": [q[0], q[2]], "measured_ci95_s": median_ci(rounds),
                     "all_keep_step_s": statistics.median(base),
                     "error": (pred - statistics.median(diffs)) / statistics.median(diffs)
                     if statistics.median(diffs) > 0 and plan.choices else None})
    return rows, learned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=300, help="rounds of the time accuracy (one step of each plan, between all-keep steps)")
    parser.add_argument("--learn-steps", type=int, default=8,
                        help="adaptive steps at each budget from which the cost model learns before planning")
    parser.add_argument("--time-config", default="small", choices=["small", "bench"],
                        help="model of the time accuracy (both with 4-way expert parallelism): the memory "
                             "part's (small: batch 4 x 64, a step of about 25 ms on 2 cpu cores) or the benchmark "
                             "size (bench: batch 8 x 256, about 0.4 s)")
    parser.add_argument("--recalibrate-every", type=int, default=8,
                        help="each budget's provisioner recomputes all it can once every this many adaptive steps")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.6, 0.4, 0.25],
                        help="budgets of the planned plans, as fractions of the all-keep peak")
    parser.add_argument("--budget-plans-only", action="store_true",
                        help="measure only the budgets' plans and A/A, not the four static plans (fewer "
                             "steps per round: more rounds, a tighter interval, in the same time)")
    parser.add_argument("--out", default="cost_model_accuracy.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.small(ep_size=4))
    batches = list(synthetic_batches(model.cfg.vocab_size, 4, 64, seed=0, num_batches=args.micro_batches))
    spikes = {i: s for i, s in zip(range(5, args.micro_batches, 7), [2.6, 1.8, 2.2, 2.6, 1.5, 2.0])}

    mem = memory_accuracy(model, batches, spikes)
    print(f"{'micro-batch':>11}{'imbalance':>11}{'measured B':>13}{'predicted B':>13}{'error':>9}"
          f"{'routing known':>15}{'error':>9}")
    for r in mem["rows"]:
        print(f"{r['micro_batch']:>11}{r['imbalance']:>11.2f}{r['measured']:>13,}{r['predicted']:>13,}{r['error']:>9.2%}"
              f"{r['predicted_known_routing']:>15,}{r['error_known_routing']:>9.2%}")
    print(f"high-water prediction error: mean {mem['mean_abs_error']:.2%}, max {mem['max_abs_error']:.2%}, "
          f"spikes {mem['spike_mean_abs_error']:.2%} (published system: 1.56% mean); with every layer's "
          f"routing known: mean {mem['known_routing_mean_abs_error']:.2%}, max {mem['known_routing_max_abs_error']:.2%}")

    if args.time_config == "bench":
        torch.manual_seed(0)
        model = MoETransformer(MoEConfig.bench(ep_size=4))
        batches = list(synthetic_batches(model.cfg.vocab_size, 8, 256, seed=0, num_batches=1))
    rows, learned = time_accuracy(model, batches[0], args.fractions, args.repeats, args.learn_steps,
                                   args.recalibrate_every, static_plans=not args.budget_plans_only)
    print(f"\n{'plan':>10}{'mix (keep/offload/recompute)':>30}{'released MiB':>14}{'predicted ms':>14}{'step delta ms':>15}"
          f"{'95% CI ms':>16}{'error':>8}{'error over CI':>16}{'mechanism ms':>14}{'error':>8}")
    for r in rows:
        mix = r["mix"]
        err = f"{r['error']:>8.0%}" if r["error"] is not None else f"{'-':>8}"
        mech = f"{r['mechanism_error']:>8.0%}" if r["mechanism_error"] is not None else f"{'-':>8}"
        print(f"{r['plan']:>10}{mix['keep']:>12}/{mix['offload']}/{mix['recompute']:<12}{r['released_bytes'] / 2**20:>14.2f}"
              f"{r['predicted_overhead_s'] * 1e3:>14.1f}{r['measured_overhead_s'] * 1e3:>15.1f}"
              f"{r['measured_ci95_s'][0] * 1e3:>8.2f}..{r['measured_ci95_s'][1] * 1e3:<6.2f}{err}"
              f"{error_range(r['predicted_overhead_s'], r['measured_ci95_s']):>16}"
              f"{r['measured_mechanism_s'] * 1e3:>14.1f}{mech}")
    print(f"\n{'plan':>10}{'rebuild ms: predicted':>23}{'measured':>10}{'copy ms: predicted':>20}{'measured':>10}"
          f"{'learning ms (unpriced)':>24}{'fallbacks/step':>16}")
    for r in rows:
        print(f"{r['plan']:>10}{r['predicted_rebuild_s'] * 1e3:>23.2f}{r['measured_rebuild_s'] * 1e3:>10.2f}"
              f"{r['predicted_copy_s'] * 1e3:>20.2f}{r['measured_copy_s'] * 1e3:>10.2f}"
              f"{r['measured_learning_s'] * 1e3:>24.2f}{r['fallbacks_per_step']:>16.1f}")
    print(f"\n{'plan':>10}{'pack hooks ms':>15}{'unpack hooks ms':>17}{'outside hooks ms':>18}")
    for r in rows:
        print(f"{r['plan']:>10}{r['pack_hooks_delta_s'] * 1e3:>15.2f}{r['unpack_hooks_delta_s'] * 1e3:>17.2f}"
              f"{r['outside_hooks_delta_s'] * 1e3:>18.2f}")
    print(f"(all-keep step {rows[0]['all_keep_step_s'] * 1e3:.1f} ms, traced; step delta = median over "
          f"{args.repeats} rounds of the plan's step minus each all-keep step beside it, with the 95% "
          f"bootstrap interval of that median and the prediction's error at its ends; mechanism = "
          f"median per step of the seconds the plan's runtime measured rebuilding and copying, and its "
          f"provisioner learning from them; hooks = median of the plan's seconds in the saved-tensor "
          f"hooks minus the all-keep step's beside it, outside = the step delta less both, which holds "
          f"the learning and the host copies' release as backward ends)")
    for budget, fit in learned.items():
        print(f"cost model at the end, under {budget}: " + ", ".join(
            f"{k} {v * 1e6:.1f} us" if k.endswith("_s") else f"{k} {v:.3f}" for k, v in fit.items()))
    with open(args.out, "w") as f:
        json.dump({"memory": mem, "time_config": args.time_config, "time": rows, "learned": learned}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
