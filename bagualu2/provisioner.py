"""The ``Provisioner`` (what ``bagualu2.enable``, in ``bagualu2.api``, returns): adaptive activation
provisioning decided at MoE gating.

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
last micro-batch's routing does, or overflows by no more than tracing itself would pin
(``Footprint.calm``): a spike that then arrives unannounced is held under the
budget by offloading (an untraced forward has no recipes to recompute from), and the
micro-batches after it are traced, ready to plan, until one routes within the budget again.
The runtime independently holds the ledger under the budget at every save (offloading or
recomputing a storage that would cross it), so a misprediction costs time, never the budget.

By default (``releases="reruns"``), where the model has blocks a rerun may repeat (its layers,
or, where a layer issues collectives, its experts), a micro-batch that is not calm is not
traced either: it releases by rerunning whole blocks in backward, chosen as its forward begins
(at the last routing) and at each gate (at its own, among the blocks not begun, its own layer's
experts included), where that costs less than offloading and the rerun fits the budget
(``provision/block_reruns.py``). Steps 1-4 above, operator by operator, are what
``releases="operators"`` and a model with no such blocks do, and what a pipeline's overlap
scheduler and compiled regions plan with.

The first ``profile_frames`` micro-batches time every op to build the cost model; after them,
some of those a plan may have to release from (their worst routing would not fit) calibrate:
they release all they can, so that their backward passes measure what releases cost before
any plan relies on it (``MicroBatch.calibrating``; ``provision/calibration.py`` says which). Static
policies (``keep_all``, ``recompute_all``, ``offload_all``, or a fixed ``Plan``) use the same
machinery with a fixed plan and no enforcement, to show what they would do under the budget.

Safety net: if the device runs out of memory inside a provisioned forward, the partial
micro-batch is dropped (its graph and saved activations with it), the RNG is rewound, and the
forward reruns with a recompute-everything plan; the step goes on.

The ``Provisioner`` says when these decisions are made; what is decided, and what with, are
small objects it holds, each owning its own state (``bagualu2/provision/``): the settings it was
enabled with (``Options``, frozen), what a gate decides and the planner it solves with
(``GateDecisions``), what it learned (``Learned``: the cost model, the micro-batches in flight
(``Stacking``), what one holds that no plan releases and the room that leaves (``Footprint``),
the routing seen (``RoutingRecord``), the calibrating micro-batches (``Calibration``), the keys
no plan can name (``UnplannedKeys``), the excess an allocator view showed), what the budget
leaves each micro-batch's activations (``Limits``), what the run counted (``RunCounters``), the
policy run and the frame each forward starts from (``Policy``), the hooks that hear each gate
(``GateHooks``), and the forward put on the model, where it went and what it calls
(``Wrapping``), with the per-thread stack of running provisioners (``provision/forward.py``).
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from bagualu2.runtime import ActivationRuntime, Budget, Frame, is_recomputing
from bagualu2.runtime.recipes import reset_replay_depth
from bagualu2.runtime.attachment import AttachedHook
from bagualu2.runtime.rerun import RerunCapture
from bagualu2.runtime.residency import Residency
from bagualu2.plan.cost_model import CostModel
from bagualu2.errors import BudgetExceededError, recorded_memory_violation, recorded_violation
from bagualu2.inputs import (
    Options, check_materialized, check_policy, device_of, input_bytes, resolve_budget,
)
from bagualu2.provision.block_reruns import BlockReruns
from bagualu2.provision.calibration import learn
from bagualu2.provision.counters import RunCounters
from bagualu2.provision.copy_engine import arena_need, make_engine, measure_copy_costs, reserve_arena
from bagualu2.provision.decisions import GateDecisions
from bagualu2.provision.excess import AllocatorView, checked_allocator
from bagualu2.provision.learned import Learned
from bagualu2.provision.limits import Limits
from bagualu2.provision.forward import Wrapping, active, plain_forward, unwrap_compiled
from bagualu2.provision.policy import POLICIES, Policy
from bagualu2.provision import state
from bagualu2.provision.teardown import Teardown
from bagualu2.runtime.gates import GateSpec, find_gates
from bagualu2.provision.gate_hooks import GateHook, GateHooks
from bagualu2.provision.region_gates import RegionGates
from bagualu2.runtime.regions import (
    check_compile_config, check_compile_options, compiled_regions, hide_from_dynamo, holds_collectives,
)
from bagualu2.plan.planner import Choice, Plan
from bagualu2.telemetry import MicroBatch, Telemetry

__all__ = ["Provisioner", "POLICIES"]


def _traces(frame: Frame) -> bool:
    """Whether ``frame``'s forward is traced: one that only reruns blocks traces nothing."""
    return frame.traced and frame.rerun_chosen is None


