"""What recomputing costs in backward: the rebuilds a plan makes and what each one takes.

Predicts: the backward seconds of recomputing one key alone (``recompute_seconds``, what the
planner adds up) and of recomputing a set of keys together (``rebuild_seconds``: one op call
rebuilt once for all its outputs, a shared unsaved input once).

From: the runtime's timings in backward. ``observe_op_replays``: what each op call's replays
took, inside a chain (from the previous call's end) and apart as a rebuild's first call (from
its own start, the walk down to it being part of entering the rebuild); a call's time in a
chain prices it where it has one, its time as a first otherwise, and until it has been replayed
its profiled forward time (``MemoryModel``) scaled by the median ratio of replay to profiled
time over the calls replayed so far (a profiled forward's op times and backward's replays of
the same ops disagree from run to run: ``benchmarks/cost_model_accuracy.py`` shows it).
``observe_replays``: what each rebuild took, against what it replays: ``seconds =
replay_fixed_s * ops + replay_entry_s + replay_factor * the ops' replay seconds``, plus
``replay_frame_s`` in a micro-batch's first rebuild (``CostFit``, with priors: the constants
below say why), forgetting per rebuild size (ops to a power of two) so that the one-op
rebuilds of budget plans do not erase the few large ones that tell the parts apart. On top of
that shared fit, each key that enters a rebuild learns its own correction per rebuild size
(``replay_ratio``): ops with similar profiled times can cost very different amounts to replay.
The provisioner's first micro-batches that may need a plan recompute everything they can (and
with ``recalibrate_every`` one in that many after them), so that every op a plan can release is
measured before a plan relies on it.

A plan's recomputed keys fall into rebuilds: each key backward meets first (no other recomputed
key reads it) enters one, and rebuilds inside it the recomputed keys and unsaved storages it
reads. A rebuild that replayed an op call again (backward could not keep what it made under the
budget until read) is not learned from: the model prices one replay per op.

Known error: ``benchmarks/cost_model_accuracy.py`` prints each plan's predicted rebuild seconds
beside what the runtime measured rebuilding, and the predicted overhead beside the measured
step delta with its 95% interval.
"""

from __future__ import annotations

import statistics
from typing import Dict, FrozenSet, Iterable, List, Mapping, Sequence, Tuple

from bagualu2.shared import OpReplayTimes, ReplayTimes
from bagualu2.plan.cost_model.fit import CostFit, LineFit
from bagualu2.plan.cost_model.memory import MemoryModel, OpCost, driving_tokens

# A rebuild runs the ops it replays: its time per second of their replay time is taken to be 1,
# give or take this, until the observed rebuilds tell otherwise (``CostFit.prior_sd``). Their
# replay times are backward's own measurements of them (in a chain: what a rebuild's first op
# costs beyond that is the per-rebuild part's), so the factor has little left to explain and
# what it learns from one plan's rebuilds says nothing of another's ops ...
REPLAY_FACTOR_SD = 0.02
# ... and never below this (``CostFit.floor``): a rebuild's time holds its ops' replays, whose
# times are measurements of the same ops, noisy but not by half. The rebuilds of cheap ops alone
# leave the factor free to trade against the per-op and per-rebuild parts, which then fits it far
# below 1 and underprices every plan that recomputes expensive ops.
REPLAY_FACTOR_FLOOR = 0.5
# The part of a rebuild's time paid once per micro-batch (landing in backward's first rebuild)
# is taken to be 0 give or take this, until rebuilds tell it apart from the per-op and
# per-rebuild parts (``CostFit.zero_sd``). Recomputing everything, the first rebuild replays
# nearly every op, and only the plans' small first rebuilds tell the parts apart: from
# calibrations alone, the fit puts what all the ops cost beyond their replay times on every plan
# that rebuilds anything. The prior keeps it near what the plans that tell it apart measure.
REPLAY_FRAME_SD = 200e-6
# A rebuild measured more than this many times the median of the same key's last rebuilds of
# its size counts as that much (``observe_replays``): a preempted thread, a collection pause
# makes a rebuild take many times its usual time once, and the least-squares fit would take it
# in full.
OUTLIER_RATIO = 4.0
# A key's correction of the shared fit for rebuilds of one size (``replay_ratio``) holds once
# it has measured this many of them: one rebuild, measured in a calibration that recomputed
# every other key, can set a correction far from what its next rebuilds measure.
CORRECTION_SAMPLES = 3


