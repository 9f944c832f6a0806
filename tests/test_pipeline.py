"""Pipeline parallelism on torch.distributed.pipelining: bagualu2 per stage, gloo on CPU.

The multi-process tests start their own ranks (``pipeline_harness.launch``: spawned
processes, 127.0.0.1, a free port, a hard timeout). To keep the suite short, one launch per
world size runs every scenario in sequence (each from a freshly built model, same seed) and
rank 0 writes all results to one file; each test below checks one invariant on them.

Scenarios, per schedule:

- ``plain`` / ``plain_repeat``: the pipeline without bagualu2, twice: the baseline must repeat
  bit for bit, or the exactness checks would prove nothing;
- ``plain_spike``: the baseline with a routing spike (2.6x) forced into micro-batch 1 of stage 0;
- ``keep_all_calm``: keep_all without the spike; its peak on each rank is that rank's budget
  (the model is an expert-parallel rank's view, so the spike grows stage 0's activations);
- ``keep_all`` / ``recompute_all`` / ``offload_all``: ``bagualu2.enable`` with a static policy
  (same spike);
- ``adaptive``: ``policy="adaptive"`` under the budget (same spike);
- ``offload_all+overlap`` / ``recompute_all+overlap`` / ``adaptive+overlap``: the same with the
  overlap scheduler driving reloads and early recomputes (``enable_bagualu2(pipe, overlap=True)``),
  with reloads that copy back as on a device (the other variants read offloaded bytes in place);
- ``keep_all_raise`` (last job of the 2-rank launch, 1F1B): keep_all with the adaptive budget
  and ``on_exceed="raise"``: what a static policy would do on a device.
"""
from __future__ import annotations

import gc
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

from bagualu2.integrations import pipeline as pp
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

import pipeline_harness as harness  # noqa: E402

SEED = 1234
SEQ = 16
MICROBATCH = 2
SPIKE = (0, 1)  # (stage, micro-batch) whose forward routes with a 2.6x load spike on expert 0
EP_SIZE = 4
TIGHT_SCHEDULE = "interleaved1f1b"  # deepest warm-up stacking on 2 ranks (5 forwards on rank 0)
LAUNCH_TIMEOUT_S = 170

# (schedule, micro-batches) run on each world size. Every schedule runs on 2 ranks; 4 ranks
# repeat one single-stage-per-rank and one zero-bubble schedule (8 stages, time-bounded).
SCHEDULES_2 = [("gpipe", 4), ("1f1b", 4), ("interleaved1f1b", 4), ("zbv", 4), ("dualpipev", 4)]
SCHEDULES_4 = [("1f1b", 4), ("zbv", 8)]
PROVISIONED = ("keep_all", "recompute_all", "offload_all", "adaptive")
OVERLAP = ("offload_all+overlap", "recompute_all+overlap", "adaptive+overlap")
REPORT_KEYS = ("peak_bytes", "budget_bytes", "resident_bytes", "arena_in_use_bytes", "violations",
               "micro_batches", "steps", "decisions", "saved_bytes_by_choice", "overlap")


# ---------------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------------


def _model_and_batch(schedule: str, world_size: int, n_microbatches: int):
    num_stages, _ = pp.stage_layout(schedule, world_size)
    # ep_size=4: each stage is the expert-parallel rank-0 view (2 of 8 experts local), so a
    # spike on a local expert grows the stage's activations as it does on a real EP rank;
    # wider experts make the expert share of the activations (what the spike moves) larger.
    cfg = MoEConfig.tiny(num_layers=num_stages, ep_size=EP_SIZE, expert_hidden_size=128)
    torch.manual_seed(SEED)
    model = MoETransformer(cfg)
    batch = next(synthetic_batches(cfg.vocab_size, MICROBATCH * n_microbatches, SEQ + 1, seed=SEED))
    return model, batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def _spike_on(pipe: pp.Pipeline, model: MoETransformer, seen: list) -> None:
    """Force a routing spike into micro-batch SPIKE[1] on stage SPIKE[0]: its forward, and its
    backward actions, where recompute_all reruns the blocks (and with them the router) as
    checkpoint would; the spike belongs to the micro-batch, as its tokens do.

    ``seen`` receives the load imbalance of each router of that stage for that forward.
    """
    from bagualu2.models import load_imbalance

    active = []

    def on_event(event, state):
        if state.action not in ("F", "B", "I", "W") or (state.stage_index, state.microbatch) != SPIKE:
            return
        if event == "action_begin":
            active.append(model.routing_spike(imbalance=2.6, experts=(0,)))
            active[-1].__enter__()
        elif event == "action_end":
            active.pop().__exit__(None, None, None)
            if state.action == "F":
                module = next(m for m in pipe.modules if m.stage_index == SPIKE[0])
                seen.extend(load_imbalance(layer.moe.router.last_tokens_per_expert) for layer in module.layers)

    pipe.tracker.subscribe(on_event)


