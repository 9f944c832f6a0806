"""``bagualu2.enable``: adaptive activation provisioning decided at MoE gating.

Design note
-----------
``enable(model)`` wraps ``model.forward`` so every call is one *frame* of the activation runtime
(one micro-batch), hooks every MoE gate, and returns a ``Provisioner``. At each gating event,
after the router has produced its tokens per expert and before any expert runs, the provisioner

1. predicts the rest of this micro-batch's saved bytes with the ``CostModel`` (this layer's
   actual load; later layers are assumed to see the same load pattern),
2. adds what is already resident (the ledger: this and every other micro-batch in flight),
3. if that exceeds the budget, asks the C++ ``Planner`` for the cheapest KEEP / OFFLOAD /
   RECOMPUTE choice per remaining operator that frees the excess, and
4. installs the plan in the frame; the runtime applies it as the experts save activations.

When calm, step 3 is skipped: the plan stays all-keep and the forward is not even traced (nor
is any keep_all forward): it costs the saved-tensor hooks' bookkeeping only. Calm means that
the worst routing the micro-batch could see fits the budget, or, with a copy engine, that the
last micro-batch's routing does: a spike that then arrives unannounced is held under the
budget by offloading (an untraced forward has no recipes to recompute from), and the
micro-batches after it are traced, ready to plan, until one routes within the budget again.
The runtime independently holds the ledger under the budget at every save (offloading or
recomputing a storage that would cross it), so a misprediction costs time, never the budget.

The first ``profile_frames`` micro-batches time every op to build the cost model; the first
``calibrate_frames`` micro-batches after them that a plan may have to release from (their
worst routing would not fit) recompute everything they can, so that their backward passes
measure what replays cost before any plan relies on it (``MicroBatch.calibrating``), and with
``recalibrate_every`` so does one in that many such micro-batches after them, in the cycle
``_calibration`` describes (offloading everything, recomputing all, recomputing half). Static
policies (``keep_all``, ``recompute_all``, ``offload_all``, or a fixed ``Plan``) use the same
machinery with a fixed plan and no enforcement, to show what they would do under the budget.

Safety net: if the device runs out of memory inside a provisioned forward, the partial
micro-batch is dropped (its graph and saved activations with it), the RNG is rewound, and the
forward reruns with a recompute-everything plan; the step goes on.
"""

from __future__ import annotations

import collections
import copy
import itertools
import math
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from bagualu2.runtime import ActivationRuntime, Budget, Frame, is_recomputing
from bagualu2.runtime.activations import AttachedHook
from bagualu2.runtime.frame import checked_choices
from bagualu2.runtime.tracing import reset_replay_depth
from bagualu2.plan.cost_model import SIZE, CostModel
from bagualu2.errors import BudgetExceededError, InfeasibleBudgetError
from bagualu2.inputs import (
    check_int, check_materialized, checked_counts, checked_plan, device_of, host_memory_bytes, input_bytes,
    local_processes, resolve_budget, token_slots,
)
from bagualu2.runtime.gates import GateSpec, describe_unsupported, find_gates
from bagualu2.plan.planner import Choice, Plan, Planner
from bagualu2.telemetry import Decision, MicroBatch, Telemetry

__all__ = ["Provisioner", "enable", "on_gating", "POLICIES"]

POLICIES = ("adaptive", "keep_all", "recompute_all", "offload_all")
_PHASES = {"none": 0, "warmup": 1, "steady": 2, "cooldown": 3}
# Per thread, the provisioners whose forward is running on it, innermost last: a routing report
# (on_gating) belongs to the thread that makes it, and so to the model that thread runs.
_LOCAL = threading.local()


def _active() -> List["Provisioner"]:
    stack = getattr(_LOCAL, "active", None)
    if stack is None:
        stack = _LOCAL.active = []
    return stack


# Micro-batches whose routing predicts the next one's: after a spike, this many are traced
# (ready to plan releases) before calm forwards go untraced again.
_RECENT = 8
# The host arena at enable, when the user does not size it: room for the copy-cost probes and
# the first offloads. Once the profiled micro-batches show how large activations get, what
# offloading may need is reserved in one step, up to _ARENA_AHEAD_BYTES (_reserve_arena); the
# arena grows by segments beyond that.
_ARENA_START_BYTES = 64 << 20
_ARENA_AHEAD_BYTES = 8 << 30


# What a calibrating micro-batch releases (``Provisioner._new_frame``). The first
# ``calibrate_frames`` after profiling, where a plan may have to release, recompute all they
# can: their backward passes measure what replaying each op costs
# (``CostModel.observe_op_replays``) and what rebuilds cost, before any plan relies on them (a
# profiled forward's op times stand for a replay's only in part: ``CostModel``'s note). The
# first replays run cold; the next replace them, and plans refine both as they rebuild.
# Recalibrations (one every ``recalibrate_every``) then go round a cycle:
# - with a copy engine, every other one offloads everything: the copies' cost
#   (``CostModel.observe_copies``) is then learned from many offloads of every size, beside the
#   plans' few, and priced right for plans that offload more than those did (what a copy costs
#   apart from its bytes, and per byte, is otherwise one factor);
# - every other one that recomputes keeps half of the keys (every other key in save order, the
#   two halves in turn): rebuilds are then measured at two sizes of plan, which tells the part
#   that grows with a plan from the part that does not (one size alone cannot separate them).
_RECALIBRATIONS = ("recompute all", "recompute half 0", "recompute all", "recompute half 1")
_RECALIBRATIONS_WITH_COPIES = tuple(k for kind in _RECALIBRATIONS for k in ("offload", kind))


def _calibration(recalibration: int, can_offload: bool) -> str:
    """What calibrating micro-batch ``recalibration`` releases (negative: one of the first
    ``calibrate_frames``): ``"recompute all"``, ``"recompute half 0"``/``"recompute half 1"``
    (the keys at even/odd places in save order are kept) or ``"offload"``."""
    if recalibration < 0:
        return "recompute all"
    cycle = _RECALIBRATIONS_WITH_COPIES if can_offload else _RECALIBRATIONS
    return cycle[recalibration % len(cycle)]