class RebuildModel:
    """Rebuilds and their seconds, over the keys of ``memory`` (``MemoryModel``)."""

    def __init__(self, memory: MemoryModel) -> None:
        # The memory model's tables (filled by its ``observe``; never rebound).
        self.ops = memory.ops
        self.unsaved = memory.unsaved
        # Per rebuild: first of its micro-batch, replayed ops, 1, the ops' replay seconds ->
        # its seconds. A plan's recompute cost is a sum over its rebuilds, where the large ones
        # weigh most; each key's replay_ratio corrects the small ones.
        self.fit = CostFit(4, relative=False, prior_sd=REPLAY_FACTOR_SD, floor=REPLAY_FACTOR_FLOOR,
                           zero_sd={0: REPLAY_FRAME_SD})
        self._replay_version = 0
        # op call -> its replay's seconds in backward, timed by the runtime's replays
        self._op_replays: Dict[str, LineFit] = {}
        self._lead_replays: Dict[str, LineFit] = {}  # ... as a rebuild's first call (timed apart)
        self._replay_scale = (-1, 1.0)  # (len(_op_replays) it was taken at, the scale)
        self._first_only: set = set()  # ("chain" or "lead", call) of fits holding only cold first replays
        self._cold_calls: set = set()  # calls first replayed in the last observe_op_replays
        self._call_replays: Dict[str, int] = {}  # ... and each call's replays there

    def observe_op_replays(self, times: Mapping[str, OpReplayTimes],
                           counts: Mapping[int, Sequence[int]]) -> None:
        """Learn what replaying each op costs in backward: ``times`` maps a key (of a saved or
        unsaved storage) to an ``OpReplayTimes`` (seconds, n, replays, lead seconds, leads):
        what its op call's ``n`` replays inside a chain took, of ``replays`` in all, and what
        its ``leads`` replays as a rebuild's first call took (``ActivationRuntime.take_op_replay_times``).
        A call's first replays in either role run cold (the first allocations of their
        outputs in backward: on the cpu, up to 1.8x the next ones): the next observation
        replaces them, and the rebuilds a call's very first replays were part of are not
        learned from (``observe_replays`` after this call); nor are those that replayed a call
        more often than there were micro-batches."""
        self._cold_calls = set()
        self._call_replays = {}
        for key, (seconds, n, replays, lead_seconds, leads) in times.items():
            op = self.ops.get(key) or self.unsaved.get(key)
            if op is None:
                continue
            call = op.call
            self._call_replays[call] = self._call_replays.get(call, 0) + replays
            if call not in self._op_replays and call not in self._lead_replays and n + leads > 0:
                self._cold_calls.add(call)
            for role, fits, spent, timed in (("chain", self._op_replays, seconds, n),
                                             ("lead", self._lead_replays, lead_seconds, leads)):
                if timed <= 0:
                    continue
                fit = fits.get(call)
                if fit is None:
                    fit = fits[call] = LineFit(robust=True)
                    self._first_only.add((role, call))
                elif (role, call) in self._first_only and call not in self._cold_calls:
                    fit.clear()  # its first replays ran cold: the next replace them
                    self._first_only.discard((role, call))
                fit.add(driving_tokens(op, counts), spent / timed)

    def observe_replays(self, replays: Mapping[str, ReplayTimes],
                        counts: Mapping[int, Sequence[int]]) -> None:
        """Learn what recomputing costs in backward: ``replays`` maps a key to (seconds, n), a
        ``ReplayTimes``: what its rebuilds in ``n`` micro-batches took (``ActivationRuntime.take_replay_times``).

        Each rebuild the plan enters (``rebuilds``) is one observation: what its members
        measured per micro-batch, against what it replays, among the rebuilds of its size
        (its ops to a power of two: the fit forgets per size). Four parameters for all ops:
        ``seconds = replay_fixed_s * replayed ops + replay_entry_s + replay_factor * the ops'
        replay seconds``, plus ``replay_frame_s`` in the first rebuild of a micro-batch's
        backward (where the per-micro-batch work lands) (``CostFit``). Rebuilds differ in
        size, so the parts are told apart where plan totals alone confuse them (a plan's
        rebuilds, replayed ops and their seconds grow together). A shared unsaved input is
        charged to the rebuild ``rebuilds`` expects to make it; which one really does depends
        on the order backward unpacks, and each key's ``replay_ratio`` absorbs what stays
        systematic."""
        cold, self._cold_calls = self._cold_calls, set()
        call_replays, self._call_replays = self._call_replays, {}
        known = {k: v for k, v in replays.items() if k in self.ops and v[1] > 0}
        if not known:
            return
        # Where backward could not keep what it rebuilt under the budget, it rebuilt it again
        # (a call replayed more often than there were micro-batches): the rebuilds that
        # replayed such a call are not the ones priced here (each op once), and teach nothing
        # of them: under a tight budget one rebuilt storage that finds no room to be kept for
        # its next reader makes every later reader replay its chain again.
        micro_batches = max(n for _, n in known.values())
        skip = cold | {call for call, n in call_replays.items() if n > micro_batches}
        rows, sizes = [], []  # sizes: the rebuilds' size classes (ops, to a power of two)
        found = self.rebuilds(known, counts)
        for i, (entry, members, n_ops, seconds) in enumerate(found):
            measured = sum(known[k][0] / known[k][1] for k in members)
            if measured <= 0 or (skip and self._replays_any(members, skip)):
                continue
            first = 1.0 if i == 0 else 0.0
            samples = self.ops[entry].replays
            alike = [m for m, f, n, _ in samples if n == n_ops and f == first]
            if len(alike) >= 3:
                measured = min(measured, OUTLIER_RATIO * statistics.median(alike))
            rows.append(((first, float(n_ops), 1.0, seconds), measured))
            sizes.append(n_ops.bit_length())
            samples.append((measured, first, n_ops, seconds))
            if len(samples) > 16:
                del samples[0]
        self.fit.add(rows, sizes)
        self._replay_version += 1

    def _replays_any(self, members: Iterable[str], calls: set) -> bool:
        """Whether rebuilding ``members`` replays any of ``calls`` (their own or an unsaved
        input's)."""
        for key in members:
            op = self.ops[key]
            if op.call in calls or any(u in self.unsaved and self.unsaved[u].call in calls for u in op.unsaved_inputs):
                return True
        return False

    def rebuilds(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> List[Tuple[str, List[str], int, float]]:
        """The rebuilds backward enters to recompute ``keys`` together, latest key first:
        (the key that enters it, the recomputed keys it rebuilds, the ops it replays, their
        replay seconds, ``op_replay_seconds``). A rebuild replays its key's own op, the
        recomputed keys that op reads (and so on), and each unsaved storage any of those
        needs, unless an earlier rebuild ran its op (a rebuilt storage, and every other output
        of its op call, is cached for the rest of the backward pass)."""
        known = sorted((k for k in dict.fromkeys(keys) if k in self.ops), key=lambda k: -self.ops[k].position)
        wanted = set(known)
        read = {k for key in known for k in self.ops[key].saved_inputs if k in wanted}
        claimed: set = set()
        made: set = set()
        out = []
        for entry in known:
            if entry in read:
                continue
            members: List[str] = []
            stack = [entry]
            while stack:
                key = stack.pop()
                if key in claimed:
                    continue
                claimed.add(key)
                members.append(key)
                stack.extend(k for k in self.ops[key].saved_inputs if k in wanted)
            out.append((entry, members, *self._replayed(members, counts, made)))
        # Keys that read each other (an in-place write reading a later storage) have no key
        # that enters their rebuild first: each is counted as met on its own.
        for key in known:
            if key not in claimed:
                claimed.add(key)
                out.append((key, [key], *self._replayed([key], counts, made)))
        return out

    def _replayed(self, members: Iterable[str], counts: Mapping[int, Sequence[int]], made: set) -> Tuple[int, float]:
        """Ops and replay seconds of rebuilding ``members``: the op call of each, and of each
        unsaved storage they need, that is not in ``made`` (run earlier; added to it). One call
        makes all its outputs: a key whose sibling output was rebuilt is found made."""
        ops = 0
        seconds = 0.0
        for key in members:
            op = self.ops[key]
            if op.call in made:
                continue
            made.add(op.call)
            ops += 1
            seconds += self.op_replay_seconds(op, counts)
            for name in op.unsaved_inputs:
                unsaved = self.unsaved.get(name)
                if unsaved is not None and unsaved.call not in made:
                    made.add(unsaved.call)
                    ops += 1
                    seconds += self.op_replay_seconds(unsaved, counts)
        return ops, seconds

    def op_replay_seconds(self, op: OpCost, counts: Mapping[int, Sequence[int]]) -> float:
        """Seconds one replay of ``op``'s call costs in backward: as measured in replays inside
        a chain (``observe_op_replays``); for a call only ever replayed first in its rebuild,
        as measured there; until it has been replayed, its profiled forward time scaled as the
        ops replayed so far measured against theirs (the median ratio)."""
        tokens = driving_tokens(op, counts)
        fit = self._op_replays.get(op.call) or self._lead_replays.get(op.call)
        if fit is not None:
            return fit(tokens)
        return self._profiled_scale() * op.seconds(tokens)

    @property
    def replayed_calls(self) -> FrozenSet[str]:
        """The op calls whose replays inside a chain have been measured (``observe_op_replays``):
        their ``op_replay_seconds`` is what was measured, not a profiled time scaled."""
        return frozenset(self._op_replays)

    def _profiled_scale(self) -> float:
        if self._replay_scale[0] != len(self._op_replays):
            ratios = []
            for op in list(self.ops.values()) + list(self.unsaved.values()):
                fit = self._op_replays.get(op.call)
                if fit is not None and fit.samples:
                    tokens = fit.samples[-1][0]
                    profiled = op.seconds(tokens)
                    if profiled > 0:
                        ratios.append(fit(tokens) / profiled)
            self._replay_scale = (len(self._op_replays), statistics.median(ratios) if ratios else 1.0)
        return self._replay_scale[1]

    def rebuild_profile(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> Tuple[int, int, float]:
        """What rebuilding ``keys`` together replays: the number of ops, the number of rebuilds
        backward enters (``rebuilds``) and the ops' replay seconds."""
        found = self.rebuilds(keys, counts)
        return sum(r[2] for r in found), len(found), sum(r[3] for r in found)

    def recompute_seconds(self, key: str, counts: Mapping[int, Sequence[int]]) -> float:
        """Predicted backward cost of recomputing ``key`` alone: the learned ``replay_entry_s``
        for entering its rebuild, ``replay_fixed_s`` per op it replays (unsaved inputs
        included), plus their replay seconds times the learned ``replay_factor``. The planner
        adds these up; a plan that recomputes several keys with a common unsaved input pays for
        that input once, and ``replay_frame_s`` once (``plan_seconds``)."""
        if key not in self.ops:
            return 0.0
        # rebuilds((key,), counts) for one key, without the walk (it is called per candidate)
        ops, seconds = self._replayed((key,), counts, set())
        return self.replay_ratio(key, ops) * self._fitted(ops, seconds)

    def rebuild_seconds(self, keys: Iterable[str], counts: Mapping[int, Sequence[int]]) -> float:
        """What rebuilding ``keys`` together costs: the sum over its rebuilds."""
        return sum(self.replay_ratio(entry, ops) * self._fitted(ops, seconds)
                   for entry, _, ops, seconds in self.rebuilds(keys, counts))

    def replay_ratio(self, key: str, ops: int = 1) -> float:
        """How much more (or less) than the shared fit the rebuilds ``key`` entered that
        replayed ``ops`` ops measured: the median ratio over its last 16 (1 until
        ``CORRECTION_SAMPLES`` were measured), less the per-micro-batch part where the rebuild
        came first. Rebuilds of
        other sizes say little of these: which storages a rebuild finds already made depends
        on the plan (a plan recomputing everything rebuilds dozens of keys inside the one
        backward meets first), so a key's correction is learned and applied per size."""
        return self._corrections(key).get(ops, 1.0)

    def _corrections(self, key: str) -> Dict[int, float]:
        """``replay_ratio`` of ``key`` for each number of ops its measured rebuilds replayed."""
        op = self.ops[key]
        if op.correction[0] != self._replay_version:
            frame = self.replay_frame_s
            ratios: Dict[int, List[float]] = {}
            for measured, first, ops, seconds in op.replays:
                fitted = self._fitted(ops, seconds)
                if fitted > 0:
                    ratios.setdefault(ops, []).append(max(0.0, measured - first * frame) / fitted)
            op.correction = (self._replay_version,
                             {ops: min(10.0, max(0.1, statistics.median(r))) for ops, r in ratios.items()
                              if len(r) >= CORRECTION_SAMPLES})
        return op.correction[1]

    def _fitted(self, ops: int, seconds: float) -> float:
        """The shared fit's seconds of one rebuild of ``ops`` ops replaying in ``seconds``."""
        return self.replay_entry_s + ops * self.replay_fixed_s + seconds * self.replay_factor

    @property
    def replay_frame_s(self) -> float:
        """Learned seconds per micro-batch whose backward rebuilds anything."""
        return self.fit.coef[0]

    @property
    def replay_fixed_s(self) -> float:
        """Learned seconds per replayed op (the replay's own work: decoding, caching)."""
        return self.fit.coef[1]

    @property
    def replay_entry_s(self) -> float:
        """Learned seconds per rebuild backward enters (its scopes, its walk of the recipe)."""
        return self.fit.coef[2]

    @property
    def replay_factor(self) -> float:
        """Learned backward rebuild seconds per second of its ops' replay time."""
        return self.fit.coef[3]