def _run_job(rank: int, world_size: int, job: dict, budgets: dict) -> dict | None:
    schedule, n_mb, variant = job["schedule"], job["n_microbatches"], job["variant"]
    model, tokens, targets = _model_and_batch(schedule, world_size, n_mb)
    pipe = pp.build_pipeline(model, schedule, n_microbatches=n_mb, microbatch_example=tokens[:MICROBATCH])
    phases: list[tuple] = []
    pipe.tracker.subscribe(
        lambda ev, st: phases.append((st.phase.name, st.action, st.stage_index, st.microbatch,
                                      st.in_flight, st.stacked_forwards, list(st.upcoming)))
        if ev == "action_begin" else None
    )
    spiked: list[float] = []
    if variant not in ("plain", "plain_repeat", "keep_all_calm"):
        _spike_on(pipe, model, spiked)
    prov, told = None, []
    policy = variant.replace("_raise", "").replace("_calm", "").replace("_tight", "").replace("+overlap", "")
    if policy in PROVISIONED:
        budget = budgets.get(schedule) if policy == "adaptive" or variant.endswith("_raise") else None
        if variant == "adaptive_tight":  # halfway between releasing and keeping everything
            budget = (budgets[f"{schedule}/keep_all"] + budgets[f"{schedule}/recompute_all"]) // 2
        prov = pp.enable_bagualu2(pipe, policy=policy, budget=budget, arena_bytes=16 << 20, min_bytes=0,
                                  on_exceed="raise" if variant.endswith("_raise") else "record",
                                  overlap=variant.endswith("+overlap"))
        if variant.endswith("+overlap"):
            prov.runtime.residency.reload_in_place = False  # reloads copy, as on a device: there is something to schedule
        inner = prov.set_pipeline_phase
        prov.set_pipeline_phase = lambda phase, stacked=0: (told.append((phase, stacked)), inner(phase, stacked))[1]
    torch.manual_seed(SEED + 1)  # dropout / sampling streams start equal in every scenario
    losses = pipe.train_step(tokens, targets)
    extra = {
        "expected_actions": pipe.tracker.expected_actions,
        "observed_actions": pipe.tracker.observed_actions,
        "phases": phases,
        "stages": [m.stage_index for m in pipe.modules],
        "spike_imbalance": spiked,
    }
    if prov is not None:
        gc.collect()
        prov.runtime.residency.settle(wait=True)
        gc.collect()
        report = prov.report()
        extra["report"] = {k: report.get(k) for k in REPORT_KEYS}
        extra["told"] = told
    result = harness.gather_step_result(pipe, losses, extra=extra)
    if prov is not None:
        prov.disable()  # undoes enable_bagualu2's wiring (Provisioner.on_disable)
        assert not any(isinstance(st.submod, pp.StageEntry) for st in pipe.stages)
    pipe.close()
    if policy in ("keep_all", "recompute_all") and variant == policy:
        budgets[f"{schedule}/{policy}"] = extra["report"]["peak_bytes"]
    if variant == "keep_all_calm":
        # This rank's budget: what keeping everything needs without the spike. Calm micro-batches
        # fit; the spiked one does not, unless the plan releases something.
        budgets[schedule] = extra["report"]["peak_bytes"]
    if result is None:
        return None
    return {"losses": result.losses, "grads": result.grads, "extra": result.extra}