class Provisioner:
    """Keeps a model's saved activations under a device budget, one micro-batch at a time.

    Create with :func:`enable`. See the module note for how decisions are made.
    """

    def __init__(self, model: torch.nn.Module, budget: Union[str, int, float, None] = "auto",
                 policy: Union[str, Mapping[str, Choice]] = "adaptive", *,
                 on_exceed: str = "record", min_bytes: int = 64 << 10,
                 arena_bytes: Optional[int] = None, arena_max_bytes: Optional[int] = None,
                 reserve_bytes: int = 1 << 30,
                 profile_frames: int = 2, calibrate_frames: int = 3, recalibrate_every: int = 0,
                 margin: float = 0.02,
                 telemetry_path: Union[str, Path, None] = None, gates: Optional[Sequence[GateSpec]] = None,
                 engine: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"enable() needs a torch.nn.Module, got {type(model).__name__}")
        compiled = getattr(model, "_orig_mod", None)
        if isinstance(compiled, torch.nn.Module) and "forward" in model.__dict__:
            model = compiled  # torch.compile's wrapper calls it: provision the module it wraps
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: use one of {POLICIES} or a fixed Plan / mapping of keys to Choice")
        if not isinstance(policy, (str, Plan, Mapping)):
            raise TypeError(f"policy={policy!r}: use one of {POLICIES} or a fixed Plan / mapping of keys to Choice")
        if on_exceed not in ("record", "raise"):
            raise ValueError(f"on_exceed={on_exceed!r}: use 'record' or 'raise'")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 0.5:
            raise ValueError(f"margin={margin!r} must be a number in [0, 0.5)")
        check_int("profile_frames", profile_frames, 1)
        check_int("calibrate_frames", calibrate_frames, 0)
        check_int("recalibrate_every", recalibrate_every, 0, " (0: never)")
        check_int("min_bytes", min_bytes, 0)
        check_int("reserve_bytes", reserve_bytes, 0)
        for name, value in (("arena_bytes", arena_bytes), ("arena_max_bytes", arena_max_bytes)):
            if value is not None:
                check_int(name, value, 1, " or None")
        if arena_bytes is not None and arena_max_bytes is not None and arena_max_bytes < arena_bytes:
            raise ValueError(f"arena_max_bytes={arena_max_bytes} must be >= arena_bytes={arena_bytes}")
        check_materialized(model)
        if "forward" in model.__dict__ and not _plain_forward(model):
            raise RuntimeError(f"{type(model).__name__} already has bagualu2 (or another forward wrapper) enabled; "
                               f"call disable() on the existing Provisioner first")
        self.model = model
        self.device = device_of(model)
        self._budget = resolve_budget(budget, self.device, reserve_bytes)
        self._policy = policy
        self.on_exceed = on_exceed
        self.min_bytes = min_bytes
        self.margin = margin
        self.profile_frames = profile_frames
        self.calibrate_frames = calibrate_frames
        self.recalibrate_every = recalibrate_every
        self.telemetry = Telemetry(Path(telemetry_path) if telemetry_path else None)
        self.engine = engine if engine is not None else self._make_engine(arena_bytes, arena_max_bytes)
        self._arena_chosen = engine is not None or arena_bytes is not None  # _reserve_arena leaves it
        adaptive = policy == "adaptive"
        self.runtime = ActivationRuntime(
            self.engine, min_bytes=min_bytes, budget_bytes=self._budget, enforce_budget=adaptive,
            on_exceed=self._exceeded if on_exceed == "raise" else None,
        )
        self.runtime.backward_observer = self._learn
        # A fixed number of byte cells per candidate bounds a decision's time whatever the
        # model (benchmarks/decision_latency.py measures it); sizes are rounded the safe way, so
        # a plan frees what it must, at most a few percent more than an exact one.
        self.planner = Planner(max_cells=2048)
        self.gates: List[GateSpec] = list(gates) if gates is not None else find_gates(model)
        self.cost = CostModel({g.layer: g.experts_path for g in self.gates}, *self._copy_costs(),
                              copies_overlap=self.device.type != "cpu")  # the cpu's copy threads hide nothing
        self._hooks: List[Any] = self.runtime.attach(model)
        for spec in self.gates:
            register = spec.module.register_forward_pre_hook if spec.pre_hook else spec.module.register_forward_hook
            self._hooks.append(register(AttachedHook(self._gate_hook(spec))))
        self._forward = model.forward
        model.forward = _ProvisionedForward(self._provisioned_forward, self._forward)  # type: ignore[method-assign]
        self._phase = "none"
        self._stacked = 0
        # Outside a pipeline schedule, forwards that ran back to back without a backward between
        # them (gradient accumulation: forward, forward, backward, backward): this one's place in
        # such a run, the lengths of the last runs, and the backward count when the last forward
        # began. A burst of forwards without backward (an evaluation run with grad on) is
        # forgotten after _RECENT runs.
        self._run_position = 0
        self._runs: Deque[int] = collections.deque(maxlen=_RECENT)
        self._backwards_seen = -1
        self._frames = 0
        self._step = 0
        self._frame_counts: Dict[int, List[int]] = {}
        self._count_sums: Dict[int, List[int]] = {}
        self._count_frames: Dict[int, int] = {}
        self._frame_predicted = 0
        self._oom_recoveries = 0
        self._peak_with_backward = 0  # the ledger's high-water mark over the run (_note_peak)
        self._floor = 0  # bytes one micro-batch holds that no plan releases (anchors, small, fixed)
        self._hard_floor = 0  # bytes of the last routing that not even the runtime could release
        self._outside_held = 0  # most bytes from outside the forward a micro-batch held (inputs)
        # Most bytes a traced forward held that no plan releases (recipe pins, saved inputs from
        # outside), in all and per byte of the forward's tensor arguments.
        self._pinned_bytes: Optional[int] = None
        self._pinned_per_input = 0.0
        self._worst_bytes: Optional[int] = None  # saved bytes of the worst possible routing
        # Keys traced micro-batches saved after profiling that the cost model never saw (no plan
        # can name them), and whether the user was told.
        self._unplanned: set = set()
        self._unplanned_warned = False
        self._profiled_training: Optional[bool] = None  # the model's mode while profiling
        self._mode_warned = False
        self._last_bytes: Optional[int] = None  # saved bytes of the last micro-batch's routing
        self.overlap: Any = None  # an OverlapDriver on a pipeline rank (pipeline.enable_bagualu2)
        self._static: Optional[Dict[str, Choice]] = None
        self._calibrating: set = set()  # the micro-batches in flight that release all they can
        self._calibrations = 0  # micro-batches that did so
        self._last_choices: Optional[Dict[str, Choice]] = None  # what the last one that planned ran
        self._since_calibration = 0  # micro-batches that may have to release since the last one
        if isinstance(policy, Plan):
            self._static = checked_plan(policy.choices, model)
        elif not isinstance(policy, str):
            self._static = checked_plan(policy, model)
            self._policy = Plan(self._static)
        self.enabled = True

    # -- setup ------------------------------------------------------------------------------
    def _make_engine(self, arena_bytes: Optional[int], arena_max_bytes: Optional[int]) -> Any:
        from bagualu2.offload import CopyEngine, HostArena, backend_for_device

        backend = backend_for_device(self.device)  # meta/cpu models: cpu, never a GPU backend
        if arena_bytes is None:
            arena_bytes = _ARENA_START_BYTES
        if arena_max_bytes is None:
            # Grow on demand up to half of this process's share of host memory.
            arena_max_bytes = max(arena_bytes, host_memory_bytes() // (2 * local_processes()))
        device = self.device if backend != "cpu" else None  # the model's GPU, not the current one
        return CopyEngine(HostArena(arena_bytes, backend, max_capacity=arena_max_bytes), backend, device)

    def _copy_costs(self) -> tuple:
        """Measure the copy engine's path as the runtime uses it (offload, wait; reload into a
        fresh device buffer, or on cpu the bytes read in place) at 64 KiB and 8 MiB: bandwidth
        per direction from the difference, the rest of the small copy's time as a fixed cost
        per copy."""
        in_place = self.runtime.reload_in_place and self.device.type == "cpu"
        times = {}
        for nbytes in (64 << 10, 8 << 20):
            probe = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            samples: List[tuple] = []
            for _ in range(5):
                t0 = time.perf_counter()
                handle = self.engine.offload(probe)
                if handle is None:
                    return 1e9, 1e9, (0.0, 0.0)
                handle.wait()
                t1 = time.perf_counter()
                back = handle.host_view() if in_place else self.engine.reload(handle)
                if back.is_cuda:
                    torch.cuda.current_stream(back.device).synchronize()
                t2 = time.perf_counter()
                del back
                handle.release()
                samples.append((t1 - t0, t2 - t1))
            times[nbytes] = [statistics.median(s[i] for s in samples) for i in (0, 1)]
        small, big = times[64 << 10], times[8 << 20]
        bandwidth = [((8 << 20) - (64 << 10)) / max(1e-9, big[i] - small[i]) for i in (0, 1)]
        fixed = [max(0.0, small[i] - (64 << 10) / bandwidth[i]) for i in (0, 1)]
        return bandwidth[0], bandwidth[1], (fixed[0], fixed[1])

    # -- public API -------------------------------------------------------------------------
    def register_gate(self, module: torch.nn.Module, num_experts: int,
                      counts_fn: Callable[[torch.nn.Module, tuple, Any], torch.Tensor],
                      layer: Optional[int] = None) -> GateSpec:
        """Provision at a gate that automatic discovery did not recognize.

        Args:
            module: the gate; its forward hook runs after routing, before the experts.
            num_experts: experts of this MoE layer.
            counts_fn: ``(module, args, output) -> int64 [num_experts]`` token slots per expert
                (``bagualu2.runtime.gates.counts_from_indices`` / ``counts_from_logits`` cover the usual cases).
            layer: MoE layer index; defaults to the next free one.
        """
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r} must be a positive int")
        name = next((n for n, m in self.model.named_modules() if m is module), None)
        if name is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of the provisioned model")
        layer = len(self.gates) if layer is None else layer
        spec = GateSpec(module, name, layer, num_experts, counts_fn, None, name.rpartition(".")[0])
        self.gates.append(spec)
        self.cost.expert_prefixes[layer] = spec.experts_path
        self._hooks.append(module.register_forward_hook(AttachedHook(self._gate_hook(spec))))
        return spec

    def set_pipeline_phase(self, phase: str, stacked_forwards: int = 0) -> None:
        """Tell the planner where this rank is in a pipeline schedule.

        Args:
            phase: ``"warmup"``, ``"steady"``, ``"cooldown"`` or ``"none"``.
            stacked_forwards: forwards that will run on this rank before the next backward.
        """
        if phase not in _PHASES:
            raise ValueError(f"phase={phase!r}: use one of {sorted(_PHASES)}")
        if stacked_forwards < 0:
            raise ValueError(f"stacked_forwards={stacked_forwards} must be >= 0")
        self._phase = phase
        self._stacked = stacked_forwards

    def mean_counts(self) -> Dict[int, List[int]]:
        """Mean tokens per expert of each MoE layer over the micro-batches seen so far."""
        return {layer: [round(v / self._count_frames[layer]) for v in sums]
                for layer, sums in self._count_sums.items() if self._count_frames.get(layer)}

    def plan_for(self, counts: Mapping[int, Sequence[int]]) -> Plan:
        """The plan for a whole micro-batch with these loads under the budget (a static plan).

        Args:
            counts: MoE layer -> tokens per expert (e.g. ``mean_counts()``).

        Raises:
            RuntimeError: before any micro-batch has been profiled.
        """
        if not self.cost.ready:
            raise RuntimeError("plan_for needs the cost model: run at least one micro-batch first")
        if self.budget is None:
            return Plan.keep_all(self.cost.order)
        candidates, floor = self.cost.candidates(self.cost.order, counts, self.min_bytes, self.engine is not None)
        total = self.cost.predict_total(self.cost.order, counts)
        offload_window, reload_window = self.cost.windows(1.0, self._stacked)
        return self.planner.solve(candidates, total - int(self.budget * (1.0 - self.margin)),
                                  offload_window, reload_window, self.cost.copy_frame_s)

    @property
    def last_plan(self) -> Optional[Plan]:
        """The plan the last adaptive micro-batch that planned ran with: each operator's choice
        as its gates left it (an operator not in it was kept), without what the runtime
        released beyond it to stay under the budget. None before any; profiling, calibrating
        and untraced (calm) micro-batches do not plan."""
        return None if self._last_choices is None else Plan(dict(self._last_choices))

    @property
    def policy(self) -> Union[str, Plan]:
        """The policy: ``"adaptive"``, ``"keep_all"``, ``"recompute_all"``, ``"offload_all"``, or
        the fixed :class:`Plan` it runs (an operator not in it is kept).

        A fixed plan can be replaced by another (a ``Plan`` or a mapping of operator keys to
        ``Choice``) from the next forward on: plans compared on one model and one runtime,
        nothing else changed between them (two copies of a model differ in where their memory
        lies, and so in speed).

        Raises:
            ValueError: set on a provisioner whose policy is not a fixed plan (adaptive, or a
                static policy by name, plans in its own way).
            TypeError: an entry of the new plan is not a ``bagualu2.Choice``.
        """
        return self._policy

    @policy.setter
    def policy(self, plan: Union[Plan, Mapping[str, Choice]]) -> None:
        if self._static is None:
            raise ValueError(f"only a fixed plan can be replaced, and this provisioner's policy is "
                             f"{self._policy!r}: enable it with policy=bagualu2.Plan(...) to compare plans")
        choices = checked_choices(plan.choices if isinstance(plan, Plan) else plan)
        self._static = choices
        self._policy = plan if isinstance(plan, Plan) else Plan(choices)

    def step(self) -> None:
        """Mark the end of a training step (optional; numbers the telemetry records)."""
        self._step += 1

    def _note_peak(self) -> int:
        """The ledger's high-water mark over the run, backward passes included (the ledger's
        own restarts as each forward begins, which then reads it first)."""
        self._peak_with_backward = max(self._peak_with_backward, self.runtime.ledger.peak)
        return self._peak_with_backward

    @property
    def budget(self) -> Optional[int]:
        """The activation budget in bytes (None: none). Each adaptive micro-batch's forward is
        held to it through its frame's ``Budget``, which also reserves room for micro-batches
        stacking behind it; backward and other policies hold to it whole. Set it (bytes, a
        fraction of the device's memory, "auto" or None, as ``enable`` takes it) to change it
        for the micro-batches to come."""
        return self._budget

    @budget.setter
    def budget(self, value: Union[str, int, float, None]) -> None:
        value = resolve_budget(value, self.device, 0)
        self._budget = self.runtime.budget_bytes = value

    def report(self) -> Dict[str, Any]:
        """A summary: micro-batches, peak vs budget, violations, plan mix, decision latency.
        Counts and sums cover the whole run; the latency median, the decisions in memory."""
        self.runtime.collect()  # what an interrupt left held is given back before it is counted
        totals = self.telemetry.totals
        lat = sorted(d.latency_us for d in self.telemetry.decisions)
        arena = self.engine.arena.stats() if self.engine is not None else {}
        return {
            "policy": self.policy if isinstance(self.policy, str) else "static",
            "steps": self._step,
            "micro_batches": totals.micro_batches,
            "traced_micro_batches": totals.traced,
            "budget_bytes": self.budget,
            "peak_bytes": totals.peak_bytes,
            "peak_bytes_with_backward": self._note_peak(),
            "resident_bytes": self.runtime.ledger.resident,
            "violations": totals.violations,
            "fallbacks": totals.fallbacks,
            "room_made_bytes": totals.room_made_bytes,
            "oom_recoveries": self._oom_recoveries,
            "saved_bytes_by_choice": dict(totals.bytes_by_choice),
            "decisions": totals.decisions,
            "decision_latency_us": {
                "mean": totals.latency_us_sum / totals.decisions if totals.decisions else 0.0,
                "p50": lat[len(lat) // 2] if lat else 0.0,
                "max": totals.latency_us_max,
            },
            "arena_in_use_bytes": arena.get("in_use", 0),
            "arena_capacity_bytes": arena.get("capacity", 0),  # host memory reserved for offloads
            "gates": [g.name for g in self.gates],
            "unplanned_keys": len(self._unplanned),
            "overlap": self.overlap.report() if self.overlap is not None else None,
        }

    def plot(self, path: Union[str, Path]) -> Path:
        """Draw activation memory against the budget per micro-batch, spikes marked (PNG)."""
        return self.telemetry.plot(path, title=f"bagualu2 {self.report()['policy']}")

    def disable(self) -> None:
        """Remove every hook and the forward wrapper; the model behaves exactly as before."""
        if not self.enabled:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.runtime.backward_observer = None
        self.model.__dict__.pop("forward", None)
        self.enabled = False
        # The pinned arena goes now, or when the last graph holding one of its offloads dies.
        self.engine = self.runtime.engine = None

    # -- forward ----------------------------------------------------------------------------
    def _new_frame(self, conservative: bool) -> Frame:
        if conservative:
            return Frame(default=Choice.RECOMPUTE, index=self._frames)
        if self.policy == "recompute_all":
            frame = Frame(default=Choice.RECOMPUTE, index=self._frames)
            # What the model saves after its last block (the final norm's input, the logits)
            # backward reads first: released, it is rebuilt at once, replaying the last block
            # with it while all else is still resident: more time, and no lower a peak. Kept,
            # as checkpointing every layer keeps it.
            frame.after_blocks = Choice.KEEP
            # The blocks recompute all they save: rerun whole in backward, they need no tracing
            # (whose dispatch costs a tenth of a cpu forward). The overlap scheduler moves
            # per-operator recomputes into pipeline bubbles: with it, they stay traced.
            frame.rerun_blocks = self.overlap is None
            return frame
        if self.policy == "offload_all":
            return Frame(default=Choice.OFFLOAD, index=self._frames)
        frame = Frame(self._static, index=self._frames)
        frame.profile = self.cost.frames < self.profile_frames
        if not frame.profile and self._calibrates():
            if self._calibrations < self.calibrate_frames or 0 < self.recalibrate_every <= self._since_calibration:
                kind = _calibration(self._calibrations - self.calibrate_frames, self.engine is not None)
                frame.default = Choice.OFFLOAD if kind == "offload" else Choice.RECOMPUTE
                if kind.startswith("recompute half"):
                    half = int(kind[-1])
                    frame.choices.update({k: Choice.KEEP for i, k in enumerate(self.cost.order) if i % 2 == half})
                self._calibrating.add(frame.index)
                self._calibrations += 1
                self._since_calibration = 0
                return frame
            self._since_calibration += 1
        # Stable phases cost nothing: a forward whose plan is not expected to release anything
        # is not traced (its recipes would never be used): keep_all's, a fixed plan's that
        # keeps everything, and adaptive's when calm (``_calm``).
        keeps_all = self.policy == "keep_all" or (
            self._static is not None and all(c == Choice.KEEP for c in self._static.values()))
        frame.traced = frame.profile or not (keeps_all or (self.policy == "adaptive" and self._calm()))
        return frame

    def _calibrates(self) -> bool:
        """Whether this micro-batch may be one that recomputes all it can (``_new_frame``):
        only where a plan may have to release, an adaptive policy under a budget that the worst
        routing of the profiled micro-batches would not fit."""
        return (self.policy == "adaptive" and self.budget is not None and self._worst_bytes is not None
                and self._worst_bytes > self.budget)

    def _calm(self) -> bool:
        """Whether this micro-batch is not expected to need a release: even the worst routing
        it could see fits the budget, or, when a copy engine can offload what an unexpected
        spike brings (the runtime does so in untraced forwards), the last micro-batch's routing
        does. The micro-batches after a heavy routing are so traced, ready to plan, until one
        routes within the room again: a run of spikes is planned from its second on, and the
        micro-batch after an isolated one is the only calm one traced (with the last eight
        routings instead, 40 of the demo's 200 micro-batches were traced after its 6 spikes,
        each about 16% slower than untraced)."""
        if self.budget is None:
            return True
        # What the forward saves from outside it (its inputs) is held besides the keys' bytes.
        room = (int(self.budget * (1.0 - self.margin)) - self.runtime.ledger.resident - self._reserve()
                - self._outside_held)
        if self._worst_bytes is not None and self._worst_bytes <= room:
            return True
        return self.engine is not None and self._last_bytes is not None and self._last_bytes <= room

    def _reserve_arena(self) -> None:
        """Reserve the host arena's room for offloads once the profiled micro-batches tell how
        large they can get: the micro-batches in flight (this one and those stacking on it; two
        at least) at the worst routing, less the budget where the planner keeps what fits
        (nothing when it all fits, or when the policy never offloads). Reserved now, between
        micro-batches: an offload that had to reserve it would hold the copies up for as long
        as pinning takes. A user's arena (``arena_bytes``, ``engine``) is left as it is."""
        if self.engine is None or self._arena_chosen or self._worst_bytes is None:
            return
        stacked = self._stacked if self._phase != "none" else max(self._runs, default=0) - 1
        worst = (1 + max(1, stacked)) * self._worst_bytes
        if self.policy == "adaptive":
            need = worst - self.budget if self.budget is not None else 0
        else:  # a fixed plan (the static policies are not profiled)
            need = worst if Choice.OFFLOAD in (self._static or {}).values() else 0
        need = min(need, _ARENA_AHEAD_BYTES)
        if need > self.engine.arena.capacity:
            self.engine.arena.reserve(need)

    def _worst_case_bytes(self) -> int:
        """Saved bytes of a micro-batch of this one's size whose every local expert gets every
        token it can (under expert parallelism, every token of every rank of the group, each
        routing as many as this one)."""
        worst: Dict[int, List[int]] = {}
        for spec in self.gates:
            seen = self._frame_counts.get(spec.layer)
            if not seen:
                return 1 << 62  # a gate that did not fire: no bound
            routed = self._frame_counts.get(SIZE) if spec.size_fn is not None else None
            tokens = sum(routed or seen) // (spec.top_k or 1) * spec.ep_size
            worst[spec.layer] = [tokens] * len(seen)
        experts = [k for k in self.cost.order if self.cost.ops[k].layer is not None]
        others = [k for k in self.cost.order if self.cost.ops[k].layer is None]
        return self.cost.predict_total(experts, worst) + self.cost.predict_total(others, self._frame_counts)

    def _provisioned_forward(self, *args: Any, **kwargs: Any) -> Any:
        # Without grad (evaluation, inference mode) autograd saves nothing: there is nothing to
        # provision, and such a forward must not count as one the cost model learned from.
        if torch._C._current_graph_task_id() == -1:
            reset_replay_depth()  # no replay runs outside a backward pass: an interrupt left it
        if is_recomputing() or not self.enabled or not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)
        self._count_stacking()
        self._check_feasible()
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        try:
            return self._run_frame(args, kwargs, conservative=False)
        except torch.OutOfMemoryError:
            # The failed attempt's graph and saved activations died with the exception.
            self._oom_recoveries += 1
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.empty_cache()
                torch.cuda.set_rng_state(cuda_rng, self.device)
            return self._run_frame(args, kwargs, conservative=True)

    def _learn(self) -> None:
        """Learn what the runtime measured since the last call: what rebuilds, their replayed
        ops and copies cost. Called as each backward pass ends (``backward_observer``: where
        the step pays for it) and as each forward begins."""
        # At the last forward's routing (the one backward ran last, outside a pipeline; rounded
        # means would move a size-driven op's token count and bend its time's fit).
        routed = self._frame_counts or self.mean_counts()
        op_replays = self.runtime.take_op_replay_times()
        if op_replays:
            self.cost.observe_op_replays(op_replays, routed)
        replays = self.runtime.take_replay_times()
        if replays:
            self.cost.observe_replays(replays, routed)
        seconds, copies, nbytes = self.runtime.take_copy_times()
        if copies:  # ... and to offload and reload
            self.cost.observe_copies(seconds, copies, nbytes)

    def _run_frame(self, args: tuple, kwargs: dict, conservative: bool) -> Any:
        # The model's parameters now, not at enable: a wrapper applied since (FSDP2's
        # fully_shard) replaced them, and their old addresses may hold activations by now.
        self.runtime.set_parameters(itertools.chain(self.model.parameters(), self.model.buffers()))
        self._note_peak()
        self._learn()  # what no backward's end learned (a forward's offloads, in a pipeline)
        frame = self._new_frame(conservative)
        self._frame_counts = {}
        self._frame_predicted = 0
        start = time.perf_counter()
        adaptive = self.budget is not None and self.policy == "adaptive"
        inputs = input_bytes(args, kwargs) if adaptive or frame.traced else 0
        if adaptive:
            # Leave room for the floor of each micro-batch that stacks on this rank before its
            # next backward (pipeline warm-up), so the last of them still fits, and for what
            # recipes will pin that nothing can release (labels the loss reads at the very end):
            # it is charged when pinned.
            frame.budget = Budget(self.budget, self._reserve(), self._pin_headroom(inputs))
        active = _active()
        try:
            active.append(self)
            with self.runtime.frame(frame):
                out = self._forward(*args, **kwargs)
                anchored = sum(node.nbytes for node in frame.anchors)
        finally:
            while self in active:  # and above it, what an interrupt left there
                active.pop()
        seconds = time.perf_counter() - start
        self._frames += 1
        if frame.traced:
            pinned = frame.stats.leaf_bytes + frame.stats.outside_bytes
            self._pinned_bytes = max(self._pinned_bytes or 0, pinned)
            self._pinned_per_input = max(self._pinned_per_input, pinned / max(1, inputs))
            self._outside_held = max(self._outside_held, frame.stats.outside_bytes)
        if frame.profile:
            self.cost.observe(frame.saved_profile, self._frame_counts, seconds, frame.unsaved_seconds)
            self._profiled_training = self.model.training
        elif frame.traced and self.cost.ready:
            self._note_unplanned(frame)
        kept = 0
        if self.cost.ready:
            kept, self._hard_floor = self.cost.floors(
                self.cost.order, self._frame_counts, self.min_bytes, self.engine is not None)
        self._floor = max(self._floor, anchored + kept)
        if frame.profile and self.cost.frames >= self.profile_frames:
            self._worst_bytes = self._worst_case_bytes()
            self._reserve_arena()
        if self.cost.ready and self._frame_counts:
            self._last_bytes = self.cost.predict_total(self.cost.order, self._frame_counts)
        imbalance = max((max(c) * len(c) / max(1, sum(c)) for c in self._frame_counts.values()), default=1.0)
        self.telemetry.add(MicroBatch(
            step=self._step, micro_batch=frame.index, peak_bytes=frame.stats.peak_resident,
            predicted_peak_bytes=self._frame_predicted, budget_bytes=self.budget,
            imbalance=imbalance, bytes_by_choice=dict(frame.stats.bytes_by_choice),
            violations=frame.stats.violations, fallbacks=len(frame.stats.fallbacks),
            forward_seconds=seconds, oom_recovered=conservative, traced=frame.traced,
            calibrating=not conservative and frame.index in self._calibrating,
            room_made_bytes=frame.stats.room_made_bytes,
        ))
        if self.policy == "adaptive" and frame.traced and not frame.profile and frame.index not in self._calibrating:
            self._last_choices = frame.choices  # the frame's, which its forward is done with
        self._calibrating.discard(frame.index)
        return out

    def _note_unplanned(self, frame: Frame) -> None:
        """Record the keys ``frame`` saved that the profiled micro-batches never did. An expert's
        keys are new when the expert got no tokens while profiling; any other new key means a
        module ran a different number of ops than when profiled, which renumbers the ops after
        them in the same call: told once."""
        if len(self._unplanned) > 4096:  # enough to report; no scan per micro-batch beyond it
            return
        new = [k for k in frame.keys_seen if k not in self.cost.ops]
        if not new:
            return
        self._unplanned.update(new)
        odd = next((k for k in new if self.cost.expert_of(k) is None), None)
        if odd is not None and self._profiled_training is not None and self.model.training != self._profiled_training:
            if not self._mode_warned:  # not a data-dependent loop: the mode changed the forward
                self._mode_warned = True
                now, then = ("eval", "training") if self._profiled_training else ("training", "eval")
                warnings.warn(
                    f"bagualu2: micro-batch {frame.index} ran in {now} mode with grad enabled, and the profiled "
                    f"micro-batches ran in {then} mode: {now} mode changed what the forward does (dropout, "
                    f"batch-norm statistics), so it saved activations under operator keys the profiled ones "
                    f"never used, e.g. {odd!r}; plans cannot name them, so they are kept. Evaluate under "
                    f"torch.no_grad() (not provisioned), or train in the mode that was profiled.", stacklevel=3)
            return
        if odd is not None and not self._unplanned_warned:
            self._unplanned_warned = True
            warnings.warn(
                f"bagualu2: micro-batch {frame.index} saved activations under operator keys that the "
                f"profiled micro-batches never used, e.g. {odd!r}. A key numbers an op within its "
                f"module call, so a module whose number of ops depends on the data (a loop that stops "
                f"early) renames the ops after that loop; plans cannot name them, so they are kept. "
                f"Moving such a loop into a module of its own keeps the names stable.", stacklevel=3)

    def _count_stacking(self) -> None:
        """Place this forward in its run of forwards without a backward between them."""
        backwards = self.runtime.backward_passes
        if backwards == self._backwards_seen:
            self._run_position += 1
        else:
            if self._backwards_seen >= 0:
                self._runs.append(self._run_position + 1)
            self._run_position = 0
        self._backwards_seen = backwards

    def _check_feasible(self) -> None:
        """Refuse a micro-batch no plan can fit, before it allocates anything."""
        if self.budget is None or self.policy != "adaptive" or not self.cost.ready:
            return
        # Loads of the previous micro-batch stand in for this one's, not yet routed. What no
        # release can take back: the storages that can be neither offloaded nor recomputed, and
        # what the forward holds from outside it (its inputs, saved or pinned by recipes).
        # What earlier micro-batches still keep counts only where nothing can offload it (looked
        # at only when the micro-batch would not fit otherwise).
        resident = self.runtime.ledger.resident
        floor = self._hard_floor + self._outside_held
        if resident + floor > self.budget:
            resident -= self.runtime.movable_bytes()
        if resident + floor > self.budget:
            raise InfeasibleBudgetError(self.budget, resident + floor, f"micro-batch {self._frames}")

    def _pin_headroom(self, inputs: int) -> int:
        """Bytes the forward will hold that nothing can release (what recipes pin: inputs from
        outside the forward, storages written in place beyond replay; inputs saved as they
        are): as many as traced micro-batches held so far, and more when this forward's tensor
        arguments are larger (a longer sequence), in proportion; before any, the forward's
        tensor arguments or the margin, the larger."""
        if self._pinned_bytes is not None:
            return max(self._pinned_bytes, int(math.ceil(self._pinned_per_input * inputs)))
        return max(inputs, int((self.budget or 0) * self.margin))

    def _reserve(self) -> int:
        """Room for the micro-batches that will stack on this one before its backward: what
        each of them holds that no plan releases. In a pipeline schedule the schedule tells how
        many (``set_pipeline_phase``); outside one, as many as followed this place in the
        longest of the last runs of back-to-back forwards (gradient accumulation)."""
        if self._phase != "none":
            stacked = self._stacked
        else:
            stacked = max(0, max(self._runs, default=0) - 1 - self._run_position)
        return stacked * (self._floor + (self._pinned_bytes or 0))

    def _exceeded(self, resident: int, budget: int, key: str) -> None:
        raise BudgetExceededError(resident, budget, key)

    # -- gating -----------------------------------------------------------------------------
    def _gate_hook(self, spec: GateSpec) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any = None) -> None:
            if self.runtime.active_frame is None or is_recomputing():
                return
            with self.runtime.untraced(), torch.no_grad():
                counts = spec.counts_fn(module, args, output)
                size = spec.size_fn(module, args, output) if spec.size_fn is not None else None
            self._on_gate(spec.layer, checked_counts(counts, what, spec.num_experts, token_slots(spec, args)), size)

        what = f"counts_fn of gate {spec.name!r} (layer {spec.layer})"

        return hook

    def _on_gate(self, layer: int, counts: Union[torch.Tensor, Sequence[int]], size: Optional[int] = None) -> None:
        frame = self.runtime.active_frame
        if frame is None:
            return
        values = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
        if size is not None and SIZE not in self._frame_counts:
            # An expert-parallel gate's counts are what this rank's experts receive; the
            # operators outside the experts follow this rank's own tokens (the first gate's).
            self._frame_counts[SIZE] = [int(size)]
        self._frame_counts[layer] = values
        sums = self._count_sums.setdefault(layer, [0] * len(values))
        if len(sums) == len(values):
            self._count_sums[layer] = [a + b for a, b in zip(sums, values)]
            self._count_frames[layer] = self._count_frames.get(layer, 0) + 1
        if self.policy != "adaptive" or self.budget is None or not self.cost.ready:
            return
        if frame.index in self._calibrating:
            return  # it releases all it can already
        if not frame.traced:
            if not self._frame_predicted:  # the high-water mark, predicted as a traced frame's is
                exact = {g.layer: self._frame_counts.get(g.layer, values) for g in self.gates}
                exact.update({SIZE: self._frame_counts[SIZE]} if SIZE in self._frame_counts else {})
                self._frame_predicted = (frame.stats.start_resident + self._outside_held
                                         + self.cost.predict_total(self.cost.order, exact))
            return
        start = time.perf_counter()
        decision = self._decide(frame, layer, values)
        decision.latency_us = (time.perf_counter() - start) * 1e6
        self.telemetry.add(decision)

    def _decide(self, frame: Frame, layer: int, values: List[int]) -> Decision:
        cost = self.cost
        # Later layers are assumed to route like this one.
        counts = {g.layer: (self._frame_counts.get(g.layer) if g.layer < layer else values) for g in self.gates}
        counts[layer] = values
        counts[SIZE] = self._frame_counts.get(SIZE) or next(iter(self._frame_counts.values()), values)
        remaining = [k for k in cost.order if k not in frame.keys_seen]
        predicted = cost.predict_total(remaining, counts)
        # In-flight offload sources are released as their copies complete.
        resident = self.runtime.ledger.resident - self.runtime.inflight_bytes
        target = int(self.budget * (1.0 - self.margin)) - self._reserve()
        must_free = resident + predicted - target
        if not self._frame_predicted:
            self._frame_predicted = resident + predicted
        imbalance = max(values) * len(values) / max(1, sum(values))
        record = Decision(self._step, frame.index, layer, imbalance, resident, resident + predicted,
                          resident + predicted, self.budget, {"keep": len(remaining)}, 0.0)
        for key in remaining:  # a later gate may relax what an earlier one decided
            frame.choices.pop(key, None)
        if must_free <= 0:
            return record
        # A micro-batch's first offload costs more than its own copy (copy_frame_s).
        setup = 0.0 if frame.stats.offloaded_storages else cost.copy_frame_s
        anchors = [n.key for n in frame.anchors]
        candidates, _ = cost.candidates(remaining, counts, self.min_bytes, self.engine is not None, anchors)
        offload_window, reload_window = cost.windows(len(remaining) / max(1, len(cost.order)), self._stacked)
        plan = self.planner.solve(candidates, must_free, offload_window, reload_window, setup)
        frame.choices.update(plan.choices)
        record.feasible = plan.feasible
        record.planned_bytes = resident + predicted - plan.freed_bytes
        record.mix = {c.name.lower(): n for c, n in plan.mix().items()}
        record.mix["keep"] += len(remaining) - len(plan.choices)
        return record

