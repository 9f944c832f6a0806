"""Resume equals the uninterrupted run with real expert parallelism (reference model, 2 gloo
ranks, each process started fresh).

The first launch trains the whole trace, checkpointing each rank's model, optimizer, RNG and
provisioner (``prov.state_dict()``, this rank's own entry) part way; a second launch, new
processes, builds the model again, loads the checkpoint and trains the rest. Every later loss
and gradient is bit-exact with the run that never stopped; the resumed run profiles and
calibrates nothing, decides from the bytes the uninterrupted run decided from, and plans the
first spike after the resume on the rank it lands on (rank 1: rank 0's tokens spike onto rank
1's experts). A third launch resumes without the provisioner's state: the control, which starts
over and does not plan that spike. tests/test_rank_kill.py trains, checkpoints and resumes
with the helpers here.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers below

import pipeline_harness as harness  # noqa: E402

SEED = 4321
BATCH, SEQ = 2, 16
CFG = MoEConfig.tiny(expert_hidden_size=128)
# releases="operators": what a resume restores is the planner's learned state (block reruns need
# the blocks seen traced in this process, relearned by the first forward after a resume).
OPTIONS = dict(min_bytes=0, arena_bytes=16 << 20, calibrate_frames=1, releases="operators")
SPIKE = 4.0
TRACE = (False, False, False, True, True, True, False, True, True, False)
CHECKPOINT_AFTER = 5
LAUNCH_TIMEOUT_S = 300


def make_model() -> MoETransformer:
    """The reference model, the same on every launch, its experts split over the default group."""
    torch.manual_seed(SEED)
    return MoETransformer(CFG, ep_group=dist.group.WORLD)


def _spike(model: MoETransformer, spiked: bool) -> Any:
    if not spiked:
        return contextlib.nullcontext()
    last = 2 * CFG.num_experts // model.ep_size - 1
    return model.routing_spike(SPIKE, experts=[last - 1, last], ranks=[0])


def train_step(model: MoETransformer, rank: int, i: int) -> Dict[str, Any]:
    """Forward and backward of step ``i`` of ``TRACE`` on ``rank``: its loss and gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED + i)
    g = torch.Generator().manual_seed(SEED + 1000 * rank + i)
    with _spike(model, TRACE[i]):
        loss = model(torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g))
        loss.backward()
    return {"loss": loss.detach(), "grads": [p.grad.clone() for p in model.parameters()]}


def budget_for(rank: int) -> int:
    """5% above what keeping everything takes on this rank without the spike."""
    model = make_model()
    prov = bagualu2.enable(model, budget=None, policy="keep_all", **OPTIONS)
    for i in range(2):
        train_step(model, rank, i)
    peak = prov.report()["peak_bytes"]
    prov.disable()
    return int(peak * 1.05)


def save_checkpoint(path: str, model: MoETransformer, opt: torch.optim.Optimizer, prov: Any, budget: int,
                    write: Callable[[Dict[str, Any], str], None] = torch.save) -> None:
    """This rank's checkpoint: model, optimizer, RNG, provisioner and budget. ``write(state, tmp)``
    writes it to ``<path>.tmp``, which is then renamed over ``path`` (atomic on POSIX), so
    ``path`` is always a whole checkpoint or absent, whenever the process dies."""
    tmp = f"{path}.tmp"
    write({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
           "bagualu2": prov.state_dict(), "budget": budget}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, model: MoETransformer, opt: torch.optim.Optimizer,
                    load_provisioner: bool = True) -> Any:
    """Enable bagualu2 on ``model`` with the saved budget and load ``path`` into the model, the
    optimizer, the RNG and (unless ``load_provisioner`` is false: the control) the provisioner."""
    saved = torch.load(path, weights_only=True)
    prov = bagualu2.enable(model, budget=saved["budget"], **OPTIONS)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    if load_provisioner:
        prov.load_state_dict(saved["bagualu2"])
    return prov


