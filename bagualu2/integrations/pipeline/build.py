"""Building this rank's part of a pipeline: its torch stages, the schedule and its tracker.

``build_pipeline(model, schedule, ...)`` builds this rank's ``PipelineStage`` objects and the
named schedule over them, wraps the schedule in a ``PipelinePhaseTracker`` and returns a
``Pipeline``: ``pipe.train_step(tokens, targets)`` runs one schedule step and returns this
rank's per-micro-batch losses (on the last stage's rank). The caller launches the ranks and
creates the process group, as for any ``torch.distributed`` job (torchrun:
examples/pipeline_1f1b.py).

Invariant: stages are built with static shapes taken from one no-grad pass that leaves the RNG
untouched, so no hidden metadata-inference forward ever reaches a provisioned module.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from bagualu2.integrations.pipeline.phases import PipelinePhaseTracker
from bagualu2.integrations.pipeline.schedules import schedule_spec, stage_layout
from bagualu2.integrations.pipeline.stages import StageModule, lm_loss, split_model

__all__ = ["Pipeline", "build_pipeline"]


@dataclasses.dataclass
class Pipeline:
    """This rank's part of a pipeline: stage modules, torch stages, the schedule, its tracker."""

    schedule_name: str
    schedule: Any
    stages: list[PipelineStage]
    modules: list[StageModule]
    tracker: PipelinePhaseTracker
    rank: int
    world_size: int
    num_stages: int
    n_microbatches: int

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def zero_grad(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=True)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """One schedule step on the whole batch; returns per-micro-batch losses (last-stage rank only)."""
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return losses

    def close(self) -> None:
        """Remove the tracker's wrappers (``prov.disable()`` undoes what ``enable_bagualu2`` wired)."""
        self.tracker.close()


def _example_like(t: torch.Tensor) -> torch.Tensor:
    e = torch.empty_like(t)
    return e.requires_grad_() if e.is_floating_point() else e


def _example_shapes(
    modules: Sequence[nn.Module], example: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) example tensors of every stage, from one no-grad pass (RNG untouched)."""
    shapes = []
    x = example
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for m in modules:
            y = m(x)
            # Float tensors between stages carry gradients; their example says so, or torch
            # derives no gradient metadata and the previous stage gets no output gradient.
            shapes.append((_example_like(x), _example_like(y)))
            x = y
    return shapes


def build_pipeline(
    model: nn.Module,
    schedule: str,
    *,
    n_microbatches: int,
    microbatch_example: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    stage_modules: Sequence[StageModule] | None = None,
    scale_grads: bool = True,
) -> Pipeline:
    """Build this rank's stages of ``model`` and the named schedule over them.

    ``microbatch_example`` is one micro-batch of model input (token ids); it fixes the shapes
    sent between stages so PipelineStage runs in static mode (no metadata-inference forward).
    Every rank must build ``model`` from the same seed. ``stage_modules`` overrides
    ``split_model(model, num_stages)``.
    """
    spec = schedule_spec(schedule)
    rank = dist.get_rank(group) if rank is None else rank
    world_size = dist.get_world_size(group) if world_size is None else world_size
    num_stages, rank_to_stages = stage_layout(spec.name, world_size)
    if n_microbatches < spec.min_microbatches(world_size):
        raise ValueError(
            f"{spec.name} on {world_size} ranks needs at least {spec.min_microbatches(world_size)} "
            f"micro-batches; got {n_microbatches=}"
        )
    all_modules = list(stage_modules) if stage_modules is not None else split_model(model, num_stages)
    if len(all_modules) != num_stages:
        raise ValueError(f"{spec.name} on {world_size} ranks needs {num_stages} stage modules, got {len(all_modules)}")
    device = torch.device(device)
    # Shapes come from one no-grad pass through every stage where the model lives (usually
    # the CPU); only this rank's stages then move to ``device``.
    examples = _example_shapes(all_modules, microbatch_example)
    local = rank_to_stages[rank]
    for s in local:
        all_modules[s].to(device)
    stages = [
        PipelineStage(
            all_modules[s],
            s,
            num_stages,
            device,
            input_args=examples[s][0].to(device),
            output_args=examples[s][1].to(device),
            group=group,
        )
        for s in local
    ]
    if spec.stages_per_rank == 1:
        sched = spec.cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    else:
        sched = spec.cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    tracker = PipelinePhaseTracker(sched)
    return Pipeline(
        spec.name,
        sched,
        stages,
        [all_modules[s] for s in local],
        tracker,
        rank,
        world_size,
        num_stages,
        n_microbatches,
    )