class _ProvisionedForward:
    """The provisioned forward bagualu2 puts on a model in place of its own.

    Under torch.compile it runs eagerly: the tracing mode, the saved-tensor hooks and the gating
    callbacks are Python that Dynamo would otherwise try to trace, graph-breaking and
    recompiling at every op. A copy of the model (``copy.deepcopy``, or ``torch.save`` of the
    whole module) gets the model's own forward back: the copy is a plain model, not one that
    runs through the original (with the original's parameters).
    """

    __slots__ = ("run", "original")
    _hidden_from_dynamo = False  # __call__ wrapped by torch.compiler.disable, at the first enable()

    def __init__(self, run: Callable[..., Any], original: Callable[..., Any]) -> None:
        cls = type(self)
        if not cls._hidden_from_dynamo:  # here, not at import: it imports torch._dynamo (about 1 s)
            cls.__call__ = torch.compiler.disable(cls.__call__)  # type: ignore[method-assign]
            cls._hidden_from_dynamo = True
        self.run = run
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., Any]:
        return copy.deepcopy(self.original, memo)  # a bound method: bound to the copy

    def __reduce__(self) -> Tuple[Any, tuple]:
        return _same, (self.original,)  # pickled as the bound method it is


def _same(x: Any) -> Any:
    return x