def summary(prov: Any, steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What a launch hands back: its steps, and per micro-batch (index, traced, calibrating, first
    decision's predicted bytes, fallbacks, violations), the micro-batches a gate planned a release
    for, the cost model's profiled frames and the provisioner state's keys."""
    decided: Dict[int, int] = {}
    for d in prov.telemetry.decisions:
        decided.setdefault(d.micro_batch, d.predicted_bytes)
    planned = sorted({d.micro_batch for d in prov.telemetry.decisions if d.planned_bytes < d.predicted_bytes})
    records = [(m.micro_batch, m.traced, m.calibrating, decided.get(m.micro_batch), m.fallbacks, m.violations)
               for m in prov.telemetry.micro_batches]
    return {"steps": steps, "records": records, "planned": planned, "profiled": prov.cost.frames,
            "state_keys": sorted(prov.state_dict())}


def _rank_main(rank: int, world_size: int, mode: str, out_dir: str) -> None:
    path = os.path.join(out_dir, f"checkpoint{rank}.pt")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "whole":
        budget = budget_for(rank)
        prov = bagualu2.enable(model, budget=budget, **OPTIONS)
        first = 0
    else:
        prov = load_checkpoint(path, model, opt, load_provisioner=mode == "resumed")
        first = CHECKPOINT_AFTER
    steps: List[Dict[str, Any]] = []
    for i in range(first, len(TRACE)):
        if mode == "whole" and i == CHECKPOINT_AFTER:
            save_checkpoint(path, model, opt, prov, budget)
        steps.append(train_step(model, rank, i))
        opt.step()
        prov.step()
    torch.save(summary(prov, steps[CHECKPOINT_AFTER - first:]), os.path.join(out_dir, f"{mode}{rank}.pt"))


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory: Any) -> Dict[str, List[Dict[str, Any]]]:
    out_dir = str(tmp_path_factory.mktemp("resume_ep"))
    runs = {}
    for mode in ("whole", "resumed", "cold"):
        harness.launch(_rank_main, 2, mode, out_dir, timeout_s=LAUNCH_TIMEOUT_S)
        runs[mode] = [torch.load(os.path.join(out_dir, f"{mode}{r}.pt"), weights_only=False) for r in range(2)]
    return runs


@pytest.mark.slow
def test_resumed_ep_ranks_are_bit_exact_with_the_uninterrupted_run(ep_runs: Dict[str, Any]) -> None:
    for rank in range(2):
        whole, resumed = ep_runs["whole"][rank]["steps"], ep_runs["resumed"][rank]["steps"]
        assert len(whole) == len(resumed) == len(TRACE) - CHECKPOINT_AFTER
        for a, b in zip(whole, resumed):
            assert torch.equal(a["loss"], b["loss"]), rank
            assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), rank


@pytest.mark.slow
def test_each_ep_rank_resumes_its_own_state_and_plans_the_first_spike(ep_runs: Dict[str, Any]) -> None:
    for rank in range(2):
        whole, resumed, cold = (ep_runs[m][rank] for m in ("whole", "resumed", "cold"))
        assert resumed["state_keys"] == [f"rank_{rank}"]
        later = [r[:4] for r in whole["records"] if r[0] >= CHECKPOINT_AFTER]
        assert [r[:4] for r in resumed["records"]] == later, rank
        assert not any(r[2] for r in resumed["records"])  # no calibrating micro-batch
        assert resumed["profiled"] == whole["profiled"]  # nothing profiled again
        assert resumed["records"][0][0] == CHECKPOINT_AFTER and not any(r[5] for r in resumed["records"])
        if rank == 1:  # where the spike lands: traced, and a gate's plan released
            assert resumed["records"][0][1]
            assert CHECKPOINT_AFTER in whole["planned"] and CHECKPOINT_AFTER in resumed["planned"]
            # The control starts over: its first micro-batch (that spike) is profiled, not planned.
            assert cold["records"][0][1] and 0 not in cold["planned"]
