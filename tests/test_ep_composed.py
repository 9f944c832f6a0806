"""bagualu2 on the reference model composed with FSDP2 and pipelining (gloo on 127.0.0.1):
exactness, budget, no collective in backward, nothing resident (invariants 1, 2, 3 and 6).

Three layouts, one launch each (``pipeline_harness.launch``); every scenario of a launch builds
its model afresh from the same seed and runs the same trace of steps, so the run it is compared
with has the same step history (FSDP2's first step on a model differs from the later ones: the
lazy initialization). Each rank writes its results to its own file; the tests check them.

- ``fsdp``: FSDP2 alone, 2 ranks. ``fully_shard`` on every block, then on the root, and
  ``bagualu2.enable`` in both orders (``enable_first``: enable, then shard; ``shard_first``:
  shard, then enable). The model is the one-process view of an EP rank (``ep_size=2``: experts
  0-3 live here, no process group) so that a spike onto local experts grows the activations;
  every parameter, experts included, is sharded over the 2 ranks.
- ``ep_fsdp``: EP=2 and FSDP2 over the same 2 ranks. Each block is sharded with its experts in
  ``ignored_params`` (and the root with every expert), so the attention, norms, routers,
  embeddings and head are sharded and reduce-scattered over the 2 ranks while each rank's
  experts stay whole and local. That is data parallelism for what every rank holds a copy of,
  and expert parallelism for what only one rank holds (an expert's gradient already sums every
  rank's tokens through the exchange); sharding an expert over the ranks that do not hold it
  would mix the two. The alternative, sharding only attention and norms, would leave the
  routers, embeddings and head unreduced.
- ``ep_pp``: EP x PP, 4 ranks, 1F1B. Pipelines {0, 2} and {1, 3} (stage 0 on ranks 0 and 1,
  stage 1 on ranks 2 and 3), EP groups {0, 1} and {2, 3}: each stage's two ranks hold half of
  that stage's experts each. Every rank creates every group in the same order. No change to
  ``bagualu2.integrations.pipeline`` or the model was needed: ``build_pipeline(..., group=pipeline_group)``
  carries the EP group inside the blocks (its shape pass runs every stage's blocks on every
  rank, so both ranks of an EP group exchange in step there too). ``pipeline_harness.gather_step_result``
  gathers over the whole world, not the pipeline group, so each rank writes its own results.

The spike: with EP, EP rank 0's tokens pick both of the last two experts of EP rank 1 (every
token, ``routing_spike(4.0, experts=[6, 7], ranks=[0])``), so what EP rank 1's experts compute
grows while its own routing stays calm; without EP (``fsdp``), every rank's tokens pick local
experts 2 and 3. Budgets are per rank: 5% above that rank's calm keep_all peak. Backward runs
inside the spike (recompute reruns the router).

Scenarios: ``plain`` (no bagualu2; ``plain_repeat``: twice, or exactness proves nothing),
``keep_all_calm`` (the budgets), ``keep_all``, ``offload_all``, ``recompute_all``, ``adaptive``
(under the budget) and ``random_plan`` (a seeded random per-operator plan over the keys the
profiled steps saw, installed by setting ``prov.policy`` after them; frames are not strict).

Whether a spike needs a release is judged within one run (keep_all's spiked steps against its
calm ones): with ``enable`` before ``fully_shard`` the ledger's count of the same steps differs
from run to run (``test_fsdp2_counts_the_same_bytes_in_both_orders``, an expected failure).
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import bagualu2
from bagualu2.integrations import pipeline as pp
from bagualu2.models import MoEConfig, MoETransformer

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

import pipeline_harness as harness  # noqa: E402

SEED = 2468
BATCH, SEQ = 2, 16
SPIKE = 4.0
TRACE = (False, False, False, True, True, False)  # FSDP layouts: steps with the spike
PP_TRACE = (False, False, True, False)  # pipeline steps (4 micro-batches each) with the spike
PP_MICROBATCHES = 4
LAUNCH_TIMEOUT_S = 300
OPTIONS = dict(min_bytes=0, arena_bytes=16 << 20, calibrate_frames=1)
# fsdp: the one-process view of EP rank 0 (experts 0-3 here): a spike on them grows this rank's
# activations. Wider experts than tiny()'s: the expert share (what the spike moves) is large.
CFG_DP = MoEConfig.tiny(ep_size=2, expert_hidden_size=128)
CFG_EP = MoEConfig.tiny(expert_hidden_size=128)  # sharded over a real EP group
DP_TARGETS = (2, 3)
EP_TARGETS = (6, 7)  # the last two experts of EP rank 1 (of 2)

ORDERS = ("enable_first", "shard_first")
POLICIES = ("keep_all", "offload_all", "recompute_all", "adaptive", "random_plan")
PP_POLICIES = ("keep_all", "recompute_all", "adaptive")
JOBS_FSDP = ("plain", "plain_repeat") + tuple(
    f"{order}/{p}" for order in ORDERS for p in ("keep_all_calm",) + POLICIES)
JOBS_EP_FSDP = ("plain", "plain_repeat", "keep_all_calm") + POLICIES
JOBS_EP_PP = ("plain", "plain_repeat", "keep_all_calm") + PP_POLICIES


# ---------------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _settled_resident(prov: Optional[bagualu2.Provisioner]) -> int:
    if prov is None:
        return 0
    gc.collect()
    prov.runtime.residency.settle(wait=True)
    return prov.runtime.ledger.resident


def _random_plan(prov: bagualu2.Provisioner) -> bagualu2.Plan:
    """One choice per operator key seen so far, from a seeded RNG (recompute only where possible)."""
    rng = random.Random(SEED)
    choices = {}
    for key in sorted(prov.cost.ops):
        options = [bagualu2.Choice.KEEP, bagualu2.Choice.OFFLOAD]
        if prov.cost.ops[key].recomputable:
            options.append(bagualu2.Choice.RECOMPUTE)
        choices[key] = rng.choice(options)
    return bagualu2.Plan(choices)


def _policy_of(job: str) -> str:
    name = job.rpartition("/")[2]
    return "plain" if name.startswith("plain") else name.replace("_calm", "")


def _enable(model: torch.nn.Module, job: str, budgets: Dict[str, int]) -> bagualu2.Provisioner:
    policy = _policy_of(job)
    budget = budgets[job.rpartition("/")[0]] if policy == "adaptive" else None
    fixed = bagualu2.Plan({}) if policy == "random_plan" else policy
    return bagualu2.enable(model, budget=budget, policy=fixed, **OPTIONS)


def _summary(prov: bagualu2.Provisioner) -> Dict[str, Any]:
    report = prov.report()
    return {k: report[k] for k in ("peak_bytes", "budget_bytes", "violations", "resident_bytes",
                                   "arena_in_use_bytes", "saved_bytes_by_choice", "gates", "micro_batches")}


def _shard(model: MoETransformer, ep: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    everything_ignored = set()
    for layer in model.layers:
        ignored = set(layer.moe.experts.parameters()) if ep else None
        everything_ignored |= ignored or set()
        fully_shard(layer, ignored_params=ignored)
    fully_shard(model, ignored_params=everything_ignored or None)


def _fsdp_job(rank: int, job: str, budgets: Dict[str, int], ep: bool) -> Dict[str, Any]:
    order = job.partition("/")[0] if "/" in job else "shard_first"
    policy = _policy_of(job)
    torch.manual_seed(SEED)
    model = MoETransformer(CFG_EP, ep_group=dist.group.WORLD) if ep else MoETransformer(CFG_DP)
    prov = None
    if policy != "plain" and order == "enable_first":
        prov = _enable(model, job, budgets)
    _shard(model, ep)
    if policy != "plain" and order == "shard_first":
        prov = _enable(model, job, budgets)
    cfg = model.cfg
    out: Dict[str, Any] = {"losses": [], "grads": [], "collectives": [], "resident_after": [],
                           "sharded": sum(hasattr(p, "to_local") for p in model.parameters()),
                           "local_params": sum(not hasattr(p, "to_local") for p in model.parameters())}
    trace = tuple(False for _ in TRACE) if job.endswith("_calm") else TRACE
    for i, spiked in enumerate(trace):
        if prov is not None and policy == "random_plan" and i == prov.profile_frames:
            prov.policy = _random_plan(prov)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(SEED + i)
        g = torch.Generator().manual_seed(SEED + 1000 * rank + i)
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
        if not spiked:
            spike = contextlib.nullcontext()
        elif ep:
            spike = model.routing_spike(SPIKE, experts=EP_TARGETS, ranks=[0])
        else:
            spike = model.routing_spike(SPIKE, experts=DP_TARGETS)
        with spike:  # backward inside the spike too: recompute reruns the router
            loss = model(tokens)
            with harness.CollectiveCounter() as counter:
                loss.backward()
        out["losses"].append(loss.detach().clone())
        out["grads"].append([_local(p.grad) for p in model.parameters()])
        out["collectives"].append(counter.count)
        del loss
        out["resident_after"].append(_settled_resident(prov))
        if prov is not None:
            prov.step()
    if prov is not None:
        out["report"] = _summary(prov)
        out["peaks"] = [m.peak_bytes for m in prov.telemetry.micro_batches]
        if job.endswith("_calm"):
            budgets[job.rpartition("/")[0]] = int(out["report"]["peak_bytes"] * 1.05)
        prov.disable()
    return out


def _pp_groups(rank: int):
    """Every rank creates every group, in the same order: pipelines {0, 2} and {1, 3}, EP
    groups {0, 1} (stage 0) and {2, 3} (stage 1)."""
    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pipelines[rank % 2], eps[rank // 2]


def _pp_job(rank: int, job: str, budgets: Dict[str, int], groups) -> Dict[str, Any]:
    pp_group, ep_group = groups
    policy = _policy_of(job)
    torch.manual_seed(SEED)
    model = MoETransformer(CFG_EP, ep_group=ep_group)
    pair = rank % 2  # the pipeline (data-parallel replica) this rank belongs to: its own tokens

    def batch(step: int):
        g = torch.Generator().manual_seed(SEED + 1000 * pair + step)
        seqs = torch.randint(0, CFG_EP.vocab_size, (BATCH * PP_MICROBATCHES, SEQ + 1), generator=g)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    tokens, _ = batch(0)
    pipe = pp.build_pipeline(model, "1f1b", n_microbatches=PP_MICROBATCHES, microbatch_example=tokens[:BATCH],
                             group=pp_group)
    assert [m.stage_index for m in pipe.modules] == [rank // 2]
    # Collectives of each backward action (the schedule's sends and receives run outside them).
    backward_collectives: List[int] = []
    stage = pipe.stages[0]
    inner = stage.backward_one_chunk

    def counted_backward(*args, **kwargs):
        with harness.CollectiveCounter() as counter:
            result = inner(*args, **kwargs)
        backward_collectives[-1] += counter.count
        return result

    stage.backward_one_chunk = counted_backward
    prov = None
    if policy != "plain":
        budget = budgets["ep_pp"] if policy == "adaptive" else None
        prov = pp.enable_bagualu2(pipe, budget=budget, policy=policy, **OPTIONS)
    out: Dict[str, Any] = {"losses": [], "grads": [], "collectives": backward_collectives, "resident_after": []}
    trace = tuple(False for _ in PP_TRACE) if job.endswith("_calm") else PP_TRACE
    for i, spiked in enumerate(trace):
        pipe.zero_grad()
        torch.manual_seed(SEED + i)
        tokens, targets = batch(i)
        backward_collectives.append(0)
        spike = (model.routing_spike(SPIKE, experts=EP_TARGETS, ranks=[0]) if spiked
                 else contextlib.nullcontext())
        with spike:
            losses = pipe.train_step(tokens, targets)
        out["losses"].append([loss.detach().clone() for loss in losses])
        out["grads"].append([_local(p.grad) for p in pipe.parameters()])
        del losses
        out["resident_after"].append(_settled_resident(prov))
    out["received"] = [layer.moe.dispatcher.last_received.sum(0).tolist() for layer in pipe.modules[0].layers]
    if prov is not None:
        out["report"] = _summary(prov)
        out["peaks"] = [m.peak_bytes for m in prov.telemetry.micro_batches]
        if job.endswith("_calm"):
            budgets["ep_pp"] = int(out["report"]["peak_bytes"] * 1.05)
        prov.disable()
    pipe.close()
    return out


def _rank_main(rank: int, world_size: int, layout: str, jobs: tuple, out_dir: str) -> None:
    """Run ``jobs`` in order; each result (or the failure that ended this rank) goes to the
    rank's own file as soon as it is known."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    results: Dict[str, Any] = {}
    budgets: Dict[str, int] = {}
    groups = _pp_groups(rank) if layout == "ep_pp" else None
    for job in jobs:
        try:
            if layout == "ep_pp":
                results[job] = _pp_job(rank, job, budgets, groups)
            else:
                results[job] = _fsdp_job(rank, job, budgets, ep=layout == "ep_fsdp")
        except BaseException as e:  # noqa: BLE001 - recorded for the tests, then this rank leaves
            results[job] = {"error": type(e).__name__, "message": str(e)[:500],
                            "traceback": traceback.format_exc()[-4000:]}
            torch.save(results, path)
            os._exit(3)  # skip the collective shutdown: a peer may be waiting in a collective
        torch.save(results, path)


