"""Pipeline-parallel training on ``torch.distributed.pipelining``, and what bagualu2 learns from it.

Contract
========

Stage modules
-------------
``split_model(model, num_stages)`` cuts a transformer-like model (the reference
``bagualu2.models.MoETransformer``, or anything with an embedding, a list of blocks and a
head) into ``num_stages`` contiguous ``StageModule``s. Stage 0 owns the embedding, the last
stage the final norm and the head (the schedule's ``loss_fn``, ``lm_loss``, computes the LM
loss on its logits); blocks are spread as evenly as possible. A block's MoE auxiliary loss
gets its gradient on the stage that computed it, so the objective is the whole model's. Each
stage module *shares* its parameters with ``model``: build the full model from the same seed
on every rank and keep only your stages, so every rank starts from the same weights without
any broadcast.

Schedules
---------
``SCHEDULES`` names the torch schedules supported here (``gpipe``, ``1f1b``,
``interleaved1f1b``, ``zbv``, ``dualpipev``) with how many stages each rank holds and how
stages are placed (``loop``: rank r holds r, r+W, ...; ``v``: rank r holds r and 2W-1-r).
``build_pipeline(model, schedule, ...)`` builds this rank's ``PipelineStage`` objects (with
static shapes, so no hidden metadata-inference forward ever reaches a provisioned module) and
the schedule, and returns a ``Pipeline``: ``pipe.train_step(tokens, targets)`` runs one
schedule step and returns this rank's per-micro-batch losses (on the last stage's rank).
The caller launches the ranks and creates the process group, as for any
``torch.distributed`` job (torchrun: examples/pipeline_1f1b.py).

Phase tracking (the interface the provisioner consumes)
-------------------------------------------------------
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

``tracker.close()`` restores every wrapped method. Trackers never change what the schedule
computes: with or without one, losses and gradients are bitwise identical.

bagualu2 on a pipeline
----------------------
``enable_bagualu2(pipe, **enable_kwargs)`` provisions this rank: one ``Provisioner`` and one
budget per rank. One local stage: ``bagualu2.enable(stage_module)``. Several (interleaved, V
schedules): ``bagualu2.enable(RankStages(stages))``, and each ``PipelineStage`` runs its
stage through it (``StageEntry``), so every stage forward is still one micro-batch (one
frame) while the ledger is shared. The tracker calls
``Provisioner.set_pipeline_phase(phase, stacked_forwards - 1)`` before each forward (the
provisioner counts the *other* forwards that stack) and ``Provisioner.step()`` at the end of
each schedule step. ``pipe.close()`` undoes the wiring; ``prov.disable()`` removes bagualu2.
"""
from __future__ import annotations

import contextvars
import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

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
    "enable_bagualu2",
    "RankStages",
    "StageEntry",
]


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One torch schedule: its class, stages per rank and stage placement style."""

    name: str
    cls: type
    stages_per_rank: int
    style: str  # "loop" or "v"
    splits_backward: bool  # runs backward-input and backward-weight as separate actions

    def num_stages(self, world_size: int) -> int:
        return self.stages_per_rank * world_size

    def min_microbatches(self, world_size: int) -> int:
        """Fewest micro-batches torch accepts (or schedules correctly) for this world size."""
        if self.name == "gpipe":
            return 1
        if self.name == "zbv":
            return 2 * world_size - 1  # the ZBV action list assumes at least this many
        return self.num_stages(world_size) if self.name in ("1f1b", "dualpipev") else world_size


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("gpipe", ScheduleGPipe, 1, "loop", False),
        ScheduleSpec("1f1b", Schedule1F1B, 1, "loop", False),
        ScheduleSpec("interleaved1f1b", ScheduleInterleaved1F1B, 2, "loop", False),
        ScheduleSpec("zbv", ScheduleZBVZeroBubble, 2, "v", True),
        ScheduleSpec("dualpipev", ScheduleDualPipeV, 2, "v", True),
    )
}
_ALIASES = {"zbvzerobubble": "zbv", "interleaved": "interleaved1f1b", "dualpipe_v": "dualpipev"}


def _spec(schedule: str) -> ScheduleSpec:
    key = schedule.lower().replace("-", "").replace("schedule", "")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[key]


def stage_layout(schedule: str, world_size: int) -> tuple[int, dict[int, list[int]]]:
    """(number of stages, rank -> sorted global stage indices) for ``schedule`` on ``world_size`` ranks."""
    spec = _spec(schedule)
    n = spec.num_stages(world_size)
    rank_to_stages: dict[int, list[int]] = {r: [] for r in range(world_size)}
    for s in range(n):
        if spec.style == "loop":
            rank = s % world_size
        else:  # V: down the ranks on the first half, back up on the second
            rank = s if s < world_size else 2 * world_size - 1 - s
        rank_to_stages[rank].append(s)
    return n, rank_to_stages


# ---------------------------------------------------------------------------------------------
# Stage modules
# ---------------------------------------------------------------------------------------------


class TokenEmbedding(nn.Module):
    """Stage 0's input layer for the reference model: token + position embedding, dropout."""

    def __init__(self, embed: nn.Embedding, pos_embed: nn.Embedding | None, drop: nn.Module | None):
        super().__init__()
        self.embed = embed
        self.pos_embed = pos_embed
        self.drop = drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.pos_embed is not None:
            h = h + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        return self.drop(h) if self.drop is not None else h