def _rng_rewinder(device: torch.device) -> Callable[[], None]:
    """What puts the RNG back as it is now (and, on a GPU, the cached memory a failed try left),
    so a micro-batch run again draws what its first try drew."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def rewind() -> None:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.empty_cache()
            torch.cuda.set_rng_state(cuda_rng, device)
    return rewind


def _piece(name: str, doc: str) -> property:
    """A learned piece (``Learned``) that integrations and tests read on the provisioner."""
    return property(lambda self: getattr(self.learned, name), doc=doc)


class Provisioner:
    """Keeps a model's saved activations under a device budget, one micro-batch at a time.

    Create with :func:`enable`. See the module note for how decisions are made.
    """

    cost = _piece("cost", "The cost model (``bagualu2.plan.cost_model.CostModel``).")
    footprint = _piece("footprint", "What one micro-batch holds that no plan releases (``Footprint``).")
    routing = _piece("routing", "The tokens per expert each MoE layer routed (``RoutingRecord``).")
    stacking = _piece("stacking", "The micro-batches in flight on this rank (``Stacking``).")
    excess = _piece("excess", "What the allocator showed beyond the activations at a peak (``WholeMemory``).")

    def __init__(self, model: torch.nn.Module, budget: Union[str, int, float, None] = "auto",
                 policy: Union[str, Mapping[str, Choice]] = "adaptive", *,
                 telemetry_path: Union[str, Path, None] = None, gates: Optional[Sequence[GateSpec]] = None,
                 engine: Any = None, allocator: Union[None, str, Callable[[], Any]] = None,
                 **settings: Any) -> None:
        """See :func:`bagualu2.enable`; ``settings`` are its ``Options``."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"enable() needs a torch.nn.Module, got {type(model).__name__}")
        root, model = unwrap_compiled(model)  # torch.compile(model): the wrapper, what it wraps
        regions = compiled_regions(model)
        for path, region in regions.items():
            check_compile_options(region, f"module {path!r} ({type(region).__name__})")
        if regions or root is not None:
            check_compile_config()
            # A gate's region hook is traced into the graph that calls its gate; run as a frame of
            # its own (its gate's call fell back to eager), it runs eagerly, as no graph of its own.
            hide_from_dynamo(ActivationRuntime._pack, ActivationRuntime._pack_checked, ActivationRuntime._unpack_checked,
                             Residency.unpack,
                             RegionGates._report, RegionGates._traced, AttachedHook.__call__, RerunCapture.__call__,
                             GateHook.__call__)
        check_policy(policy, POLICIES)
        self.options = options = Options(**settings)
        check_materialized(model)
        if "forward" in model.__dict__ and not plain_forward(model):
            raise RuntimeError(f"{type(model).__name__} already has bagualu2 (or another forward wrapper) enabled; "
                               f"call disable() on the existing Provisioner first")
        self.model = model
        self.wrapping = Wrapping(model, root, list(regions), root is None or not holds_collectives(model))
        self.device = device_of(model)
        # A view of the allocator: the budget is then on the whole memory it counts, and the
        # activations get what the excess it shows leaves (provision/excess.py).
        read = checked_allocator(allocator, self.device)
        budget = resolve_budget(budget, self.device, options.reserve_bytes, whole=read is not None)
        self._policy = Policy(policy, model, compiled=self.wrapping.compiled)
        self.telemetry = Telemetry(Path(telemetry_path) if telemetry_path else None)
        self.engine = engine if engine is not None else make_engine(self.device, options.arena_bytes,
                                                                         options.arena_max_bytes)
        self._arena_chosen = engine is not None or options.arena_bytes is not None  # _reserve_arena leaves it
        self.runtime = ActivationRuntime(
            # its ``budget_bytes`` is written by ``self.limits`` below, the budget's one home
            self.engine, min_bytes=options.min_bytes, enforce_budget=self._policy.adaptive,
            on_exceed=self._exceeded if options.on_exceed == "raise" else None,
            verify=options.verify if options.verify is not None else os.environ.get("BAGUALU2_VERIFY", "off"),
            on_mismatch=options.on_mismatch,
        )
        # Learning from what each backward measured; ``unsubscribe()`` it to read the runtime's
        # measurements (``take_replay_times``, ``take_copy_times``) yourself.
        self.learning = self.runtime.residency.on_backward_end.subscribe(self._learn)
        self.gates: List[GateSpec] = list(gates) if gates is not None else find_gates(model)
        in_place = self.runtime.residency.reload_in_place and self.device.type == "cpu"  # a reload reads the host copy
        cost = CostModel({g.layer: g.experts_path for g in self.gates},
                         *measure_copy_costs(self.engine, self.device, in_place),
                         copies_overlap=self.device.type != "cpu")  # the cpu's copy threads hide nothing
        modules = dict(model.named_modules())
        for spec in self.gates:
            experts = modules.get(spec.experts_path)
            if isinstance(experts, torch.nn.ModuleList) and len(experts) < spec.num_experts:
                cost.memory.local_experts[spec.layer] = len(experts)
        # What decisions are made from, each piece the one owner of its state.
        self.learned = Learned(cost)
        self._teardown = Teardown()  # what disable() undoes, last first (on_disable)
        for handle in self.runtime.attach(model, root_compiled=self.wrapping.compiled):
            self.on_disable(handle.remove)
        self.gate_hooks = GateHooks(self.runtime, self.on_gate)
        self.on_disable(self.gate_hooks.regions.close)
        for spec in self.gates:
            self.on_disable(self.gate_hooks.install(spec, self.wrapping.regions).remove)
        self.on_disable(self.wrapping.install(self._provisioned_forward))
        memory = AllocatorView(read, self.excess, cost, model) if read is not None else None
        # what the budget leaves each micro-batch's activations, and its saves are planned to
        self.limits = Limits(budget, options.margin, self.runtime, self.footprint, self.stacking, memory)
        # what each gate decides, and the planner it solves with
        self.decisions = GateDecisions(self.cost, self.runtime, self.routing, self.stacking, self.gates,
                                       options.min_bytes)
        self.reruns = BlockReruns(self.cost)  # which blocks a micro-batch reruns whole, untraced
        self.counters = RunCounters()
        self.overlap: Any = None  # an OverlapDriver on a pipeline rank (pipeline.enable_bagualu2)
        self.enabled = True

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
        self.on_disable(self.gate_hooks.install(spec, self.wrapping.regions).remove)
        return spec

    def on_disable(self, fn: Callable[[], Any]) -> None:
        """Have :meth:`disable` call ``fn()``: how an integration undoes what it wired around this
        provisioner (hooks, wrappers, subscriptions), as the provisioner undoes its own. Each runs
        once, last registered first; when one raises, the rest still run and ``disable`` raises
        the first error (``bagualu2.provision.teardown``).

        Raises:
            RuntimeError: this provisioner is disabled already (nothing would call ``fn``).
        """
        self._teardown.add(fn)

    def set_pipeline_phase(self, phase: str, stacked_forwards: int = 0) -> None:
        """Tell the planner where this rank is in a pipeline schedule.

        Args:
            phase: ``"warmup"``, ``"steady"``, ``"cooldown"`` or ``"none"``.
            stacked_forwards: forwards that will run on this rank before the next backward.
        """
        self.stacking.set_phase(phase, stacked_forwards)

    def mean_counts(self) -> Dict[int, List[int]]:
        """Mean tokens per expert of each MoE layer over the micro-batches seen so far."""
        return self.routing.mean()

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
        candidates, floor = self.cost.candidates(self.cost.order, counts, self.options.min_bytes, self.engine is not None)
        total = self.cost.predict_total(self.cost.order, counts)
        offload_window, reload_window = self.cost.windows(1.0, self.stacking.declared)
        return self.decisions.planner.solve(candidates, total - int(self.limits.limit() * (1.0 - self.limits.margin)),
                                  offload_window, reload_window, self.cost.copy_frame_s)

    @property
    def last_plan(self) -> Optional[Plan]:
        """The plan the last adaptive micro-batch that planned ran with: each operator's choice
        as its gates left it (an operator not in it was kept), without what the runtime
        released beyond it to stay under the budget. None before any; profiling, calibrating
        and untraced (calm) micro-batches do not plan."""
        choices = self.counters.last_choices
        return None if choices is None else Plan(dict(choices))

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
                static policy by name, plans in its own way), or a key of the new plan names
                no operator of the model.
            TypeError: an entry of the new plan is not a ``bagualu2.Choice``.
        """
        return self._policy.shown

    @policy.setter
    def policy(self, plan: Union[Plan, Mapping[str, Choice]]) -> None:
        self._policy.replace(plan)

    def step(self) -> None:
        """Mark the end of a training step (optional; numbers the telemetry records)."""
        self.counters.step += 1

    def _note_peak(self) -> int:
        """The ledger's high-water mark over the run, backward passes included (the ledger's
        own restarts as each forward begins, which then reads it first)."""
        return self.counters.note_peak(self.runtime.ledger.peak)

    @property
    def budget(self) -> Optional[int]:
        """The activation budget in bytes (None: none). Each adaptive micro-batch's forward is
        held to it through its frame's ``Budget``, which also reserves room for micro-batches
        stacking behind it; backward and other policies hold to it whole. Set it (bytes, a
        fraction of the device's memory, "auto" or None, as ``enable`` takes it) to change it
        for the micro-batches to come."""
        return self.limits.budget

    @budget.setter
    def budget(self, value: Union[str, int, float, None]) -> None:
        self.limits.set_budget(resolve_budget(value, self.device, 0, whole=self.memory is not None))

    @property
    def memory(self) -> Optional[AllocatorView]:
        """The allocator view (``enable``'s ``allocator``), or None: the budget is on the activations alone."""
        return self.limits.memory

    @property
    def profile_frames(self) -> int:
        """Micro-batches profiled before any plan (``enable``'s ``profile_frames``)."""
        return self.options.profile_frames

    @property
    def calibrate_frames(self) -> int:
        """Micro-batches that release all they can once profiled (``enable``'s ``calibrate_frames``)."""
        return self.options.calibrate_frames

    @property
    def margin(self) -> float:
        """The fraction of the activations' limit plans leave free (``enable``'s ``margin``)."""
        return self.limits.margin

    def report(self) -> Dict[str, Any]:
        """A summary: micro-batches, peak vs budget, violations, plan mix, decision latency.
        Counts and sums cover the whole run; the latency median, the decisions in memory."""
        self.runtime.collect()  # what an interrupt left held is given back before it is counted
        totals = self.telemetry.totals
        arena = self.engine.arena.stats() if self.engine is not None else {}
        return {
            "policy": self._policy.name,
            "steps": self.counters.step,
            "micro_batches": totals.micro_batches,
            "traced_micro_batches": totals.traced,
            "budget_bytes": self.budget,
            "peak_bytes": totals.peak_bytes,
            "peak_bytes_with_backward": self._note_peak(),
            "resident_bytes": self.runtime.ledger.resident,
            "violations": totals.violations,
            "memory_peak_bytes": self.excess.peak if self.memory is not None else None,
            "memory_violations": self.excess.over if self.memory is not None else None,
            "excess_bytes": self.memory.now if self.memory is not None else None,
            "fallbacks": totals.fallbacks,
            "room_made_bytes": totals.room_made_bytes,
            "oom_recoveries": self.counters.oom_recoveries,
            "saved_bytes_by_choice": dict(totals.bytes_by_choice),
            "decisions": totals.decisions,
            "decision_latency_us": self.telemetry.decision_latency_us(),
            "arena_in_use_bytes": arena.get("in_use", 0),
            "arena_capacity_bytes": arena.get("capacity", 0),  # host memory reserved for offloads
            "gates": [g.name for g in self.gates],
            "unplanned_keys": len(self.learned.unplanned),
            "overlap": self.overlap.report() if self.overlap is not None else None,
            "verify": self.runtime.verifier.report(),
        }

    # -- checkpoint state (torch's Stateful convention; bagualu2/provision/state.py) ----------
    def state_dict(self) -> Dict[str, Any]:
        """What this provisioner learned, this rank's under its own key, for a checkpoint beside
        the model and optimizer (``torch.distributed.checkpoint`` saves it as any ``Stateful``):
        the cost model, the footprint and routing it decides from, the pipeline stacking, the
        calibration done. Loaded into a new run's provisioner (``load_state_dict``), it decides
        as this run would have: nothing is profiled or calibrated again. Versioned; see
        ``bagualu2.provision.state`` for the format."""
        counters = {**self.counters.saved(), "backward_passes": self.runtime.residency.backward_passes,
                    "arena_bytes": self.engine.arena.capacity if self.engine is not None else 0}
        return state.save(self.learned.pieces(), counters, state.signature(self.model, self.gates))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from a ``state_dict()`` saved by this model's provisioner on this rank.

        Raises:
            ValueError: the state is another version's, another model's (its modules, gates or
                profiled operators differ), another rank layout's, or cannot be read whole; the
                message names the difference, and nothing was loaded.
        """
        counters = state.load(state_dict, self.learned.pieces(), state.signature(self.model, self.gates),
                              self.cost.order)
        self.counters.restore(counters)
        # Stacking counts runs of forwards by the runtime's backward passes: they go on counting.
        self.runtime.residency.backward_passes = counters["backward_passes"]
        if self.engine is not None and not self._arena_chosen:
            reserve_arena(self.engine, counters["arena_bytes"])  # as the saved run had reserved it

    def plot(self, path: Union[str, Path]) -> Path:
        """Draw activation memory against the budget per micro-batch, spikes marked (PNG)."""
        return self.telemetry.plot(path, title=f"bagualu2 {self.report()['policy']}")

    def disable(self) -> None:
        """Remove every hook and the forward wrapper, and undo what integrations wired
        (:meth:`on_disable`, last first); the model behaves exactly as before. A second call
        does nothing.

        Raises:
            Exception: the first error an ``on_disable`` function raised, once all have run.
        """
        if not self.enabled:
            return
        self.enabled = False
        self.learning.unsubscribe()
        try:
            self._teardown.run()
        finally:  # the pinned arena goes now, or when the last graph holding one of its offloads dies
            self.engine = self.runtime.residency.engine = None
            self.runtime.residency.set_parameters(())

    # -- forward ----------------------------------------------------------------------------
    def _provisioned_forward(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-batch: the model's forward, provisioned. Its steps: begin (count it, learn
        the window that ended, refuse it if nothing can fit), then run it; if the device runs
        out of memory, the partial micro-batch is dropped (its graph and saved activations died
        with the exception), the RNG rewound, and it runs again recomputing everything."""
        if not self._provisions():
            return self.wrapping.forward(*args, **kwargs)
        self._begin()
        rewind = _rng_rewinder(self.device)
        try:
            return self._micro_batch(args, kwargs, conservative=False)
        except torch.OutOfMemoryError:
            self.counters.oom_recoveries += 1
            rewind()
            return self._micro_batch(args, kwargs, conservative=True)

    def _micro_batch(self, args: tuple, kwargs: dict, conservative: bool) -> Any:
        """One try at a micro-batch's forward, as its steps: catch up with what changed since the
        last, choose its frame, open it (the pieces readied, the budget it is held to), run the
        forward in it, learn from it, and record it (``conservative``: the try after running out
        of memory, recomputing everything)."""
        self._catch_up()
        frame = self._choose_frame(conservative)
        inputs = self._open(frame, args, kwargs)
        out, seconds, anchored = self._run_forward(frame, args, kwargs)
        self._learn_from(frame, inputs, seconds, anchored)
        self._record(frame, seconds, conservative)
        return out

    def _provisions(self) -> bool:
        """Whether this forward is provisioned. Without grad (evaluation, inference mode)
        autograd saves nothing: there is nothing to provision, and such a forward must not
        count as one the cost model learned from; nor does a rerun in backward, or a forward
        once disabled."""
        if torch._C._current_graph_task_id() == -1:
            reset_replay_depth()  # no replay runs outside a backward pass: an interrupt left it
        return not is_recomputing() and self.enabled and torch.is_grad_enabled()

    def _begin(self) -> None:
        """As a micro-batch begins: count it in the stacking, learn what the allocator showed
        in the window that ended (told once if it crossed the budget), and refuse it if no
        plan can fit it."""
        self.stacking.count_forward(self.runtime.residency.backward_passes)
        crossed = self.limits.begin(not self.counters.frames, self.routing.counts)
        if crossed is not None and self.counters.first_violation():  # the first crossing, told once
            warnings.warn(recorded_memory_violation(self.counters.frames - 1, self.budget, crossed), UserWarning,
                          stacklevel=4)
        self._check_feasible()

    def _learn(self) -> None:
        """Learn what the runtime measured (``provision.calibration.learn``). Called as each
        backward pass ends (``learning``: where the step pays for it) and as each
        forward begins."""
        learn(self.cost, self.runtime, self.routing.counts or self.routing.mean())

    def _catch_up(self) -> None:
        """What a try reads first: the model's parameters now, not at enable (a wrapper applied
        since, FSDP2's fully_shard, replaced them, and their old addresses may hold activations
        by now), the run's peak, and what no backward's end learned (a forward's offloads, in a
        pipeline)."""
        self.runtime.residency.set_parameters_of(self.model)
        self._note_peak()
        self._learn()

    def _choose_frame(self, conservative: bool) -> Frame:
        """The frame this micro-batch runs in: what it profiles, calibrates, traces or reruns.
        ``conservative``: the rerun after an out-of-memory error, recomputing everything."""
        if conservative:
            return Frame(default=Choice.RECOMPUTE, index=self.counters.frames)
        # recompute_all's blocks recompute all they save: rerun whole in backward, they need no
        # tracing and its dispatch. The overlap scheduler moves per-operator recomputes into
        # pipeline bubbles: with it, they stay traced.
        frame, final = self._policy.frame(self.counters.frames, rerun_blocks=self.overlap is None)
        if final:
            return frame
        frame.profile = self.cost.frames < self.options.profile_frames
        if not frame.profile and self._calibrates() and self.learned.calibration.begin(
                frame, self.cost, self.engine is not None, self.options.calibrate_frames,
                self.options.recalibrate_every):
            return frame
        # Stable phases cost nothing: a forward whose plan is not expected to release anything
        # is not traced (its recipes would never be used): keep_all's, a fixed plan's that
        # keeps everything, and adaptive's when calm (``Limits.calm``).
        frame.traced = frame.profile or not (self._policy.keeps_all or (self._policy.adaptive and self.limits.calm(self.engine is not None)))
        if not frame.profile and self._reruns_blocks():
            self._choose_reruns(frame)
        return frame

    def _choose_reruns(self, frame: Frame) -> None:
        """Blocks rerun whole in backward need no trace: where rerunning some costs less than
        offloading what the last routing would overflow, the forward reruns them and is traced
        nowhere (``provision/block_reruns.py``)."""
        counts = self.routing.counts or self.routing.mean()
        room = self.limits.target() - self.runtime.ledger.resident - self.footprint.outside_held
        last = self.footprint.last_bytes  # None where no gate routed (a model with none)
        saves = last if last is not None else self.cost.predict_total(self.cost.order, counts)
        want = self.reruns.choose(saves - room, self.runtime.rerunnable_blocks(), counts, self.runtime.block_outputs,
                                  self._offload_seconds, room)
        if want or frame.traced:
            frame.traced = True
            frame.rerun_chosen = set(want)

    def _offload_seconds(self, nbytes: int) -> float:
        """What offloading ``nbytes`` of a forward's last saves costs the step (the runtime's
        offloads where they would cross the budget): no window hides them. An untraced forward
        that leaves a release to offloads has nothing to fall back on if one fails (it keeps,
        over the budget), so releases are planned onto offloads only where copies run beside
        the compute (a GPU's copy engines; the cpu backend's threads take the compute's cores)
        and until one fails (the engine refused it, its arena was full)."""
        if nbytes <= 0:
            return 0.0
        if self.engine is None or self.counters.copies_failed or not self.cost.copies.copies_overlap:
            return float("inf")
        cost = self.cost
        out, back = cost.windows(0.0)
        return (cost.copies.copy_frame_s + max(0.0, cost.copies.offload_seconds(nbytes) - out)
                + max(0.0, cost.copies.reload_seconds(nbytes) - back))

    def _reruns_blocks(self) -> bool:
        """Whether an adaptive micro-batch may release by rerunning whole blocks untraced
        (``Frame.rerun_chosen``): under a budget, profiled, with plain blocks to rerun, and no
        pipeline schedule or compiled region that plans per operator."""
        return (self.options.releases == "reruns" and self._policy.adaptive and self.budget is not None and self.cost.ready
                and self.overlap is None
                and not self.wrapping.regions and bool(self.runtime.rerunnable_blocks()))

    def _calibrates(self) -> bool:
        """Whether this micro-batch may be one that recomputes all it can (``_choose_frame``):
        only where a plan may have to release, an adaptive policy under a budget that the worst
        routing of the profiled micro-batches would not fit."""
        worst = self.footprint.worst_bytes
        if self._reruns_blocks():
            return False  # releases rerun whole blocks, measured as they run: no op replays to measure
        return self._policy.adaptive and self.budget is not None and worst is not None and worst > self.limits.limit()

    def _reserve_arena(self) -> None:
        """Reserve the host arena's room for offloads (``arena_need``) now, between micro-batches:
        an offload that had to reserve it would hold the copies up for as long as pinning takes.
        A user's arena (``arena_bytes``, ``engine``) is left as it is."""
        if self.engine is not None and not self._arena_chosen and self.footprint.worst_bytes is not None:
            reserve_arena(self.engine, arena_need(self.footprint.worst_bytes, self.stacking.deepest(), self.budget,
                                                  self._policy.adaptive, self._policy.offloads))

    def _open(self, frame: Frame, args: tuple, kwargs: dict) -> int:
        """Ready the pieces for ``frame`` and hold it to the budget; returns the bytes of the
        forward's inputs (0 where nothing reads them)."""
        traced = _traces(frame)
        self.limits.framed(traced)
        self.routing.begin()
        self.decisions.begin()
        adaptive = self.budget is not None and self._policy.adaptive
        inputs = input_bytes(args, kwargs) if adaptive or traced else 0
        if adaptive:
            # Leave room for the floor of each micro-batch that stacks on this rank before its
            # next backward (pipeline warm-up), so the last of them still fits, and, in a traced
            # forward, for what recipes will pin that nothing can release (labels the loss reads
            # at the very end): it is charged when pinned. An untraced forward has no recipes and
            # pins nothing: held to the headroom, it would offload for pins that never come.
            limit = self.limits.limit()
            headroom = self.footprint.pin_headroom(inputs, limit, self.limits.margin) if traced else 0
            frame.budget = Budget(limit, self.limits.reserve(), headroom)
        return inputs

    def _run_forward(self, frame: Frame, args: tuple, kwargs: dict) -> Tuple[Any, float, int]:
        """Run the model's forward in ``frame``, this provisioner on the thread's stack (where
        ``on_gating`` finds it); returns its output, its seconds, and the bytes its anchors held
        (read before the frame closes and lets them go)."""
        running = active()
        start = time.perf_counter()
        try:
            running.append(self)
            with self.runtime.frame(frame):
                out = self.wrapping.call(self.runtime, args, kwargs)
                anchored = sum(node.nbytes for node in frame.anchors)
        finally:
            while self in running:  # and above it, what an interrupt left there
                running.pop()
        seconds = time.perf_counter() - start
        self.counters.frames += 1
        if frame.stats.offload_failures:
            self.counters.copies_failed = True
        self.gate_hooks.regions.check_heard()
        return out, seconds, anchored

    def _learn_from(self, frame: Frame, inputs: int, seconds: float, anchored: int) -> None:
        """What the forward just run teaches: an untraced one's seconds (what a rerun costs),
        what a traced one held, a profiled one's costs, the routing's footprint, the worst
        routing once profiled, and an adaptive plan's choices (``last_plan``)."""
        traced = _traces(frame)
        if not traced and not frame.profile and not frame.calibrating:
            self.reruns.observe_forward(seconds)
        counts = self.routing.counts
        if traced:
            stats = frame.stats
            self.footprint.observe_held(stats.leaf_bytes + stats.outside_bytes, stats.outside_bytes, inputs,
                                        stats.traced_pin_bytes)
        if frame.profile:
            self.cost.observe(frame.saved_profile, counts, seconds, frame.unsaved_seconds)
            self.learned.unplanned.profiled(self.model.training)
        elif traced and self.cost.ready:
            self.learned.unplanned.note(frame, self.cost, self.model.training)
        self.footprint.observe_routed(anchored, counts, self.options.min_bytes, self.engine is not None)
        if frame.profile and self.cost.frames >= self.options.profile_frames:
            worst = self.routing.worst(self.gates)
            self.footprint.observe_worst(worst, counts)
            if self.memory is not None:
                self.memory.profiled(worst)
            self._reserve_arena()
        if self._policy.adaptive and traced and not frame.profile and not frame.calibrating:
            self.counters.last_choices = frame.choices  # the frame's, which its forward is done with

    def _record(self, frame: Frame, seconds: float, conservative: bool) -> None:
        """The micro-batch's telemetry record, and the run's first violation told."""
        counts = self.routing.counts
        imbalance = max((max(c) * len(c) / max(1, sum(c)) for c in counts.values()), default=1.0)
        self.telemetry.add(MicroBatch(
            step=self.counters.step, micro_batch=frame.index, peak_bytes=frame.stats.peak_resident,
            predicted_peak_bytes=self.decisions.predicted, budget_bytes=self.budget,
            imbalance=imbalance, bytes_by_choice=dict(frame.stats.bytes_by_choice),
            violations=frame.stats.violations, fallbacks=len(frame.stats.fallbacks),
            forward_seconds=seconds, oom_recovered=conservative, traced=_traces(frame),
            calibrating=frame.calibrating, room_made_bytes=frame.stats.room_made_bytes,
        ))
        if frame.stats.violations and self.counters.first_violation():
            self._tell_violation(frame)

    def _rerun_more(self, frame: Frame, layer: int, values: List[int]) -> None:
        """A gate of a micro-batch that only reruns blocks (``Frame.rerun_chosen``): at its own
        routing, rerun more of the blocks still to begin where those chosen free too little and
        that costs less than offloading, and offload the rest of what it saved so far, as an
        untraced forward's gate does (``make_room``)."""
        self.decisions.predict(frame, values, self.footprint.outside_held)
        counts = self.decisions.counts_at(layer, values)
        blocks = self.runtime.rerunnable_blocks()
        order = self.wrapping.order
        gate = order.get(next((g.name for g in self.gates if g.layer == layer), ""), -1)
        chosen = frozenset(frame.rerun_chosen)
        sizes = self.reruns.sizes([b for b in blocks if b in chosen], counts, self.runtime.block_outputs)
        saves = frame.stats.start_resident + self.footprint.outside_held + self.cost.predict_total(self.cost.order, counts)
        need = saves - sum(n for n, _ in sizes.values()) - self.limits.target()
        # the blocks still to begin: after the gate in the model (its own layer's experts too)
        later = [b for b in blocks if b not in chosen and order.get(b, -1) > gate]
        room = self.limits.target() - frame.stats.start_resident - self.footprint.outside_held
        more = self.reruns.choose(need, later, counts, self.runtime.block_outputs, self._offload_seconds, room,
                                  sorted(chosen))
        frame.rerun_chosen.update(more)
        freed = sum(n for n, _ in self.reruns.sizes(list(more), counts, self.runtime.block_outputs).values())
        if need > freed and self.memory is not None and frame.budget is not None:
            # The rest is offloaded: what was saved before this gate, which the forward no
            # longer reads (the saves still to come are what it will read at its peak).
            to_come = saves - sum(n for n, _ in sizes.values()) - freed - self.runtime.ledger.resident
            self.runtime.residency.make_room(max(0, to_come))

    def _tell_violation(self, frame: Frame) -> None:
        """The first violation under ``on_exceed="record"``, told once: on a device it would have
        been an out-of-memory crash, and a recorded count alone goes unread."""
        warnings.warn(recorded_violation(frame.index, self.budget, frame.stats.peak_resident, frame.stats.violations,
                                         self._policy.name), UserWarning, stacklevel=5)

    def _check_feasible(self) -> None:
        """Refuse a micro-batch no plan can fit, before it allocates anything. With an allocator
        view, what it shows allocated beyond the activations now counts, not the excess it
        predicts at the peak: that is learned, at first from profiled forwards, whose records
        an untraced forward does not hold, and refusing on it would end a run the budget holds
        (the micro-batch releases all it can instead, and its window teaches the excess)."""
        if self.budget is None or not self._policy.adaptive or not self.cost.ready:
            return
        self.footprint.check_feasible(self.budget, self.runtime.ledger.resident, self.runtime.residency.movable_bytes,
                                      f"micro-batch {self.counters.frames}",
                                      self.memory.outside if self.memory is not None else 0)

    def _exceeded(self, resident: int, budget: int, key: str) -> None:
        raise BudgetExceededError(resident, budget, key, self._policy.name)

    # -- gating (each gate's hook: provision/gate_hooks.py) ----------------------------------
    def on_gate(self, layer: int, counts: Union[torch.Tensor, Sequence[int]], size: Optional[int] = None) -> None:
        """A gate routed: MoE layer ``layer``'s tokens per expert (and the micro-batch's size, when
        its gate states it), after routing and before its experts run. What every gate hook and
        ``bagualu2.on_gating`` call; outside a provisioned forward it does nothing."""
        frame = self.runtime.active_frame
        if frame is None:
            return
        values = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
        self.routing.record(layer, values, size)
        if self.memory is not None and self.cost.ready:
            self.limits.routed(self.decisions.counts_at(layer, values), frame.traced)
        if not self._policy.adaptive or self.budget is None or not self.cost.ready:
            return
        if frame.calibrating:
            return  # it releases all it can already
        if frame.rerun_chosen is not None:
            self._rerun_more(frame, layer, values)
            return
        if not frame.traced:  # no recipes to plan from: only its high-water mark is predicted
            first = not self.decisions.predicted
            self.decisions.predict(frame, values, self.footprint.outside_held)
            if first and self.memory is not None and frame.budget is not None and \
                    self.decisions.predicted > frame.budget.target(pins=True):
                # An unannounced spike under a whole-memory budget: the saves that would cross
                # are the forward's last, which it still reads, so offloading them as they come
                # frees nothing at the peak; what it saved before the gate is no longer read.
                self.runtime.residency.make_room(self.decisions.predicted - self.runtime.ledger.resident)
            return
        start = time.perf_counter()
        decision = self.decisions.decide(frame, layer, values, self.limits.target(), self.limits.limit(), self.counters.step,
                                         self.engine is not None)
        decision.latency_us = (time.perf_counter() - start) * 1e6
        self.telemetry.add(decision)
