"""Phase tracking: what this rank's schedule is doing now and next (what the provisioner consumes).

``PipelinePhaseTracker(schedule)`` wraps, on this rank only, the schedule's ``step`` and each
local stage's ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``.
Every schedule (single- and multi-stage, the zero-bubble I/W split, DualPipeV's overlapped
F+B) funnels its compute through these three methods, so the tracker sees exactly the actions
this rank executes, in order, and compares them with the schedule's own action list
(``schedule.pipeline_order``) to look ahead. It publishes a ``PipelineState``:

=====================  ================================================================
``phase``              ``Phase.WARMUP`` (no backward yet this step), ``STEADY``,
                       ``COOLDOWN`` (every forward of the step done), ``IDLE`` (outside
                       ``schedule.step``).
``action``             ``"F"``, ``"B"`` (full backward), ``"I"`` (backward for inputs),
                       ``"W"`` (backward for weights) or ``None`` between actions.
``stage_index``        global stage index of the running action (``None`` between).
``microbatch``         micro-batch index of the running action (``None`` between).
``in_flight``          (stage, micro-batch) pairs whose forward has run and whose saved
                       activations are not released yet (no ``B``, or no ``W`` after an
                       ``I``); includes the running forward.
``stacked_forwards``   forwards this rank runs, counting the running one, before its next
                       ``B``/``I``: during a forward, the provisioner must budget for this
                       micro-batch plus ``stacked_forwards - 1`` more of similar size on top
                       of what is resident now.
``step``               schedule steps completed on this rank.
``upcoming``           the rank's remaining compute actions after the running one, in
                       order, as ``(kind, stage, micro-batch)``; ``next_backward`` is the
                       first ``B``/``I`` among them (whose reloads an overlap scheduler
                       prefetches, or whose recompute it may pull into a bubble).
=====================  ================================================================

Two ways to read it, pick whichever suits the caller:

* pull: ``bagualu2.integrations.pipeline.current_state()`` returns the state of the action running on this
  thread (``None`` outside any tracked action), so a gate hook can read it at gating time
  with no reference to the tracker;
* push: ``tracker.subscribe(fn)``; ``fn(event, state)`` is called with ``event`` in
  ``"step_begin"``, ``"action_begin"``, ``"action_end"``, ``"step_end"``. ``action_begin`` of a
  forward is the start of one micro-batch on one stage; ``step_end`` is the per-step hook.

``tracker.close()`` restores every wrapped method.

Invariant: the tracker never changes what the schedule computes; with or without one, losses
and gradients are bitwise identical.
"""
from __future__ import annotations

import contextvars
import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

__all__ = ["Phase", "PipelineState", "PipelinePhaseTracker", "current_state", "phase_follower"]


class Phase(enum.IntEnum):
    """Where this rank is in the current schedule step."""

    IDLE = 0
    WARMUP = 1
    STEADY = 2
    COOLDOWN = 3


@dataclasses.dataclass(frozen=True)
class PipelineState:
    """Snapshot published by PipelinePhaseTracker (see the module note)."""

    phase: Phase
    action: str | None
    stage_index: int | None
    microbatch: int | None
    in_flight: int
    stacked_forwards: int
    step: int
    rank: int
    upcoming: tuple[tuple[str, int, int], ...] = ()

    @property
    def next_backward(self) -> tuple[str, int, int] | None:
        """The next ``B``/``I`` action after the running one (what to prefetch or recompute for)."""
        return next((a for a in self.upcoming if a[0] in ("B", "I")), None)


_IDLE_STATE = PipelineState(Phase.IDLE, None, None, None, 0, 0, 0, 0)
_current: contextvars.ContextVar[PipelineState | None] = contextvars.ContextVar(
    "bagualu2_pipeline_state", default=None
)


def current_state() -> PipelineState | None:
    """State of the tracked pipeline action running on this thread, or None outside one."""
    return _current.get()