def _outcome(e: BaseException) -> str:
    """What went wrong, naming BudgetExceededError wherever it sits in the exception chain."""
    chain, cur = [], e
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    names = [type(c).__name__ for c in chain]
    root = chain[-1]
    kind = "BudgetExceededError" if "BudgetExceededError" in names else type(root).__name__
    return f"{kind}: {' '.join(str(root).split())[:400]}"


def _rank_main(rank: int, world_size: int, jobs: list[dict], out_path: str) -> None:
    """Run ``jobs`` in order. A failing job is recorded and ends this process at once.

    The peers of a rank that fails mid-schedule fail on their next point-to-point operation
    (gloo reports the closed connection at once), record it the same way and exit; the test
    driver then relaunches from the next job. Budgets derived from earlier jobs survive in a
    per-rank file.
    """
    results = torch.load(out_path, weights_only=True) if rank == 0 and os.path.exists(out_path) else {}
    budget_path = f"{out_path}.budgets{rank}"
    budgets = torch.load(budget_path, weights_only=True) if os.path.exists(budget_path) else {}
    for job in jobs:
        try:
            out = _run_job(rank, world_size, job, budgets)
        except BaseException as e:  # noqa: BLE001 - recorded for the tests, then this rank leaves
            with open(f"{out_path}.fail{rank}", "w") as f:
                f.write(f"{job['name']}\n{_outcome(e)}\n{traceback.format_exc()[-3000:]}")
            os._exit(3)  # skip the collective shutdown: a peer may already be gone
        torch.save(budgets, budget_path)
        if rank == 0:
            results[job["name"]] = out
            torch.save(results, out_path)


VARIANTS = ("plain", "plain_repeat", "plain_spike", "keep_all_calm") + PROVISIONED + OVERLAP


def _jobs(schedules, raise_schedule: str | None = None) -> list[dict]:
    jobs = [
        {"name": f"{schedule}/{variant}", "schedule": schedule, "n_microbatches": n_mb, "variant": variant}
        for schedule, n_mb in schedules
        for variant in VARIANTS
    ]
    if raise_schedule is not None:  # last: these are expected to break the process group
        n_mb = dict(schedules)[TIGHT_SCHEDULE]
        jobs.append({"name": f"{TIGHT_SCHEDULE}/adaptive_tight", "schedule": TIGHT_SCHEDULE,
                     "n_microbatches": n_mb, "variant": "adaptive_tight"})
        n_mb = dict(schedules)[raise_schedule]
        jobs.append({"name": f"{raise_schedule}/keep_all_raise", "schedule": raise_schedule,
                     "n_microbatches": n_mb, "variant": "keep_all_raise"})
    return jobs


def _launch(world_size: int, schedules, tmp_path_factory, raise_schedule: str | None = None) -> dict:
    """Run every job; a failed job is recorded in ``results["failures"]`` and the rest relaunched."""
    out = str(tmp_path_factory.mktemp(f"pp{world_size}") / "results.pt")
    jobs = _jobs(schedules, raise_schedule)
    failures: dict[str, dict[int, str]] = {}
    for _attempt in range(4):
        for r in range(world_size):
            if os.path.exists(f"{out}.fail{r}"):
                os.remove(f"{out}.fail{r}")
        try:
            harness.launch(_rank_main, world_size, jobs, out, timeout_s=LAUNCH_TIMEOUT_S)
            break
        except Exception as e:  # noqa: BLE001 - a rank failed or the launch timed out
            fails = {}
            for r in range(world_size):
                if os.path.exists(f"{out}.fail{r}"):
                    with open(f"{out}.fail{r}") as f:
                        name, outcome, *_ = f.read().split("\n", 2)
                    fails[r] = (name, outcome)
            if not fails:
                raise AssertionError(f"pipeline ranks failed without a record: {e}") from e
            done = torch.load(out, weights_only=True) if os.path.exists(out) else {}
            first = next(i for i, j in enumerate(jobs) if j["name"] not in done)
            failures[jobs[first]["name"]] = {r: o for r, (n, o) in fails.items()}
            jobs = jobs[first + 1 :]
            if not jobs:
                break
    results = torch.load(out, weights_only=True) if os.path.exists(out) else {}
    results["failures"] = failures
    return results


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    return _launch(2, SCHEDULES_2, tmp_path_factory, raise_schedule="1f1b")


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    return _launch(4, SCHEDULES_4, tmp_path_factory)


