"""The simulation engine: one pipeline, many steps, five activation policies.

How a 12,288-accelerator job becomes cheap to simulate
------------------------------------------------------
1. **Replicas behave alike.** The ``tp * ep * dp`` devices of a pipeline stage run the same
   schedule on the same shapes; expert-parallel ranks wait for each other at every all-to-all,
   so a layer lasts as long as on the most loaded rank, and that rank also holds the most
   activation bytes. The simulator therefore runs *one* pipeline of ``pp`` stages: the most
   loaded rank of each stage (the trace gives the per-layer maximum over EP ranks). World size
   enters only through communication volumes (all-to-all fan-out, data-parallel gradient sync).
2. **Steps share one schedule.** The order of actions and their dependencies are identical in
   every step; only durations and bytes change with the load. Memory, decisions and the event-
   driven timeline are evaluated for a block of steps at once, as numpy vectors over the step
   axis (steps are independent: activation memory is empty between steps).
3. **Layers that behave alike share decisions.** Units of the same kind (all MoE layers, say)
   have the same candidate table; the planner solves each (unit kind, load bucket, phase,
   budget bucket) once, for the bucket's worst case, and every layer, micro-batch, stage and
   step that falls in the same bucket takes that decision.

Policies
--------
``keep_all``        keep every activation; a stage whose peak exceeds device memory is an OOM.
``recompute_all``   keep only unit inputs, recompute everything else in backward.
``static``          AdaPipe-style: one plan per stage and unit, solved offline by the planner
                    for a fixed worst case (every in-flight micro-batch at ``static_imbalance``),
                    no copy/compute overlap; applied whatever the actual load.
``adaptive``        per micro-batch, per unit, after gating: the planner frees exactly what the
                    actual load requires (three-way choice), copies not overlapped.
``adaptive_overlap`` as ``adaptive`` with the overlap scheduler: offloads hide behind the unit's
                    forward, reloads behind its backward (the planner's copy windows).

OOM and restarts: a step whose peak exceeds device memory on any stage crashes the job; it
costs the crashed step, a cold restart (``restart_s``) and re-running every step since the last
checkpoint; the offending batch is skipped on resume (its tokens never count).

What a unit of each kind costs at a given load comes from :mod:`bagualu2.sim.kinds`; the
engine only combines those tables with the schedule and the policies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bagualu2.sim.clusters import ClusterSpec
from bagualu2.sim.kinds import KindTable, build_kind_table
from bagualu2.sim.layout import Layout, stage_static_bytes
from bagualu2.sim.models import ModelSpec
from bagualu2.sim.schedule import Timeline, inflight_depth, slots_until_backward
from bagualu2.sim.traces import LoadTrace

__all__ = ["POLICIES", "PolicyResult", "Simulator", "SimResult", "planner_api"]

POLICIES: Tuple[str, ...] = ("keep_all", "recompute_all", "static", "adaptive", "adaptive_overlap")
PLANNED = ("static", "adaptive", "adaptive_overlap")


def planner_api():  # noqa: ANN201 - returns the module-level names of the runtime planner
    """The runtime's planner classes ``(Planner, Candidate, Choice)``.

    The simulator never re-implements the planner: it uses the one the provisioner solves with.
    """
    from bagualu2.plan.planner import Candidate, Choice, Planner

    return Planner, Candidate, Choice


@dataclass(frozen=True)
class Effect:
    """What a plan does to one unit, linear in the load: ``x(f) = x[0] + x[1] * f``."""

    kept: Tuple[float, float]
    released: Tuple[float, float]
    rec: Tuple[float, float]
    off: Tuple[float, float]
    rel: Tuple[float, float]
    mix: Tuple[int, int, int]  # ops kept, offloaded, recomputed
    feasible: bool = True


@dataclass
class PolicyResult:
    """Outcome of one policy over the trace."""

    policy: str
    step_time: np.ndarray          # seconds per step (attempt), [steps]
    oom: np.ndarray                # bool [steps]
    peak: np.ndarray               # peak device bytes per stage and step, [pp, steps]
    infeasible: np.ndarray         # decisions without a feasible plan, [steps]
    mix: Dict[str, int]            # op choices over all decisions
    timeline: Dict[str, list] = field(default_factory=dict)  # showcase step memory timeline
    summary: Dict[str, float] = field(default_factory=dict)


@dataclass
class SimResult:
    """All policies of one simulation, plus the context to print and plot them."""

    model: str
    cluster: str
    layout: Dict[str, int]
    steps: int
    trace: Dict[str, float]
    device_memory: float
    static_bytes: List[float]
    budget: List[float]
    showcase_step: int
    showcase_stage: int
    policies: Dict[str, PolicyResult]
    wall_s: float = 0.0
    workspace: float = 0.0

    def table(self) -> List[Dict[str, float]]:
        """One row per policy (the numbers printed and written to JSON)."""
        return [dict(policy=p, **r.summary) for p, r in self.policies.items()]


class Simulator:
    """Simulates one model on one cluster and layout under a load trace.

    Args:
        model, cluster, layout: what to simulate (layout is validated against the model).
        checkpoint_interval: steps between checkpoints (what an OOM loses).
        restart_s: cold restart cost; ``None`` takes the cluster's (284 s by default).
        static_imbalance: worst case the static plan is solved for (``None``: the trace max).
        load_quantum: width of a load bucket (decisions are solved once per bucket).
        budget_buckets: budget buckets per unit's full size (likewise).
        calm_imbalance: load that future micro-batches are assumed to bring when the online
            policies reserve room for them (the calm ceiling of the trace).
        measured: optional per-kind override tables (see :mod:`bagualu2.sim.measured`).
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, layout: Layout, *,
                 checkpoint_interval: int = 100, restart_s: Optional[float] = None,
                 static_imbalance: Optional[float] = None, load_quantum: float = 0.05,
                 budget_buckets: int = 32, calm_imbalance: float = 1.2,
                 kind_tables: Optional[Dict[str, KindTable]] = None) -> None:
        layout.validate(model)
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
        self.model, self.cluster, self.layout = model, cluster, layout
        self.checkpoint_interval = checkpoint_interval
        self.restart_s = cluster.restart_s if restart_s is None else float(restart_s)
        self.static_imbalance = static_imbalance
        self.load_quantum = load_quantum
        self.budget_buckets = budget_buckets
        self.calm_imbalance = calm_imbalance
        self.kinds_of_unit = model.unit_kinds()
        self.moe_units = [i for i, k in enumerate(self.kinds_of_unit) if k in ("moe", "mtp")]
        self.kind_names = sorted(set(self.kinds_of_unit))
        self.tables: Dict[str, KindTable] = kind_tables or {
            k: build_kind_table(model, cluster, layout, k) for k in self.kind_names}
        self.pp, self.vpp, self.M = layout.pp, layout.vpp, layout.m
        self.timeline = Timeline(self.pp, self.vpp, self.M)
        self.orders = self.timeline.orders
        self.slots = [slots_until_backward(o) for o in self.orders]
        self.depth = [inflight_depth(o) for o in self.orders]
        self.static = [stage_static_bytes(model, layout, s)["total"] for s in range(self.pp)]
        T = layout.mbs * layout.seq / layout.tp
        self.send_s = cluster.p2p_latency_s + (T * model.hidden * 2) / (
            cluster.inter_bw * cluster.network_efficiency)
        self.dp_s = [self._dp_sync_s(s) for s in range(self.pp)]
        self.flops_per_step = self.M * sum(self.tables[k].flops for k in self.kinds_of_unit)
        self._chunk_units = {(s, c): layout.chunk_units(model, s, c)
                             for s in range(self.pp) for c in range(self.vpp)}
        self._stage_units = {s: layout.stage_units(model, s) for s in range(self.pp)}
        # calm-size weight of each unit among the units after it in its chunk (allowance split)
        # per unit of a chunk: (share of the releasable bytes among it and the later units,
        # calm size of the later units) -- how the online policies split a chunk's excess
        self._calm_full: Dict[Tuple[int, int], List[Tuple[float, float]]] = {}
        for key, units in self._chunk_units.items():
            ts = [self.tables[self.kinds_of_unit[u]] for u in units]
            sizes = [t.full(calm_imbalance) for t in ts]
            rel = [float(t.nb_a.sum() + t.nb_b.sum() * calm_imbalance) for t in ts]
            self._calm_full[key] = [(r / max(sum(rel[j:]), 1e-30), sum(sizes[j + 1:]))
                                    for j, r in enumerate(rel)]
        # budget bucket: 1/budget_buckets of the unit's size at the spike ceiling
        self._bucket_bytes = {k: max(1.0, t.full(2.6) / budget_buckets)
                              for k, t in self.tables.items()}
        big = max(t.full(2.6) for t in self.tables.values())
        self.planner_quantum = max(1, int(big / 4096))

    # -- fixed per-step costs ---------------------------------------------------------------------
    def _dp_sync_s(self, stage: int) -> float:
        """Gradient reduce-scatter + parameter all-gather (bf16) + optimizer pass of a stage."""
        c, lay = self.cluster, self.layout
        st = stage_static_bytes(self.model, lay, stage)
        t = 0.0
        for params, n in ((st["dense_params"], lay.ep * lay.dp), (st["expert_params"], lay.dp)):
            if n > 1:
                t += 2 * 2 * params * (n - 1) / n / (c.inter_bw * c.dp_efficiency)
            t += 32 * params / n / (c.hbm_bw * c.memory_efficiency)  # Adam: read+write 16 B
        return t

    # -- budgets ---------------------------------------------------------------------------------
    def transient_reserve(self, stage: int, max_load: float) -> float:
        """Bytes a backward may re-materialize at once (the largest unit at ``max_load``)."""
        return max(self.tables[self.kinds_of_unit[u]].full(max_load)
                   for u in self._stage_units[stage])

    def budget(self, stage: int, max_load: float) -> float:
        """Activation bytes the planned policies may keep resident on ``stage``."""
        return (self.cluster.device_memory - self.static[stage] - self.cluster.workspace
                - self.transient_reserve(stage, max_load))

    def chunk_full(self, stage: int, chunk: int, f: float) -> float:
        """Saved bytes of one micro-batch of a chunk at uniform load ``f``, all kept."""
        return sum(self.tables[self.kinds_of_unit[u]].full(f)
                   for u in self._chunk_units[(stage, chunk)])

    # -- planner effects ---------------------------------------------------------------------------
    def _effect(self, table: KindTable, choices: Sequence[int], feasible: bool) -> Effect:
        ch = np.asarray(choices)
        r, o, c = ch != 0, ch == 1, ch == 2
        rel_a, rel_b = float(table.nb_a[r].sum()), float(table.nb_b[r].sum())
        return Effect(kept=(table.full_a - rel_a, table.full_b - rel_b), released=(rel_a, rel_b),
                      rec=(float(table.rec_a[c].sum()), float(table.rec_b[c].sum())),
                      off=(float(table.off_a[o].sum()), float(table.off_b[o].sum())),
                      rel=(float(table.rel_a[o].sum()), float(table.rel_b[o].sum())),
                      mix=(int((~r).sum()) + len(table.ops.ops) - len(table.names),
                           int(o.sum()), int(c.sum())),
                      feasible=feasible)

    def _solve(self, planner, table: KindTable, f: float, must: float,  # noqa: ANN001
               overlap: bool) -> Tuple[object, Effect]:
        _, Candidate, Choice = planner_api()
        cands = table.candidates(f, Candidate)
        wf = table.fwd(f) if overlap else 0.0
        wb = table.bwd(f) if overlap else 0.0
        plan = planner.solve(cands, int(math.ceil(must)), wf, wb)
        return plan, self._effect(table, [int(plan.get(n, Choice.KEEP)) for n in table.names],
                                  bool(plan.feasible))

    # -- one policy --------------------------------------------------------------------------------
    def simulate_policy(self, policy: str, load: np.ndarray, *, max_load: float,
                        showcase: int = -1, state: Optional[dict] = None,
                        on_stage: Optional[Callable[[float], None]] = None) -> PolicyResult:
        """Simulate ``policy`` for a block of steps.

        Args:
            load: ``[steps, microbatches, units]`` imbalance per unit (1.0 for non-MoE units).
            max_load: highest load the trace can bring (sizes the transient reserve and the
                static plan's worst case).
            showcase: step index (within the block) whose memory timeline is recorded.
            state: dict carried across blocks (planner, effects, static plans).
            on_stage: called with ``steps / pp`` after each stage (progress reporting).
        """
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        state = {} if state is None else state
        n = load.shape[0]
        fwd: Dict[tuple, np.ndarray] = {}
        bwd: Dict[tuple, np.ndarray] = {}
        peak = np.zeros((self.pp, n))
        infeasible = np.zeros(n)
        mix = state.setdefault("mix", {"keep": 0, "offload": 0, "recompute": 0})
        trace_mem: Dict[str, list] = {}
        overlap = policy == "adaptive_overlap"
        if policy in PLANNED and "planner" not in state:
            Planner, _, _ = planner_api()
            state["planner"] = Planner(quantum_bytes=self.planner_quantum)
            state["effects"] = {}
        for s in range(self.pp):
            budget = self.budget(s, max_load)
            static_plans = self._static_plans(s, max_load, state) if policy == "static" else None
            # Room kept for each micro-batch that will stack on top of this one: what a calm one
            # needs when calm micro-batches fit, else a fair share of the budget.
            calm_chunk = max(self.chunk_full(s, c, self.calm_imbalance) for c in range(self.vpp))
            calm_reserve = min(calm_chunk, budget / self.depth[s])
            resident = np.zeros(n)
            s_peak = np.zeros(n)
            kept_of: Dict[tuple, np.ndarray] = {}
            trans_of: Dict[tuple, np.ndarray] = {}
            mem_line: List[float] = []
            for pos, (is_f, mb, c) in enumerate(self.orders[s]):
                key = (is_f, mb, c, s)
                units = self._chunk_units[(s, c)]
                if not is_f:
                    during = resident + trans_of.pop((mb, c))
                    s_peak = np.maximum(s_peak, during)
                    resident = resident - kept_of.pop((mb, c))
                    if showcase >= 0:  # (during the backward, after it)
                        mem_line.append(float(during[showcase]))
                        mem_line.append(float(resident[showcase]))
                    continue
                ft = np.zeros(n)
                bt = np.zeros(n)
                kept_chunk = np.zeros(n)
                trans = np.zeros(n)
                limit = budget - (self.slots[s][pos] - 1) * calm_reserve
                calm_full = self._calm_full[(s, c)]
                for j, u in enumerate(units):
                    t = self.tables[self.kinds_of_unit[u]]
                    f = load[:, mb, u]
                    ft += t.fwd(f)
                    bt += t.bwd(f)
                    if policy == "keep_all":
                        kept = t.full(f)
                        mix["keep"] += n * len(t.ops.ops)
                    elif policy == "recompute_all":
                        kept = t.fixed_a + t.fixed_b * f
                        bt += t.rec_a.sum() + t.rec_b.sum() * f
                        trans = np.maximum(trans, t.nb_a.sum() + t.nb_b.sum() * f)
                        mix["keep"] += n * (len(t.ops.ops) - len(t.names))
                        mix["recompute"] += n * len(t.names)
                    else:
                        if policy == "static":
                            eff_idx = None
                            effs = [static_plans[u]]
                        else:
                            # the chunk's excess (later units assumed calm) is shared among
                            # this and the later units in proportion to what each can release
                            w_rel, rest = calm_full[j]
                            base = resident + kept_chunk + rest - limit
                            effs, eff_idx = self._decide(state, t, f, base, w_rel, overlap)
                        kept, add_f, add_b, rel, bad = self._apply(effs, eff_idx, t, f, overlap,
                                                                   mix, n)
                        ft += add_f
                        bt += add_b
                        trans = np.maximum(trans, rel)
                        infeasible += bad
                    kept_chunk += kept
                resident = resident + kept_chunk
                s_peak = np.maximum(s_peak, resident)
                kept_of[(mb, c)] = kept_chunk
                trans_of[(mb, c)] = trans
                fwd[key] = ft
                bwd[(False, mb, c, s)] = bt
                if showcase >= 0:
                    mem_line.append(float(resident[showcase]))
            peak[s] = s_peak + self.static[s] + self.cluster.workspace
            if showcase >= 0:
                trace_mem[str(s)] = mem_line
            if on_stage is not None:
                on_stage(n / self.pp)
        dur = {**fwd, **bwd}
        makespan, _ = self.timeline.run(dur, self.send_s)
        step_time = makespan + max(self.dp_s)
        oom = (peak > self.cluster.device_memory).any(axis=0)
        return PolicyResult(policy, step_time, oom, peak, infeasible, dict(mix), trace_mem)

    def _static_plans(self, stage: int, max_load: float, state: dict) -> Dict[int, Effect]:
        """AdaPipe-style plans of one stage: every in-flight micro-batch at the worst case."""
        key = ("static", stage)
        if key in state:
            return state[key]
        worst = self.static_imbalance or max_load
        budget = self.budget(stage, worst)
        share = budget / self.depth[stage]
        plans: Dict[int, Effect] = {}
        for c in range(self.vpp):
            units = self._chunk_units[(stage, c)]
            need = self.chunk_full(stage, c, worst) - share
            # split what the chunk must free in proportion to what each unit can release
            rel = [float(self.tables[self.kinds_of_unit[u]].nb_a.sum()
                         + self.tables[self.kinds_of_unit[u]].nb_b.sum() * worst) for u in units]
            total = sum(rel) or 1.0
            for u, r in zip(units, rel):
                t = self.tables[self.kinds_of_unit[u]]
                must = max(0.0, need) * r / total
                _, eff = self._solve(state["planner"], t, worst, must, overlap=False)
                plans[u] = eff
        state[key] = plans
        return plans

    def _decide(self, state: dict, t: KindTable, f: np.ndarray, base: np.ndarray,
                w_rel: float, overlap: bool):  # noqa: ANN202
        """Plans for the steps where the unit must release bytes, one solve per bucket.

        The unit must free ``(base + full(f)) * w_rel``: ``base`` is resident bytes plus the
        calm size of the chunk's later units minus the limit, ``w_rel`` this unit's share.

        Args:
            f: load per step; base: per step; w_rel: share in [0, 1].

        Returns ``(effects, index)``: ``index[i]`` is -1 (keep everything) or the position in
        ``effects`` of step ``i``'s plan.
        """
        must = (base + t.full(f)) * w_rel
        idx = np.full(must.shape, -1, dtype=np.int64)
        hot = np.flatnonzero(must > 0)
        if hot.size == 0:
            return [], idx
        q = self.load_quantum
        lb = np.ceil(f[hot] / q - 1e-9).astype(np.int64)
        fb = lb * q  # the bucket's largest load: its plan covers every load in it
        must_b = (base[hot] + t.full(fb)) * w_rel
        bq = self._bucket_bytes[t.kind]
        mb_ = np.ceil(must_b / bq).astype(np.int64)
        keys = lb * (1 << 32) + mb_
        uniq, inv = np.unique(keys, return_inverse=True)
        kind_id = self.kind_names.index(t.kind)
        phase = 1 if overlap else 0
        effects: List[Effect] = []
        memo = state["effects"]  # (kind, load bucket, phase, budget bucket) -> Effect
        for k in uniq.tolist():
            lbk, mbk = divmod(int(k), 1 << 32)
            ck = (kind_id, lbk, phase, mbk)
            eff = memo.get(ck)
            if eff is None:
                _, eff = self._solve(state["planner"], t, lbk * q, mbk * bq, overlap)
                memo[ck] = eff
            effects.append(eff)
        idx[hot] = inv.reshape(-1)
        return effects, idx

    def _apply(self, effs: List[Effect], idx: Optional[np.ndarray], t: KindTable, f: np.ndarray,
               overlap: bool, mix: Dict[str, int], n: int):  # noqa: ANN202
        """Kept bytes, extra forward/backward seconds, transient bytes, infeasible flags."""
        nops = len(t.ops.ops)
        if idx is None:  # one effect for every step (static)
            e = effs[0]
            sel = np.zeros(n, dtype=np.int64)
            table = [e]
        else:
            sel = idx
            table = effs
        if not table:
            mix["keep"] += n * nops
            return t.full(f), 0.0, 0.0, 0.0, 0.0
        arr = np.array([[*e.kept, *e.released, *e.rec, *e.off, *e.rel, float(not e.feasible)]
                        for e in table])
        keep_row = np.array([[t.full_a, t.full_b, 0, 0, 0, 0, 0, 0, 0, 0, 0.0]])
        arr = np.vstack([arr, keep_row])  # index -1 -> keep everything
        g = arr[sel]
        kept = g[:, 0] + g[:, 1] * f
        rel = g[:, 2] + g[:, 3] * f
        rec = g[:, 4] + g[:, 5] * f
        off = g[:, 6] + g[:, 7] * f
        rl = g[:, 8] + g[:, 9] * f
        wf = t.fwd(f) if overlap else 0.0
        wb = t.bwd(f) if overlap else 0.0
        add_f = np.maximum(0.0, off - wf)
        add_b = rec + np.maximum(0.0, rl - wb)
        counts = np.bincount(sel + 1, minlength=len(table) + 1)
        mix["keep"] += int(counts[0]) * nops
        for i, e in enumerate(table):
            c = int(counts[i + 1])
            mix["keep"] += c * e.mix[0]
            mix["offload"] += c * e.mix[1]
            mix["recompute"] += c * e.mix[2]
        return kept, add_f, add_b, rel, g[:, 10]

    # -- whole trace -------------------------------------------------------------------------------
    def full_load(self, trace: LoadTrace) -> np.ndarray:
        """``[steps, microbatches, units]`` load with 1.0 on non-MoE units."""
        tr = trace.fit(trace.steps, self.M, len(self.moe_units))
        load = np.ones((tr.steps, self.M, len(self.kinds_of_unit)))
        if self.moe_units:
            load[:, :, self.moe_units] = tr.load
        return load

    def run(self, trace: LoadTrace, policies: Sequence[str] = POLICIES, *, block: int = 1000,
            progress: Optional[Callable[[float], None]] = None) -> SimResult:
        """Simulate every policy over ``trace`` and summarize (see :meth:`summarize`).

        Args:
            trace: load trace (fitted to this layout's micro-batches and MoE units).
            policies: subset of :data:`POLICIES`.
            block: steps evaluated together (memory vs. vector length).
            progress: called with the (fractional) number of steps done, after every stage of
                every block and policy; the calls of one run add up to ``steps * len(policies)``.
        """
        import time

        bad = [p for p in policies if p not in POLICIES]
        if bad:
            raise ValueError(f"unknown policies {bad}; choose from {', '.join(POLICIES)} or 'all'")
        t0 = time.perf_counter()
        load = self.full_load(trace)
        steps = load.shape[0]
        max_load = float(max(load.max(), self.calm_imbalance))
        results: Dict[str, PolicyResult] = {}
        for p in policies:
            state: dict = {}
            parts = []
            for b0 in range(0, steps, block):
                parts.append(self.simulate_policy(p, load[b0:b0 + block], max_load=max_load,
                                                  state=state, on_stage=progress))
            results[p] = PolicyResult(
                p, np.concatenate([x.step_time for x in parts]),
                np.concatenate([x.oom for x in parts]),
                np.concatenate([x.peak for x in parts], axis=1),
                np.concatenate([x.infeasible for x in parts]), parts[-1].mix, {})
        # showcase: the step and stage with the highest peak of the first policy (keep_all when
        # simulated: the spike that crashes it); every policy's memory timeline is recorded there
        first = results[policies[0]]
        showcase = int(np.argmax(first.peak.max(axis=0)))
        peak_stage = int(np.argmax(first.peak[:, showcase]))
        for p in policies:
            one = self.simulate_policy(p, load[showcase:showcase + 1], max_load=max_load,
                                       showcase=0, state={})
            results[p].timeline = one.timeline
        spike_mask = trace.fit(steps, self.M, len(self.moe_units)).spike
        for r in results.values():
            r.summary = self.summarize(r, spike_mask)
        return SimResult(
            model=self.model.name, cluster=self.cluster.name,
            layout=dict(tp=self.layout.tp, pp=self.pp, vpp=self.vpp, ep=self.layout.ep,
                        dp=self.layout.dp, microbatches=self.M, mbs=self.layout.mbs,
                        seq=self.layout.seq, world=self.layout.world),
            steps=steps, trace=trace.fit(steps, self.M, len(self.moe_units)).stats(),
            device_memory=self.cluster.device_memory, static_bytes=list(self.static),
            budget=[self.budget(s, max_load) for s in range(self.pp)],
            showcase_step=showcase, showcase_stage=peak_stage, policies=results,
            wall_s=time.perf_counter() - t0, workspace=self.cluster.workspace)

    def summarize(self, r: PolicyResult, spike: np.ndarray) -> Dict[str, float]:
        """Throughput, MFU and lost time including OOM restarts.

        Restart accounting walks the steps in order: an OOM step costs its own attempt, the
        restart and the re-run of every step since the last checkpoint (whose tokens were
        already counted); its batch is then skipped.
        """
        total = 0.0
        since_ckpt = 0.0
        lost = 0.0
        done = 0
        for i, (t, oom) in enumerate(zip(r.step_time.tolist(), r.oom.tolist())):
            if oom:
                # the crashed attempt, the restart, and re-running every step since the last
                # checkpoint (still not checkpointed afterwards: a second crash loses them again)
                lost_i = t + self.restart_s + since_ckpt
                total += lost_i
                lost += lost_i
            else:
                total += t
                since_ckpt += t
                done += 1
            if (i + 1) % self.checkpoint_interval == 0:
                since_ckpt = 0.0
        peak_flops = self.cluster.peak_flops
        ok = ~r.oom
        calm = ok & ~spike
        calm_t = float(r.step_time[calm].mean()) if calm.any() else float("nan")
        tokens = done * self.layout.global_tokens
        flops = done * self.flops_per_step
        mfu = flops / (self.pp * total * peak_flops) if total > 0 else 0.0
        return {
            "tokens_per_s": tokens / total if total > 0 else 0.0,
            "eflops": mfu * peak_flops * self.layout.world / 1e18,
            "mfu": mfu,
            "calm_mfu": (self.flops_per_step / (self.pp * calm_t * peak_flops)
                         if calm.any() else 0.0),
            "mean_step_s": float(r.step_time[ok].mean()) if ok.any() else float("nan"),
            "calm_step_s": calm_t,
            "oom_count": int(r.oom.sum()),
            "lost_s": lost,
            "total_s": total,
            "peak_gib": float(r.peak.max() / 2**30),
            "infeasible_decisions": int(r.infeasible.sum()),
        }