def _compute_actions(order: Sequence[Any]) -> list[tuple[str, int, int]]:
    """Flatten a schedule's action list to (kind, stage, micro-batch) compute actions."""
    out: list[tuple[str, int, int]] = []
    for a in order:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        if subs:
            out.extend(_compute_actions(subs))
            continue
        kind = a.computation_type.value
        if kind in ("F", "B", "I", "W"):
            out.append((kind, a.stage_index, a.microbatch_index))
    return out


def _expected_actions(schedule: Any, stages: Sequence[Any], rank: int) -> list[tuple[str, int, int]]:
    """This rank's compute actions, in the order the schedule will execute them."""
    n = schedule._n_microbatches
    if isinstance(schedule, ScheduleGPipe):
        s = stages[0].stage_index
        return [("F", s, i) for i in range(n)] + [("B", s, i) for i in range(n)]
    if isinstance(schedule, Schedule1F1B):
        # Mirrors Schedule1F1B._step_microbatches (its pipeline_order IR differs on the last
        # stage, which the runtime does not use): warm-up forwards, then B/F pairs, then B's.
        s = stages[0].stage_index
        warmup = min(n, stages[0].num_stages - s)
        out = [("F", s, i) for i in range(warmup)]
        f = warmup
        for b in range(n):
            out.append(("B", s, b))
            if f < n:
                out.append(("F", s, f))
                f += 1
        return out
    order = getattr(schedule, "pipeline_order", None) or {}
    return _compute_actions(order.get(rank, []))