CASES = [(2, s, n) for s, n in SCHEDULES_2] + [(4, s, n) for s, n in SCHEDULES_4]
CASE_IDS = [f"{w}ranks-{s}" for w, s, _ in CASES]


class _Runs:
    """Results by job name; a job that failed raises with what each rank saw."""

    def __init__(self, results: dict):
        self.results = results
        self.failures = results.get("failures", {})

    def __getitem__(self, name: str) -> dict:
        if name in self.failures:
            pytest.fail(f"{name} failed: " + "; ".join(f"rank {r}: {o}" for r, o in sorted(self.failures[name].items())),
                        pytrace=False)
        if name not in self.results:
            pytest.fail(f"{name} did not run (an earlier failure left no time or no group)", pytrace=False)
        return self.results[name]


def _runs(request, world_size: int) -> _Runs:
    return _Runs(request.getfixturevalue(f"runs{world_size}"))


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert len(a["losses"]) == len(b["losses"]) > 0, what
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        assert torch.equal(x, y), f"{what}: loss of micro-batch {i} differs: {x.item()!r} vs {y.item()!r}"
    assert a["grads"].keys() == b["grads"].keys(), what
    differ = [k for k in a["grads"] if not torch.equal(a["grads"][k], b["grads"][k])]
    assert not differ, f"{what}: gradients differ for {differ[:8]}"


# ---------------------------------------------------------------------------------------------
# Multi-process: baseline determinism and phase tracking
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_baseline_repeats_bitwise(request, world_size, schedule, n_mb):
    """Without bagualu2, two runs from the same seed give identical losses and gradients."""
    runs = _runs(request, world_size)
    a, b = runs[f"{schedule}/plain"], runs[f"{schedule}/plain_repeat"]
    _assert_bitwise(a, b, f"{schedule} on {world_size} ranks, plain vs plain")
    num_stages, _ = pp.stage_layout(schedule, world_size)
    model, _, _ = _model_and_batch(schedule, world_size, n_mb)
    n_params = sum(1 for _ in model.named_parameters())
    assert len(a["grads"]) == n_params, "every parameter of the model has a gradient on some rank"
    assert len(a["losses"]) == n_mb


@pytest.mark.slow
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_tracker_sees_every_action_in_schedule_order(request, world_size, schedule, n_mb):
    """The tracker observes exactly the schedule's compute actions, and its look-ahead is right."""
    extra = _runs(request, world_size)[f"{schedule}/plain"]["extra"]
    spec = pp.SCHEDULES[schedule]
    for rank, info in extra.items():
        expected = [tuple(a) for a in info["expected_actions"]]
        observed = [tuple(a) for a in info["observed_actions"]]
        assert observed == expected, f"rank {rank}: observed order differs from the schedule's"
        kinds = {a[0] for a in observed}
        assert kinds <= {"F", "B", "I", "W"} and "F" in kinds
        if not spec.splits_backward:
            assert kinds == {"F", "B"}
        phases = info["phases"]
        assert len(phases) == len(observed)
        # The first action is a warm-up forward; phases never go back.
        assert phases[0][0] == "WARMUP" and phases[0][1] == "F"
        order = {"WARMUP": 0, "STEADY": 1, "COOLDOWN": 2}
        assert [order[p[0]] for p in phases] == sorted(order[p[0]] for p in phases)
        # upcoming = the rest of the order; stacked_forwards at each forward = forwards up to
        # the next backward in the order.
        for i, p in enumerate(phases):
            assert [tuple(a) for a in p[6]] == observed[i + 1 :], f"rank {rank} action {i}: upcoming"
        for i, (ph, kind, stage, mb, in_flight, stacked, _) in enumerate(phases):
            if kind != "F":
                continue
            n = 0
            for k, _, _ in observed[i:]:
                if k in ("B", "I"):
                    break
                n += k == "F"
            assert stacked == n, f"rank {rank} action {i}: stacked_forwards {stacked} != {n}"
        # in_flight at a forward = forwards run so far (this one included) minus released ones.
        for i, (ph, kind, stage, mb, in_flight, stacked, _) in enumerate(phases):
            held = set()
            for k, s, m in observed[: i + 1]:
                if k == "F":
                    held.add((s, m))
                elif k in ("B", "W") and (k, s, m) != (kind, stage, mb):
                    held.discard((s, m))
            assert in_flight == len(held), f"rank {rank} action {i}: in_flight {in_flight} != {len(held)}"


