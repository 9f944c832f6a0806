"""bagualu2 on a pipeline: one provisioner and one budget per rank, fed by the phase tracker.

``enable_bagualu2(pipe, **enable_kwargs)`` provisions this rank. One local stage:
``bagualu2.enable(stage_module)``. Several (interleaved, V schedules):
``bagualu2.enable(RankStages(stages))``, and each ``PipelineStage`` runs its stage through it
(``StageEntry``), so every stage forward is still one micro-batch (one frame) while the ledger
is shared. The tracker calls ``Provisioner.set_pipeline_phase(phase, stacked_forwards - 1)``
before each forward (the provisioner counts the *other* forwards that stack) and
``Provisioner.step()`` at the end of each schedule step; with ``overlap=True`` an
``OverlapDriver`` follows the same events. ``prov.disable()`` removes bagualu2 and undoes this
wiring (``Provisioner.on_disable``); ``pipe.close()`` removes the tracker.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from bagualu2.integrations.pipeline.build import Pipeline
from bagualu2.integrations.pipeline.phases import phase_follower
from bagualu2.api import enable

__all__ = ["RankStages", "StageEntry", "enable_bagualu2"]


class RankStages(nn.Module):
    """All stage modules of one rank behind one forward, so one provisioner serves them all.

    ``bagualu2.enable`` treats each call of a module's forward as one micro-batch. A rank of an
    interleaved or V schedule runs two stage modules; provisioning each separately would split
    the rank's budget in two fixed halves. Instead the rank's PipelineStages call
    ``rank_stages(x, stage=i)`` (through ``StageEntry``), so there is one forward, one ledger
    and one budget per rank, and every stage forward is still its own micro-batch.
    """

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor, stage: int = 0) -> torch.Tensor:
        return self.stages[stage](x)


class StageEntry(nn.Module):
    """What a PipelineStage runs for local stage ``i``: the call goes through ``RankStages``.

    Its parameters are exactly the stage module's (what torch's split backward differentiates
    against); the ``RankStages`` root is referenced, not registered.
    """

    def __init__(self, root: RankStages, index: int):
        super().__init__()
        self.stage = root.stages[index]
        self.index = index
        object.__setattr__(self, "_root", root)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._root(x, stage=self.index)


def enable_bagualu2(pipe: Pipeline, overlap: bool = False, **kwargs: Any):
    """``bagualu2.enable`` on this rank's stages, fed by the pipeline's phase tracker.

    One provisioner and one budget per rank: a rank with one stage provisions that stage
    module; a rank with several (interleaved, V schedules) provisions a ``RankStages`` over
    them. Before each forward the provisioner learns the phase and how many other forwards
    will stack on this rank before its next backward (``Provisioner.set_pipeline_phase``); at
    the end of each schedule step ``Provisioner.step()`` is called. With ``overlap=True`` an
    ``OverlapDriver`` (:mod:`.overlap_driver`) schedules each forward/backward pair: reloads of
    the coming backward are prefetched during the forward and the bubble, recomputes may run
    in the bubble; its counters are ``prov.report()["overlap"]``. Other keyword arguments go to
    ``bagualu2.enable`` (budget, policy, on_exceed, ...). ``prov.disable()`` removes bagualu2
    and undoes this wiring; ``pipe.close()`` then removes the tracker.
    """
    root: nn.Module = pipe.modules[0] if len(pipe.modules) == 1 else RankStages(pipe.modules)
    prov = enable(root, **kwargs)
    if isinstance(root, RankStages):
        originals = [st.submod for st in pipe.stages]
        for i, st in enumerate(pipe.stages):
            st.submod = StageEntry(root, i)

        def restore() -> None:
            for st, sub in zip(pipe.stages, originals):
                st.submod = sub

        prov.on_disable(restore)
    prov.on_disable(pipe.tracker.subscribe(phase_follower(prov)))
    if overlap:
        from bagualu2.integrations.pipeline.overlap_driver import OverlapDriver

        # the budget read as each pair is planned: ``prov.budget`` may change it between pairs
        driver = OverlapDriver(prov.runtime, prov.cost, lambda: prov.budget, counts=prov.mean_counts)
        prov.overlap = driver
        prov.on_disable(pipe.tracker.subscribe(driver.on_event))
        prov.on_disable(driver.close)
    return prov