def _plain_forward(model: torch.nn.Module) -> bool:
    """Whether the forward in ``model.__dict__`` is the class's own, bound to ``model`` (what a
    copy of a provisioned model holds)."""
    forward = model.__dict__.get("forward")
    return (getattr(forward, "__self__", None) is model
            and getattr(forward, "__func__", None) is getattr(type(model), "forward", None))


def enable(model: torch.nn.Module, budget: Union[str, int, float, None] = "auto",
           policy: Union[str, Mapping[str, Choice]] = "adaptive", **options: Any) -> Provisioner:
    """Provision ``model``'s saved activations under ``budget``; the training loop is unchanged.

    Args:
        model: the module whose ``forward`` is one micro-batch (a whole model or a pipeline
            stage; for a ``torch.compile`` wrapper, the module it wraps). Its MoE gates are
            found automatically (see ``bagualu2.runtime.gates.find_gates``); register others with
            ``Provisioner.register_gate`` or report loads with ``bagualu2.on_gating``.
        budget: ``"auto"`` (device memory minus what is resident now minus ``reserve_bytes``;
            no limit on CPU), an int of bytes, or a float fraction of device memory.
        policy: ``"adaptive"`` (decide per micro-batch at gating), or a static baseline through
            the same machinery: ``"keep_all"``, ``"recompute_all"`` (all but what the model
            saves after its last block, which backward reads first), ``"offload_all"``, or a
            fixed mapping of operator keys to ``Choice``.
        **options: ``on_exceed`` (``"record"`` or ``"raise"``: raise ``BudgetExceededError``
            when the budget is crossed), ``min_bytes`` (smaller activations are kept, unless
            the budget leaves no room for one),
            ``arena_bytes`` (pinned host memory reserved at enable; by default 64 MiB, and
            once the profiled micro-batches show how large activations get, what offloading
            them may need, up to 8 GiB), ``arena_max_bytes`` (what the arena may grow to when
            offloads need more; default half of this process's share of host memory),
            ``reserve_bytes``, ``profile_frames``, ``calibrate_frames`` (adaptive micro-batches
            that recompute all they can once profiled, to measure what replays cost before a
            plan relies on it: the first under a budget their worst routing would not fit;
            default 3, the first of which runs cold), ``recalibrate_every`` (one more such
            micro-batch after every that many that may have to release, every other one of
            them offloading all it can instead when there is a copy engine, to measure what
            copies cost, and every other one that recomputes recomputing half of it, to
            measure rebuilds at two sizes; default 0, never),
            ``margin``, ``telemetry_path`` (JSON lines), ``gates`` (a list of
            ``bagualu2.runtime.gates.GateSpec`` instead of discovery; ``[]`` when the model reports its
            routing through ``bagualu2.on_gating``).

    Returns:
        The ``Provisioner``: ``report()``, ``plot(path)``, ``disable()``.
    """
    prov = Provisioner(model, budget, policy, **options)
    if not prov.gates and policy == "adaptive" and options.get("gates") is None:
        warnings.warn(
            "bagualu2.enable: no MoE gate found, so decisions are made only by the budget check at "
            "each save. " + describe_unsupported(model), stacklevel=2,
        )
    return prov


def on_gating(tokens_per_expert: Union[torch.Tensor, Sequence[int]], layer: int) -> None:
    """Report a MoE layer's routing from inside its forward (for gates that are not modules).

    Call it after routing and before the experts run. Outside a provisioned forward, and
    during recomputation, it does nothing.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise TypeError(f"on_gating(layer={layer!r}): layer must be the MoE layer's index, an int >= 0")
    active = _active()
    if not active or is_recomputing():
        return
    # The innermost provisioner of this thread whose forward runs (one an interrupt left on the
    # stack has none).
    prov = next((p for p in reversed(active) if p.runtime.active_frame is not None), None)
    if prov is None:
        return
    spec = next((g for g in prov.gates if g.layer == layer), None)
    values = checked_counts(tokens_per_expert, f"on_gating(layer={layer})", spec.num_experts if spec else None)
    with prov.runtime.untraced(), torch.no_grad():
        prov._on_gate(layer, values)