@pytest.mark.slow
@pytest.mark.parametrize("policy", PROVISIONED + OVERLAP)
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_bagualu2_is_bitwise_exact(request, world_size, schedule, n_mb, policy):
    """Invariant 1 under pipelining: losses and every gradient equal the plain pipeline's, bit for bit."""
    runs = _runs(request, world_size)
    _assert_bitwise(runs[f"{schedule}/plain_spike"], runs[f"{schedule}/{policy}"],
                    f"{schedule} on {world_size} ranks, {policy} vs plain")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["adaptive", "adaptive+overlap"])
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_adaptive_holds_the_budget_on_every_rank_through_a_spike(request, world_size, schedule, n_mb, variant):
    """Invariant 2: the budget of each rank is what keeping everything needs when routing is calm; with a
    spike on a local expert in stage 0's micro-batch 1 (keep_all goes over it), adaptive stays under it."""
    runs = _runs(request, world_size)
    spiked = [x for info in runs[f"{schedule}/{variant}"]["extra"].values() for x in info["spike_imbalance"]]
    assert spiked and min(spiked) >= 2.4, f"the spike did not take effect: imbalances {spiked}"
    over = []
    for rank, info in runs[f"{schedule}/{variant}"]["extra"].items():
        rep = info["report"]
        keep_peak = runs[f"{schedule}/keep_all"]["extra"][rank]["report"]["peak_bytes"]
        assert rep["budget_bytes"] is not None, rank
        over += [rank] if keep_peak > rep["budget_bytes"] else []
        assert rep["violations"] == 0, f"rank {rank}: {rep}"
        assert rep["peak_bytes"] <= rep["budget_bytes"], (
            f"rank {rank}: peak {rep['peak_bytes']:,} B over the budget {rep['budget_bytes']:,} B "
            f"(keep_all would have peaked at {keep_peak:,} B)")
    assert over, "the spike did not push keep_all over the calm budget on any rank"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_overlap_scheduler_prefetches_ahead_of_each_paired_backward(request, world_size, schedule, n_mb):
    """With overlap=True a rank pairs each forward that directly precedes the backward of another
    micro-batch with that backward, and the schedule's reloads enter the copy engine before the
    backward starts (during the forward or the bubble), not at the backward's first unpack. (A
    forward followed by its own backward, as on 1F1B's last stage, has nothing to overlap.)"""
    paired_somewhere = False
    for rank, info in _runs(request, world_size)[f"{schedule}/offload_all+overlap"]["extra"].items():
        actions = info["expected_actions"]
        pairs = sum(1 for a, b in zip(actions, actions[1:])
                    if a[0] == "F" and b[0] in ("B", "I") and (a[1], a[2]) != (b[1], b[2]))
        ovl = info["report"]["overlap"]
        assert ovl is not None and ovl["pairs"] == pairs, f"rank {rank}: {pairs} pairs expected, {ovl}"
        if pairs:
            paired_somewhere = True
            assert ovl["reloads_forward"] + ovl["reloads_bubble"] > 0, f"rank {rank}: {ovl}"
        assert ovl["infeasible"] == 0 and ovl["worker_errors"] == 0, f"rank {rank}: {ovl}"
    assert paired_somewhere


@pytest.mark.slow
@pytest.mark.parametrize("policy", PROVISIONED + OVERLAP)
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_nothing_resident_after_the_step(request, world_size, schedule, n_mb, policy):
    """Invariant 3: after the step no activation bytes are held and the arena is empty, on every rank,
    zero-bubble schedules (saved tensors unpacked by both the input and the weight backward) included."""
    for rank, info in _runs(request, world_size)[f"{schedule}/{policy}"]["extra"].items():
        rep = info["report"]
        assert rep["resident_bytes"] == 0, f"rank {rank}: {rep['resident_bytes']:,} B still resident"
        assert rep["arena_in_use_bytes"] == 0, f"rank {rank}: {rep['arena_in_use_bytes']:,} B of arena in use"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,schedule,n_mb", CASES, ids=CASE_IDS)