class PipelinePhaseTracker:
    """Follows one rank's forward/backward actions in a torch.distributed.pipelining schedule.

    Wraps ``schedule.step`` and the local stages' chunk methods; see the module note for the
    published state. Use as a context manager or call ``close()``.
    """

    def __init__(self, schedule: Any):
        stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        self._stages = stages
        self.rank = stages[0].group_rank
        self._expected = _expected_actions(schedule, stages, self.rank)
        self._subscribers: list[Callable[[str, PipelineState], None]] = []
        self._restore: list[tuple[Any, str]] = []
        self._state = dataclasses.replace(_IDLE_STATE, rank=self.rank)
        self._reset_step()
        self._steps = 0
        for stage in stages:
            self._wrap(stage, "forward_one_chunk", self._kind_forward)
            self._wrap(stage, "backward_one_chunk", self._kind_backward)
            self._wrap(stage, "backward_weight_one_chunk", self._kind_weight)
        self._wrap_step(schedule)

    # -- public ----------------------------------------------------------------------------
    @property
    def state(self) -> PipelineState:
        return self._state

    @property
    def expected_actions(self) -> list[tuple[str, int, int]]:
        """This rank's compute actions in schedule order: (kind, stage, micro-batch)."""
        return list(self._expected)

    @property
    def observed_actions(self) -> list[tuple[str, int, int]]:
        """Actions seen in the current (or last) step, in execution order."""
        return list(self._observed)

    def subscribe(self, fn: Callable[[str, PipelineState], None]) -> Callable[[], None]:
        """Call ``fn(event, state)`` on every step/action boundary; returns an unsubscribe function."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    def close(self) -> None:
        """Remove every wrapper (the schedule and stages behave exactly as before)."""
        for obj, name in reversed(self._restore):
            obj.__dict__.pop(name, None)
        self._restore.clear()
        self._subscribers.clear()

    def __enter__(self) -> "PipelinePhaseTracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- bookkeeping -----------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._done: set[tuple[str, int, int]] = set()
        self._observed: list[tuple[str, int, int]] = []
        self._held: set[tuple[int, int]] = set()
        self._backward_seen = False

    def _remaining(self) -> list[tuple[str, int, int]]:
        return [a for a in self._expected if a not in self._done]

    def _stacked(self, remaining: list[tuple[str, int, int]]) -> int:
        n = 0
        for kind, _, _ in remaining:
            if kind in ("B", "I"):
                break
            if kind == "F":
                n += 1
        return n

    def _make_state(self, action: tuple[str, int, int] | None, in_step: bool) -> PipelineState:
        if not in_step:
            return PipelineState(Phase.IDLE, None, None, None, len(self._held), 0, self._steps, self.rank)
        remaining = self._remaining()
        forwards_left = any(k == "F" for k, _, _ in remaining)
        if action is not None and action[0] == "F":
            forwards_left = True
        if not self._backward_seen and not (action and action[0] in ("B", "I")):
            phase = Phase.WARMUP
        elif forwards_left:
            phase = Phase.STEADY
        else:
            phase = Phase.COOLDOWN
        kind, stage, mb = action if action is not None else (None, None, None)
        upcoming = tuple(a for a in remaining if a != action)
        return PipelineState(
            phase, kind, stage, mb, len(self._held), self._stacked(remaining), self._steps, self.rank, upcoming
        )

    def _emit(self, event: str) -> None:
        for fn in list(self._subscribers):
            fn(event, self._state)

    def _begin(self, action: tuple[str, int, int]) -> contextvars.Token:
        kind, stage, mb = action
        if kind == "F":
            self._held.add((stage, mb))
        self._state = self._make_state(action, True)
        token = _current.set(self._state)
        self._emit("action_begin")
        return token

    def _end(self, action: tuple[str, int, int], token: contextvars.Token) -> None:
        kind, stage, mb = action
        self._done.add(action)
        self._observed.append(action)
        if kind in ("B", "I"):
            self._backward_seen = True
        # A full backward releases the micro-batch; an input backward keeps what the weight
        # gradients still need until its W.
        if kind in ("B", "W"):
            self._held.discard((stage, mb))
        self._state = dataclasses.replace(self._make_state(action, True), action=kind)
        self._emit("action_end")
        _current.reset(token)
        self._state = self._make_state(None, True)

    # -- wrapping ----------------------------------------------------------------------------
    def _kind_forward(self, args, kwargs) -> str:
        return "F"

    def _kind_backward(self, args, kwargs) -> str:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return "B" if full else "I"

    def _kind_weight(self, args, kwargs) -> str:
        return "W"

    def _wrap(self, stage: Any, name: str, kind_of: Callable) -> None:
        inner = getattr(stage, name)
        tracker = self

        def wrapper(chunk_id: int, *args, **kwargs):
            if not stage.has_backward and name != "forward_one_chunk":
                return inner(chunk_id, *args, **kwargs)
            action = (kind_of(args, kwargs), stage.stage_index, chunk_id)
            token = tracker._begin(action)
            try:
                return inner(chunk_id, *args, **kwargs)
            finally:
                tracker._end(action, token)

        setattr(stage, name, wrapper)
        self._restore.append((stage, name))

    def _wrap_step(self, schedule: Any) -> None:
        inner = schedule.step
        tracker = self

        def step(*args, **kwargs):
            tracker._reset_step()
            tracker._state = tracker._make_state(None, True)
            tracker._emit("step_begin")
            try:
                return inner(*args, **kwargs)
            finally:
                tracker._steps += 1
                tracker._state = tracker._make_state(None, False)
                tracker._emit("step_end")

        schedule.step = step
        self._restore.append((schedule, "step"))


def phase_follower(prov: Any) -> Callable[[str, PipelineState], None]:
    """A tracker subscriber that tells provisioner ``prov`` where its stage is in the schedule:
    before each forward, the phase and the forwards that will stack on it before its backward;
    at the step's end, no phase, and the step counted. It goes quiet once ``prov`` is disabled."""
    def on_event(event: str, state: PipelineState) -> None:
        if not prov.enabled:
            return
        if event == "action_begin" and state.action == "F":
            prov.set_pipeline_phase(state.phase.name.lower(), max(0, state.stacked_forwards - 1))
        elif event == "step_end":
            prov.set_pipeline_phase("none", 0)
            prov.step()
    return on_event
