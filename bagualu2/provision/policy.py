"""The policy a provisioner runs, and the frame each of its forwards starts from.

Design note
-----------
A provisioner runs one policy: ``adaptive`` (it decides at each gate), a static policy by
name (``keep_all``, ``recompute_all``, ``offload_all``), or a fixed plan (operator key ->
``Choice``; an operator not in it is kept). :class:`Policy` is the one owner of that choice.
Invariants:

- A fixed plan's keys and choices are checked against the model whenever it is set, at
  enable and on replacement, so a forward never meets a key that names nothing.
- Only a fixed plan can be replaced: adaptive and the named policies plan in their own way,
  and swapping one for another mid-run would mix two policies' telemetry in one report.
- ``keeps_all`` is settled when the plan is set, not per forward: a policy that keeps
  everything (keep_all, or a fixed plan of KEEPs) releases nothing by plan, so its forwards
  need no tracing.
- The frames of ``recompute_all`` and ``offload_all`` are final: nothing profiles,
  calibrates or plans them (``frame`` says so by returning ``final=True``).
- A fixed plan's frames name the modules it may release from (``Frame.released_modules``):
  no gate changes the plan while the forward runs, so what it keeps whole runs untraced.
  Adaptive frames name none: a gate may release from any block after it.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Mapping, Optional, Tuple, Union

import torch

from bagualu2.inputs import checked_plan
from bagualu2.plan.planner import Choice, Plan
from bagualu2.runtime import Frame
from bagualu2.runtime.frame import released_modules

POLICIES = ("adaptive", "keep_all", "recompute_all", "offload_all")


class Policy:
    """What a provisioner was asked to run (see the module note)."""

    def __init__(self, policy: Union[str, Plan, Mapping[str, Choice]], model: torch.nn.Module,
                 compiled: bool = False) -> None:
        self._model = model
        self._compiled = compiled  # all of the model is one compiled region
        self.plan: Optional[Dict[str, Choice]] = None  # a fixed plan's choices
        self._released: Optional[FrozenSet[str]] = None  # the modules it may release from
        self.shown: Union[str, Plan] = policy  # what ``Provisioner.policy`` returns
        self.keeps_all = policy == "keep_all"
        self.name = policy if isinstance(policy, str) else "static"
        if not isinstance(policy, str):
            self._set(policy)

    @property
    def adaptive(self) -> bool:
        return self.name == "adaptive"

    @property
    def offloads(self) -> bool:
        """Whether a static policy offloads anything (what it needs a host arena for)."""
        return self.name == "offload_all" or Choice.OFFLOAD in (self.plan or {}).values()

    def replace(self, plan: Union[Plan, Mapping[str, Choice]]) -> None:
        """Run ``plan`` from the next forward on, in place of the fixed plan run so far."""
        if self.plan is None:
            raise ValueError(f"only a fixed plan can be replaced, and this provisioner's policy is "
                             f"{self.name!r}: enable it with policy=bagualu2.Plan(...) to compare plans")
        self._set(plan)

    def _set(self, plan: Union[Plan, Mapping[str, Choice]]) -> None:
        self.plan = checked_plan(plan.choices if isinstance(plan, Plan) else plan, self._model, self._compiled)
        self.shown = plan if isinstance(plan, Plan) else Plan(dict(self.plan))
        self.keeps_all = all(c == Choice.KEEP for c in self.plan.values())
        self._released = released_modules(self.plan)

    def frame(self, index: int, rerun_blocks: bool) -> Tuple[Frame, bool]:
        """The frame forward ``index`` starts from, and whether it is final (see the note).

        Args:
            rerun_blocks: recompute_all may rerun its blocks whole in backward (they then run
                untraced); False where per-operator recomputes are scheduled (the overlap
                driver moves them into pipeline bubbles).
        """
        if self.name == "recompute_all":
            frame = Frame(default=Choice.RECOMPUTE, index=index)
            # What the model saves after its last block (the final norm's input, the logits)
            # backward reads first: released, it is rebuilt at once, replaying the last block
            # with it while all else is still resident: more time, and no lower a peak. Kept,
            # as checkpointing every layer keeps it.
            frame.after_blocks = Choice.KEEP
            frame.rerun_blocks = rerun_blocks
            return frame, True
        if self.name == "offload_all":
            return Frame(default=Choice.OFFLOAD, index=index), True
        frame = Frame(self.plan, index=index)
        frame.released_modules = self._released
        return frame, False