def test_provisioner_sees_each_stage_forward_with_its_phase(request, world_size, schedule, n_mb):
    """One provisioner per rank; one frame per local stage forward (no phantom metadata forward);
    before each, the phase and the forwards still to stack before the next backward."""
    spec = pp.SCHEDULES[schedule]
    for rank, info in _runs(request, world_size)[f"{schedule}/adaptive"]["extra"].items():
        rep = info["report"]
        assert rep["micro_batches"] == n_mb * spec.stages_per_rank, f"rank {rank}: {rep}"
        assert rep["steps"] == 1
        expected = [(p[0].lower(), max(0, p[5] - 1)) for p in info["phases"] if p[1] == "F"]
        assert [tuple(t) for t in info["told"]] == expected + [("none", 0)], f"rank {rank}"


@pytest.mark.slow
def test_adaptive_leaves_room_for_the_forwards_still_to_stack(runs2):
    """Invariant 2 with a tight budget where warm-up stacking matters: a plan exists (release
    everything), so adaptive must not let early micro-batches take the room later ones need."""
    runs = _Runs(runs2)
    exact = runs[f"{TIGHT_SCHEDULE}/adaptive_tight"]
    _assert_bitwise(runs[f"{TIGHT_SCHEDULE}/plain_spike"], exact, f"{TIGHT_SCHEDULE} adaptive, tight budget")
    for rank, info in exact["extra"].items():
        rep = info["report"]
        assert rep["violations"] == 0 and rep["peak_bytes"] <= rep["budget_bytes"], (rank, rep)


@pytest.mark.slow
def test_keep_all_with_raise_would_have_crashed_under_the_adaptive_budget(runs2):
    """The same budget with keep_all and on_exceed="raise" stops the step with BudgetExceededError
    (on a device: the OOM that kills the job); peers see the broken pipeline, not a hang."""
    outcomes = runs2["failures"].get("1f1b/keep_all_raise")
    assert outcomes, "keep_all with on_exceed='raise' finished the step without exceeding the budget"
    raised = [r for r, o in outcomes.items() if o.startswith("BudgetExceededError")]
    assert raised, outcomes
    for rank, what in outcomes.items():
        # The others lost their peer in the middle of the schedule (gloo: connection closed/reset).
        assert rank in raised or "Connection" in what or "connection" in what, (rank, what)


@pytest.mark.slow
def test_1f1b_warmup_depth_matches_stage_position(runs4):
    """1F1B: stage s stacks (stages - s) forwards before its first backward."""
    extra = _Runs(runs4)["1f1b/plain"]["extra"]
    for rank, info in extra.items():
        first = info["phases"][0]
        assert first[5] == 4 - rank, f"rank {rank}: {first}"
        assert max(p[4] for p in info["phases"]) == 4 - rank


# ---------------------------------------------------------------------------------------------
# The budget set mid-run: the overlap driver plans the next pair for the new one
# ---------------------------------------------------------------------------------------------

BUDGETS = (1 << 30, 1 << 29)  # before and after ``prov.budget`` is set; both far above the step's needs


def _budget_change_rank(rank: int, world_size: int, out_path: str) -> None:
    """One 1F1B step under offload_all with the overlap driver; as the first backward on this
    rank ends, ``prov.budget`` changes. Records, in order, the change and the budget each
    schedule the driver asked for was made for."""
    model, tokens, targets = _model_and_batch("1f1b", world_size, 4)
    pipe = pp.build_pipeline(model, "1f1b", n_microbatches=4, microbatch_example=tokens[:MICROBATCH])
    prov = pp.enable_bagualu2(pipe, policy="offload_all", budget=BUDGETS[0], arena_bytes=16 << 20, min_bytes=0,
                              overlap=True)
    prov.runtime.residency.reload_in_place = False  # reloads copy, as on a device: something to schedule
    events: list = []
    scheduler = prov.overlap.scheduler
    solve = scheduler.schedule

    def recording(ops, tasks, budget_bytes, *args, **kwargs):
        events.append(("planned", int(budget_bytes)))
        return solve(ops, tasks, budget_bytes, *args, **kwargs)

    scheduler.schedule = recording

    def on_event(event, state):
        if event == "action_end" and state.action == "B" and not any(e[0] == "set" for e in events):
            prov.budget = BUDGETS[1]
            events.append(("set", prov.budget))

    pipe.tracker.subscribe(on_event)
    torch.manual_seed(SEED + 1)
    pipe.train_step(tokens, targets)
    events.append(("report", prov.report()["budget_bytes"]))
    prov.disable()
    pipe.close()
    torch.save(events, f"{out_path}.{rank}")