class StageModule(nn.Module):
    """A contiguous slice of a transformer: [embedding] -> blocks -> [final norm -> head].

    Inputs and outputs are single tensors (token ids into stage 0, hidden states between
    stages, logits out of the last stage), which is what point-to-point sends carry. A block
    may return ``(hidden, aux_loss)`` (the reference model's MoE blocks do): the auxiliary
    load-balancing loss is then added to the backward where it was computed, with weight
    ``aux_loss_coef``, so the pipeline trains on the whole model's objective (LM loss +
    coef x sum of aux losses) without sending extra tensors between stages.
    """

    def __init__(
        self,
        stage_index: int,
        num_stages: int,
        layers: Sequence[nn.Module],
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        head: nn.Module | None = None,
        aux_loss_coef: float = 0.0,
        layer_offset: int = 0,
    ):
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_offset = layer_offset  # index in the whole model of this stage's first block
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.head = head
        self.aux_loss_coef = aux_loss_coef

    @property
    def layer_indices(self) -> list[int]:
        """Indices, in the whole model, of the blocks this stage runs."""
        return list(range(self.layer_offset, self.layer_offset + len(self.layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            out = layer(x)
            if isinstance(out, tuple):
                x, aux = out
                if self.aux_loss_coef and isinstance(aux, torch.Tensor) and aux.requires_grad:
                    x = _AttachAuxLoss.apply(x, aux, self.aux_loss_coef)
            else:
                x = out
        if x._is_view():
            # torch's zero-bubble backward detaches stage outputs in place, which views forbid.
            x = x.clone()
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward, also sends ``coef`` as the gradient of ``aux``.

    Megatron's MoEAuxLossAutoScaler: the auxiliary loss of a block on a middle stage never
    reaches the last stage's loss function, so its gradient is injected where it was
    computed. The schedule divides every gradient by the number of micro-batches at the end,
    as it does for the main loss, so the result is coef x mean over micro-batches.
    """

    @staticmethod
    def forward(ctx, x, aux, coef):
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        ctx.coef = coef
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        g = torch.full(ctx.aux_shape, ctx.coef, dtype=ctx.aux_dtype, device=grad_x.device)
        return grad_x, g, None


def _find_attr(model: nn.Module, names: Sequence[str], what: str, required: bool = True):
    for n in names:
        m = getattr(model, n, None)
        if m is not None:
            return m
    if required:
        raise TypeError(
            f"split_model: {type(model).__name__} has no {what} (looked for {', '.join(names)}); "
            "pass stage_modules= to build_pipeline for other layouts"
        )
    return None


def split_model(model: nn.Module, num_stages: int, *, aux_loss_coef: float | None = None) -> list[StageModule]:
    """Cut ``model`` into ``num_stages`` StageModules that share its parameters.

    Works on ``bagualu2.models.MoETransformer`` and on models laid out like it (an
    embedding, optional position embedding, a ``layers`` list, a final norm, a head).
    Blocks are spread as evenly as possible; when they do not divide evenly the extra ones go
    to the middle stages first, since the first and last stages also carry the embedding and
    the head. ``aux_loss_coef`` defaults to ``model.cfg.aux_loss_coef`` (0 if absent).
    """
    embed = _find_attr(model, ("embed", "tok_embeddings", "embed_tokens", "wte"), "embedding")
    pos = _find_attr(model, ("pos_embed", "wpe"), "position embedding", required=False)
    drop = _find_attr(model, ("drop",), "dropout", required=False)
    layers = list(_find_attr(model, ("layers", "blocks", "h"), "list of blocks"))
    norm = _find_attr(model, ("norm", "final_norm", "ln_f"), "final norm", required=False)
    head = _find_attr(model, ("lm_head", "head", "output"), "output head")
    if num_stages < 1 or len(layers) < num_stages:
        raise ValueError(
            f"cannot split {len(layers)} blocks into {num_stages=} stages (need at least one block per stage)"
        )
    if aux_loss_coef is None:
        aux_loss_coef = float(getattr(getattr(model, "cfg", None), "aux_loss_coef", 0.0) or 0.0)
    base, extra = divmod(len(layers), num_stages)
    counts = [base] * num_stages
    middle_first = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
    for s in middle_first[:extra]:
        counts[s] += 1
    embedding = TokenEmbedding(embed, pos, drop)
    stages, start = [], 0
    for s in range(num_stages):
        stages.append(
            StageModule(
                s,
                num_stages,
                layers[start : start + counts[s]],
                embed=embedding if s == 0 else None,
                norm=norm if s == num_stages - 1 else None,
                head=head if s == num_stages - 1 else None,
                aux_loss_coef=aux_loss_coef,
                layer_offset=start,
            )
        )
        start += counts[s]
    return stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (the schedule's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Phase tracking
# ---------------------------------------------------------------------------------------------


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
        self._schedule = schedule
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


# ---------------------------------------------------------------------------------------------
# Pipeline construction
# ---------------------------------------------------------------------------------------------


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
    _cleanups: list = dataclasses.field(default_factory=list)

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
        """Undo enable_bagualu2's wiring and the tracker's wrappers."""
        while self._cleanups:
            self._cleanups.pop()()
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
    spec = _spec(schedule)
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


# ---------------------------------------------------------------------------------------------
# bagualu2 on a pipeline
# ---------------------------------------------------------------------------------------------


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
    ``OverlapDriver`` (``bagualu2.plan.overlap``) schedules each forward/backward pair: reloads of
    the coming backward are prefetched during the forward and the bubble, recomputes may run
    in the bubble; its counters are ``prov.report()["overlap"]``. Other keyword arguments go to
    ``bagualu2.enable`` (budget, policy, on_exceed, ...). ``pipe.close()`` undoes the wiring;
    ``prov.disable()`` removes bagualu2 itself.
    """
    from bagualu2.provisioner import enable

    if len(pipe.modules) == 1:
        root: nn.Module = pipe.modules[0]
    else:
        root = RankStages(pipe.modules)
        originals = [st.submod for st in pipe.stages]
        for i, st in enumerate(pipe.stages):
            st.submod = StageEntry(root, i)

        def restore() -> None:
            for st, sub in zip(pipe.stages, originals):
                st.submod = sub

        pipe._cleanups.append(restore)
    prov = enable(root, **kwargs)

    def on_event(event: str, state: PipelineState) -> None:
        if not prov.enabled:
            return
        if event == "action_begin" and state.action == "F":
            prov.set_pipeline_phase(state.phase.name.lower(), max(0, state.stacked_forwards - 1))
        elif event == "step_end":
            prov.set_pipeline_phase("none", 0)
            prov.step()

    pipe._cleanups.append(pipe.tracker.subscribe(on_event))
    if overlap:
        from bagualu2.plan.overlap import OverlapDriver

        driver = OverlapDriver(prov.runtime, prov.cost, prov.budget, counts=prov.mean_counts)
        prov.overlap = driver
        pipe._cleanups.append(pipe.tracker.subscribe(driver.on_event))
        pipe._cleanups.append(driver.close)
    return prov
