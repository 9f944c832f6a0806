"""Pipeline-parallel training on ``torch.distributed.pipelining``, and what bagualu2 learns from it.

The public names live here; each concern has its own module, whose note is its contract:

- :mod:`.stages`: ``split_model`` cuts a transformer-like model into ``StageModule``s that share
  its parameters; ``lm_loss`` is the last stage's loss.
- :mod:`.schedules`: ``SCHEDULES``, the supported torch schedules, and ``stage_layout``, which
  rank holds which stage.
- :mod:`.phases`: ``PipelinePhaseTracker`` follows this rank's actions in a schedule step and
  publishes a ``PipelineState`` (pull: ``current_state()``; push: ``tracker.subscribe``).
- :mod:`.build`: ``build_pipeline`` builds this rank's stages, the schedule and its tracker as a
  ``Pipeline``.
- :mod:`.enable`: ``enable_bagualu2`` provisions this rank's stages with one provisioner and one
  budget per rank, fed by the tracker (and, with ``overlap=True``, an ``OverlapDriver``).
- :mod:`.overlap_driver`: ``OverlapDriver`` pairs each forward with the backward that follows
  it on this rank and makes the activation runtime follow the overlap scheduler's schedule.

Dependencies run one way: stages and schedules know nothing of the rest, phases knows the
torch schedules only, build ties the three together, enable sits on top (and imports the
provisioner only when called, so importing this package never imports bagualu2's runtime);
overlap_driver knows the overlap model (``bagualu2.plan.overlap``) and the tracker's events,
and enable imports it only with ``overlap=True``.
"""
from bagualu2.integrations.pipeline.build import Pipeline, build_pipeline
from bagualu2.integrations.pipeline.enable import RankStages, StageEntry, enable_bagualu2
from bagualu2.integrations.pipeline.phases import Phase, PipelinePhaseTracker, PipelineState, current_state, phase_follower
from bagualu2.integrations.pipeline.schedules import SCHEDULES, ScheduleSpec, stage_layout
from bagualu2.integrations.pipeline.stages import StageModule, TokenEmbedding, lm_loss, split_model

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "StageModule",
    "split_model",
    "lm_loss",
    "TokenEmbedding",
    "stage_layout",
    "build_pipeline",
    "Pipeline",
    "Phase",
    "PipelineState",
    "PipelinePhaseTracker",
    "current_state",
    "phase_follower",
    "enable_bagualu2",
    "RankStages",
    "StageEntry",
]