def _launch(layout: str, world_size: int, jobs: tuple, tmp_path_factory) -> List[Dict[str, Any]]:
    out_dir = str(tmp_path_factory.mktemp(layout))
    failure: Optional[BaseException] = None
    try:
        harness.launch(_rank_main, world_size, layout, jobs, out_dir, timeout_s=LAUNCH_TIMEOUT_S, grace_s=20)
    except Exception as e:  # noqa: BLE001 - the per-rank files say which job failed and why
        failure = e
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
    for rank, res in enumerate(results):
        for job, got in res.items():
            assert "error" not in got, f"rank {rank} {job}: {got['error']}: {got['message']}\n{got['traceback']}"
    for job in jobs:
        for rank, res in enumerate(results):
            assert job in res, f"rank {rank} did not get to {job} ({failure!r})"
    return results


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _launch("fsdp", 2, JOBS_FSDP, tmp_path_factory)


@pytest.fixture(scope="module")
def ep_fsdp(tmp_path_factory):
    return _launch("ep_fsdp", 2, JOBS_EP_FSDP, tmp_path_factory)


@pytest.fixture(scope="module")
def ep_pp(tmp_path_factory):
    return _launch("ep_pp", 4, JOBS_EP_PP, tmp_path_factory)


def _differences(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """What differs bit for bit between two runs: ``step i loss`` / ``step i grad j``."""
    diffs = []
    for i, (la, lb) in enumerate(zip(a["losses"], b["losses"])):
        la, lb = (la, lb) if isinstance(la, list) else ([la], [lb])
        if len(la) != len(lb) or not all(torch.equal(x, y) for x, y in zip(la, lb)):
            diffs.append(f"step {i} loss")
    for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        assert len(ga) == len(gb)
        diffs.extend(f"step {i} grad {j}" for j, (x, y) in enumerate(zip(ga, gb)) if not torch.equal(x, y))
    assert len(a["losses"]) == len(b["losses"]) and len(a["grads"]) == len(b["grads"])
    return diffs


def _check_composed(results: List[Dict[str, Any]], jobs: tuple) -> None:
    """Every provisioned scenario, on every rank: bit-exact against the plain run, no violation,
    the plain run's collectives in backward, nothing resident after each step."""
    for rank, res in enumerate(results):
        assert not _differences(res["plain"], res["plain_repeat"]), f"rank {rank}: the baseline does not repeat"
        plain = res["plain"]
        assert all(c > 0 for c in plain["collectives"]), plain["collectives"]  # the counter sees them
        for job in jobs:
            if _policy_of(job) == "plain":
                continue
            got = res[job]
            if not job.endswith("_calm"):
                diffs = _differences(plain, got)
                assert not diffs, f"rank {rank} {job}: not bit-exact: {diffs[:8]}"
            assert got["collectives"] == plain["collectives"], f"rank {rank} {job}: {got['collectives']}"
            assert got["report"]["violations"] == 0, f"rank {rank} {job}: {got['report']}"
            assert got["resident_after"] == [0] * len(got["resident_after"]), f"rank {rank} {job}"
            assert got["report"]["resident_bytes"] == 0 and got["report"]["arena_in_use_bytes"] == 0, got["report"]


def _check_spike_needs_a_release(results: List[Dict[str, Any]], prefix: str, rank: int,
                                 trace: tuple = TRACE, per_step: int = 1) -> None:
    """On ``rank`` keeping everything through the spike needs more than 5% above the calm
    steps (of the same run: see ``test_fsdp2_counts_the_same_bytes_in_both_orders`` for why
    not against another run's); adaptive stays under its budget (on every rank) by offloading
    or recomputing."""
    for r, res in enumerate(results):
        report = res[f"{prefix}adaptive"]["report"]
        assert report["violations"] == 0 and report["peak_bytes"] <= report["budget_bytes"], f"rank {r}: {report}"
    res = results[rank]
    peaks = res[f"{prefix}keep_all"]["peaks"]
    assert len(peaks) == per_step * len(trace)
    spiked = max(p for i, p in enumerate(peaks) if trace[i // per_step])
    # The first step is left out: FSDP2's lazy initialization runs inside it (buffers it makes
    # count as held from outside the forward), which no later step repeats.
    calm = max(p for i, p in enumerate(peaks) if i >= per_step and not trace[i // per_step])
    assert spiked > 1.05 * calm, f"rank {rank}: the spike needs no release: {peaks}"
    released = res[f"{prefix}adaptive"]["report"]["saved_bytes_by_choice"]
    assert released.get("offload", 0) + released.get("recompute", 0) > 0, released


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp2_in_both_orders_of_enable_and_fully_shard(fsdp):
    """FSDP2 alone, 2 ranks, ``bagualu2.enable`` before and after ``fully_shard``: keep_all,
    offload_all, recompute_all, a random per-operator plan and adaptive (through spikes, under
    5% above the calm keep_all peak) give every rank the plain FSDP2 run's loss and local
    gradient shards bit for bit, with no violation, FSDP2's own collectives in backward and
    nothing else, and nothing resident after a step."""
    for rank, res in enumerate(fsdp):
        assert res["plain"]["local_params"] == 0  # every parameter is sharded
    _check_composed(fsdp, JOBS_FSDP)
    for order in ORDERS:
        for rank in range(2):  # without EP, both ranks' tokens spike
            _check_spike_needs_a_release(fsdp, f"{order}/", rank)
        for rank, res in enumerate(fsdp):
            assert res[f"{order}/adaptive"]["report"]["gates"] == [f"layers.{i}.moe.router"
                                                                  for i in range(CFG_DP.num_layers)]


@pytest.mark.slow
def test_ep_and_fsdp2_on_the_same_ranks(ep_fsdp):
    """EP=2 with FSDP2 sharding everything but the experts over the same 2 ranks: every policy
    bit-exact against the same run without bagualu2, no violation, no collective added in
    backward (the plain run's: FSDP2's plus the exchanges), nothing resident; rank 1's experts
    receive rank 0's spike, and adaptive holds rank 1's budget through it."""
    for rank, res in enumerate(ep_fsdp):
        plain = res["plain"]
        assert plain["sharded"] > 0 and plain["local_params"] == 3 * 4 * CFG_EP.num_layers  # 4 experts x 3
    _check_composed(ep_fsdp, JOBS_EP_FSDP)
    _check_spike_needs_a_release(ep_fsdp, "", rank=1)
    for res in ep_fsdp:
        assert res["adaptive"]["report"]["gates"] == [f"layers.{i}.moe.dispatcher" for i in range(CFG_EP.num_layers)]


@pytest.mark.slow
def test_ep_by_pp_with_1f1b(ep_pp):
    """EP x PP on 4 ranks, 1F1B over 2 stages, EP=2 within each stage: keep_all, recompute_all
    and adaptive bit-exact on every rank against the same pipeline without bagualu2, no
    violation on any rank, the plain run's collectives in every backward action, nothing
    resident after a step; EP rank 1 of each stage (ranks 1 and 3) receives the spike EP rank 0
    routed, and adaptive holds their budgets through it."""
    for rank, res in enumerate(ep_pp):
        losses = res["plain"]["losses"]
        assert all(len(step) == (PP_MICROBATCHES if rank >= 2 else 0) for step in losses), rank
    _check_composed(ep_pp, JOBS_EP_PP)
    for rank in (1, 3):
        _check_spike_needs_a_release(ep_pp, "", rank, PP_TRACE, PP_MICROBATCHES)
    for res in ep_pp:
        assert res["adaptive"]["report"]["gates"] == ["layers.0.moe.dispatcher"]


@pytest.mark.slow
def test_fsdp2_counts_the_same_bytes_in_both_orders(fsdp):
    """The same calm steps save the same tensors whichever of ``enable`` and ``fully_shard`` came
    first, so the ledger's per-micro-batch peaks should agree."""
    for rank, res in enumerate(fsdp):
        assert res["enable_first/keep_all_calm"]["peaks"] == res["shard_first/keep_all_calm"]["peaks"], rank
