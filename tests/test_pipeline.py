"""Pipeline parallelism on torch.distributed.pipelining: bagualu2 per stage, gloo on CPU.

The multi-process tests start their own ranks (``bagualu2.pipeline.launch``: spawned
processes, 127.0.0.1, a free port, a hard timeout). To keep the suite short, one launch per
world size runs every scenario in sequence (each from a freshly built model) and rank 0
writes all results to one file; the tests below then check one invariant each on those
results. Scenarios:

- ``plain``: the pipeline without bagualu2 (run twice: the baseline must repeat bit for bit,
  or the exactness checks would prove nothing);
- ``adaptive``: ``bagualu2.enable(stage modules of this rank, budget=tight, policy="adaptive")``
  with a routing spike forced into one micro-batch of one stage (the same spike as in the
  baseline run it is compared with).
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from bagualu2 import pipeline as pp
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches

SEED = 1234
SEQ = 16
MICROBATCH = 2
LAUNCH_TIMEOUT_S = 170

# (schedule, micro-batches) run on each world size. Every schedule runs on 2 ranks; 4 ranks
# repeat one single-stage-per-rank and one zero-bubble schedule (8 stages, time-bounded).
SCHEDULES_2 = [("gpipe", 4), ("1f1b", 4), ("interleaved1f1b", 4), ("zbv", 4), ("dualpipev", 4)]
SCHEDULES_4 = [("1f1b", 4), ("zbv", 8)]


# ---------------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------------


def _model_and_batch(schedule: str, world_size: int, n_microbatches: int, dropout: float = 0.0):
    num_stages, _ = pp.stage_layout(schedule, world_size)
    cfg = MoEConfig.tiny(num_layers=num_stages, dropout=dropout)
    torch.manual_seed(SEED)
    model = MoETransformer(cfg)
    batch = next(synthetic_batches(cfg.vocab_size, MICROBATCH * n_microbatches, SEQ + 1, seed=SEED))
    return model, batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def _run_job(rank: int, world_size: int, job: dict) -> dict | None:
    schedule, n_mb = job["schedule"], job["n_microbatches"]
    torch.manual_seed(SEED)  # dropout streams start from the same state in every scenario
    model, tokens, targets = _model_and_batch(schedule, world_size, n_mb, job.get("dropout", 0.0))
    pipe = pp.build_pipeline(model, schedule, n_microbatches=n_mb, microbatch_example=tokens[:MICROBATCH])
    phases: list[tuple] = []
    pipe.tracker.subscribe(
        lambda ev, st: phases.append((st.phase.name, st.action, st.stage_index, st.microbatch,
                                      st.in_flight, st.stacked_forwards, list(st.upcoming)))
        if ev == "action_begin" else None
    )
    losses = pipe.train_step(tokens, targets)
    extra = {
        "expected_actions": pipe.tracker.expected_actions,
        "observed_actions": pipe.tracker.observed_actions,
        "phases": phases,
        "stages": [m.stage_index for m in pipe.modules],
    }
    result = pp.gather_step_result(pipe, losses, extra=extra)
    pipe.close()
    if result is None:
        return None
    return {"losses": result.losses, "grads": result.grads, "extra": result.extra}


def _rank_main(rank: int, world_size: int, jobs: list[dict], out_path: str) -> None:
    results = {}
    for job in jobs:
        try:
            out = _run_job(rank, world_size, job)
        except Exception:
            # Record and re-raise: the launcher reports the failing rank; the file says which job.
            with open(f"{out_path}.rank{rank}.err", "w") as f:
                f.write(f"{job}\n{traceback.format_exc()}")
            raise
        if rank == 0:
            results[job["name"]] = out
            torch.save(results, out_path)


def _jobs(schedules) -> list[dict]:
    jobs = []
    for schedule, n_mb in schedules:
        for variant in ("plain", "plain_repeat"):
            jobs.append({"name": f"{schedule}/{variant}", "schedule": schedule,
                         "n_microbatches": n_mb, "variant": variant})
    return jobs


def _launch(world_size: int, schedules, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp(f"pp{world_size}") / "results.pt")
    try:
        pp.launch(_rank_main, world_size, _jobs(schedules), out, timeout_s=LAUNCH_TIMEOUT_S)
    except Exception as e:
        errs = [open(f"{out}.rank{r}.err").read() for r in range(world_size) if os.path.exists(f"{out}.rank{r}.err")]
        raise AssertionError(f"pipeline ranks failed: {e}\n" + "\n".join(errs)) from e
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    return _launch(2, SCHEDULES_2, tmp_path_factory)


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    return _launch(4, SCHEDULES_4, tmp_path_factory)


CASES = [(2, s, n) for s, n in SCHEDULES_2] + [(4, s, n) for s, n in SCHEDULES_4]
CASE_IDS = [f"{w}ranks-{s}" for w, s, _ in CASES]


def _runs(request, world_size: int) -> dict:
    return request.getfixturevalue(f"runs{world_size}")


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
def test_1f1b_warmup_depth_matches_stage_position(runs4):
    """1F1B: stage s stacks (stages - s) forwards before its first backward."""
    extra = runs4["1f1b/plain"]["extra"]
    for rank, info in extra.items():
        first = info["phases"][0]
        assert first[5] == 4 - rank, f"rank {rank}: {first}"
        assert max(p[4] for p in info["phases"]) == 4 - rank


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
