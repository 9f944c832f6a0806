"""Per-rank code of tests/test_resume_torchtitan.py: a tiny torchtitan Qwen3-MoE under FSDP2 +
EP=2 trained through routing spikes, checkpointed and resumed by torchtitan's own
``CheckpointManager`` (DCP). Run in processes started by ``pipeline_harness.launch``.

Modes: ``"whole"`` trains the whole trace, saving a checkpoint after ``CHECKPOINT_AFTER`` steps
(model, optimizers, learning-rate schedulers, the train state with this rank's RNG, and the
provisioner through ``add_to_checkpoint``); ``"resumed"`` is a new process that builds the same
run, loads that checkpoint and trains the rest; ``"cold"`` does the same with the provisioner
left out of the load (torchtitan's ``exclude_from_loading``), the control.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch.distributed.checkpoint.stateful import Stateful

import torchtitan_ranks as ranks

SEED = 4321
# Rank 0 routes every token to both of rank 1's experts (2 and 3) in these steps, which doubles
# what rank 1's experts receive; the first step after the checkpoint is the third of a run of
# spikes.
TRACE = (False, False, False, True, True, True, False, True, True, False)
CHECKPOINT_AFTER = 5
SPIKE_RANK, SPIKE_EXPERTS = 0, (2, 3)
OPTIONS = dict(min_bytes=0, calibrate_frames=1)
# Below keep_all's calm peak, so that spikes need a plan and a micro-batch before the checkpoint
# calibrates; above what a calm micro-batch predicts, so that calm ones need none.
BUDGET_OF_CALM_PEAK = 0.9


class TrainState(Stateful):
    """The loop's step and this rank's RNG, which draws its batches here as a data loader would.
    The RNG is saved under this rank's own key: ranks draw different batches, and DCP keeps one
    copy of a tensor every rank saves under the same name."""

    def __init__(self, rank: int) -> None:
        self.step, self._rng = 0, f"rng_rank{rank}"

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, self._rng: torch.get_rng_state()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.step = state_dict["step"]
        torch.set_rng_state(state_dict[self._rng])


def _calm_peak(run: Any) -> int:
    """keep_all's peak over two calm steps of fixed batches, no optimizer step (the weights
    stay as they are)."""
    import bagualu2

    prov = bagualu2.enable(run.parts[0], budget=None, policy="keep_all", **OPTIONS)
    for i in range(2):
        ranks.step(run, i)
    peak = prov.report()["peak_bytes_with_backward"]
    prov.disable()
    return peak


def resume_case(rank: int, world: int, mode: str, out: str) -> None:
    """Train (``mode`` ``"whole"``) or resume (``"resumed"``, ``"cold"``) on this rank; writes
    this rank's steps after the checkpoint and its decisions to ``out/<mode><rank>.pt``."""
    import bagualu2
    from bagualu2.integrations import torchtitan as adapter
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    run = ranks.build(world, ep=2)
    budget_file = Path(out, f"budget{rank}.json")
    if mode == "whole":
        budget_file.write_text(json.dumps(int(_calm_peak(run) * BUDGET_OF_CALM_PEAK)))
        torch.manual_seed(SEED + rank)
    optim_config = default_adamw(lr=1e-3)
    optim_config.implementation = "for-loop"  # "fused", torchtitan's default, is CUDA's
    optimizers = optim_config.build(model_parts=run.parts)
    # Warm-up past the checkpoint: the resumed run must restore the schedule to match.
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=CHECKPOINT_AFTER + 2).build(
        optimizers=optimizers, training_steps=len(TRACE))
    prov = bagualu2.enable(run.parts[0], budget=json.loads(budget_file.read_text()), **OPTIONS)
    train_state = TrainState(rank)
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=CHECKPOINT_AFTER, keep_latest_k=0,
        load_only=mode != "whole",  # the resumed runs leave the whole run's checkpoints as they are
        exclude_from_loading=["bagualu2"] if mode == "cold" else [],
    ).build(dataloader=None, model_parts=run.parts, optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=out)
    adapter.add_to_checkpoint(checkpointer, prov)
    if mode != "whole":
        assert checkpointer.load(step=CHECKPOINT_AFTER) and train_state.step == CHECKPOINT_AFTER

    def update() -> None:
        optimizers.step()
        lr_schedulers.step()

    steps: List[Dict[str, Any]] = []
    while train_state.step < len(TRACE):
        ranks.set_spike(run, TRACE[train_state.step] and rank == SPIKE_RANK, *SPIKE_EXPERTS)
        lr = optimizers.optimizers[0].param_groups[0]["lr"]
        result = {**ranks.step(run, None, update), "lr": lr}
        if train_state.step >= CHECKPOINT_AFTER:
            steps.append(result)
        train_state.step += 1
        prov.step()
        checkpointer.save(train_state.step)  # as torchtitan's Trainer: after the step, counted from 1
    checkpointer.close()

    decided: Dict[int, int] = {}
    for d in prov.telemetry.decisions:
        decided.setdefault(d.micro_batch, d.predicted_bytes)
    planned = sorted({d.micro_batch for d in prov.telemetry.decisions if d.planned_bytes < d.predicted_bytes})
    records = [(m.micro_batch, m.traced, m.calibrating, decided.get(m.micro_batch), m.violations)
               for m in prov.telemetry.micro_batches]
    torch.save({"steps": steps, "records": records, "planned": planned, "profiled": prov.cost.frames,
                "state_keys": sorted(prov.state_dict())},
               Path(out, f"{mode}{rank}.pt"))