@pytest.mark.slow
def test_a_budget_set_mid_run_holds_the_next_schedule(tmp_path):
    out = str(tmp_path / "events")
    harness.launch(_budget_change_rank, 2, out, timeout_s=LAUNCH_TIMEOUT_S)
    planned_after = 0
    for rank in range(2):
        events = torch.load(f"{out}.{rank}", weights_only=True)
        kinds = [e[0] for e in events]
        assert kinds.count("set") == 1 and events[-1] == ("report", BUDGETS[1]), (rank, events)
        at = kinds.index("set")
        assert events[at] == ("set", BUDGETS[1])
        before = [b for k, b in events[:at] if k == "planned"]
        after = [b for k, b in events[at:] if k == "planned"]
        assert all(b == BUDGETS[0] for b in before), (rank, events)
        assert all(b == BUDGETS[1] for b in after), f"rank {rank} planned for a stale budget: {events}"
        planned_after += len(after)
    assert planned_after, "no pair was planned after the budget changed: the test shows nothing"


# ---------------------------------------------------------------------------------------------
# In-process: stage layout and splitting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(pp.SCHEDULES))
@pytest.mark.parametrize("world_size", [2, 4])
def test_stage_layout_matches_torch(schedule, world_size):
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    spec = pp.SCHEDULES[schedule]
    n, layout = pp.stage_layout(schedule, world_size)
    assert n == spec.stages_per_rank * world_size
    assert layout == generate_rank_to_stage_mapping(world_size, n, style=spec.style)


def test_split_model_partitions_parameters_and_preserves_the_forward():
    """Stages share the model's parameters, each exactly once, and chained give its logits bit for bit."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(num_layers=5)
    model = MoETransformer(cfg)
    stages = pp.split_model(model, 3)
    assert [len(s.layers) for s in stages] == [1, 2, 2] or sum(len(s.layers) for s in stages) == 5
    assert [s.layer_indices for s in stages] == [
        list(range(stages[i].layer_offset, stages[i].layer_offset + len(stages[i].layers))) for i in range(3)
    ]
    ids = [id(p) for s in stages for p in s.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    tokens = next(synthetic_batches(cfg.vocab_size, 2, SEQ, seed=0))
    with torch.no_grad():
        x = tokens
        for s in stages:
            x = s(x)
        h = model.embed(tokens) + model.pos_embed(torch.arange(SEQ))
        for layer in model.layers:
            h, _ = layer(h)
        ref = model.lm_head(model.norm(h))
    assert torch.equal(x, ref)


def test_split_objective_matches_the_whole_model():
    """LM loss through the stages + aux losses injected where computed = the model's own loss."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(num_layers=4, aux_loss_coef=0.5)  # large coef: a missing aux term shows
    model = MoETransformer(cfg)
    batch = next(synthetic_batches(cfg.vocab_size, 2, SEQ + 1, seed=0))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    model(tokens, targets=targets).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    x = tokens
    for s in pp.split_model(model, 4):
        x = s(x)
    pp.lm_loss(x, targets).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_split_model_rejects_too_few_blocks():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="cannot split 2 blocks into num_stages=4"):
        pp.split_model(MoETransformer(MoEConfig.tiny(num_layers=2)), 4)


def test_unknown_schedule_and_too_few_microbatches_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        pp.stage_layout("looped", 2)
    assert pp.SCHEDULES["zbv"].min_microbatches(4) == 7
