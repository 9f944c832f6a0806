"""The activation runtime follows overlap schedules (bagualu2.integrations.pipeline.overlap_driver).

One process, two micro-batches of the reference MoE model: A's forward, then B's forward
while A's offloaded activations are reloaded at the points a schedule names, then A's
backward, then B's. The CopyEngine's issue trace shows where each reload entered its stream
relative to B's own offloads (one per forward op); losses and gradients must be bitwise those
of plain PyTorch running the same sequence.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.offload import CopyEngine, HostArena
from bagualu2.integrations.pipeline.overlap_driver import OverlapDriver
from bagualu2.plan.overlap import Schedule, TaskKind
from bagualu2.plan.planner import Choice

SEEDS = (11, 12)  # dropout seeds of micro-batches A and B


def make_model(**cfg) -> Tuple[MoETransformer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(dropout=0.1, **cfg))
    a = torch.randint(0, model.cfg.vocab_size, (4, 32))
    b = torch.randint(0, model.cfg.vocab_size, (4, 32))
    return model, a, b


def plain_run(model, a, b) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Forward A, forward B, backward A, backward B, without bagualu2."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEEDS[0])
    la = model(a).float().pow(2).mean()
    torch.manual_seed(SEEDS[1])
    lb = model(b).float().pow(2).mean()
    la.backward()
    lb.backward()
    return [la.detach(), lb.detach()], [p.grad.clone() for p in model.parameters()]


class Run:
    """The same sequence through an ActivationRuntime and an OverlapDriver."""

    def __init__(self, model: MoETransformer, choice: Choice, bubble_s: float = 0.0) -> None:
        self.model = model
        self.engine = CopyEngine(HostArena(64 << 20))
        self.runtime = ActivationRuntime(self.engine, reload_in_place=False)  # reloads copy, as on a device
        self.runtime.residency.set_parameters(list(model.parameters()) + list(model.buffers()))
        self.hooks = self.runtime.attach(model)
        self.driver = OverlapDriver(self.runtime, min_bubble_s=0.0)
        self.choice = choice
        self.bubble_s = bubble_s

    def forward(self, tokens: torch.Tensor, seed: int) -> Tuple[torch.Tensor, Frame]:
        frame = Frame(default=self.choice)
        torch.manual_seed(seed)
        with self.runtime.frame(frame):
            loss = self.model(tokens).float().pow(2).mean()
        return loss, frame

    def run(self, a, b, schedule_of=None):
        """``schedule_of(problem)`` gives the schedule to follow (None: the DP's)."""
        self.model.zero_grad(set_to_none=True)
        la, fa = self.forward(a, SEEDS[0])
        problem = self.driver.problem(fa, self.bubble_s)
        schedule = schedule_of(problem) if schedule_of is not None else None
        schedule = self.driver.pair(fa, schedule, bubble_s=self.bubble_s)
        self.engine.start_trace()
        lb, fb = self.forward(b, SEEDS[1])
        # Before forward_end: it starts the early recomputes, whose charges the ledger then
        # grows by while the worker runs.
        self.observed = self.snapshot(fa)
        self.driver.forward_end()
        self.driver.backward_begin()
        la.backward()
        self.driver.backward_end()
        self.engine.stop_trace()
        self.b_offloads = [(st.key, st.handle.host_ptr) for st in fb.offload_stores()]
        lb.backward()
        self.frames = (fa, fb)
        self.problem, self.schedule = problem, schedule
        return [la.detach(), lb.detach()], [p.grad.clone() for p in self.model.parameters()]

    def snapshot(self, frame: Frame) -> Dict[str, int]:
        return {"resident": self.runtime.ledger.resident}

    def close(self) -> None:
        self.driver.close()
        for h in self.hooks:
            h.remove()


def assert_bitwise(x, y) -> None:
    for i, (p, q) in enumerate(zip(x[0], y[0])):
        assert torch.equal(p, q), f"loss {i} differs"
    for i, (p, q) in enumerate(zip(x[1], y[1])):
        assert torch.equal(p, q), f"gradient {i} differs by {(p - q).abs().max().item()}"


def spread(problem, pick) -> Schedule:
    """A valid schedule whose reload k (in consumer order) is issued after op ``pick(k, task)``
    clamped to its window and made non-decreasing."""
    issue = [t.op if t.kind == TaskKind.OFFLOAD else t.op - 1 for t in problem.tasks]
    order = sorted((j for j, t in enumerate(problem.tasks) if t.kind == TaskKind.RELOAD),
                   key=lambda j: (problem.tasks[j].op, j))
    last = -1
    for k, j in enumerate(order):
        t = problem.tasks[j]
        s = min(max(pick(k, t), t.earliest, last), t.op - 1)
        issue[j] = last = s
    return Schedule(tuple(issue), tuple(False for _ in issue), True, 0.0, 0)


def trace_positions(run: Run) -> Tuple[Dict[int, int], Dict[int, List[int]], List[int]]:
    """Trace index of B's offload of its i-th saved key; trace indices of each reload task's
    stores; the reloaded host blocks in trace order."""
    trace = run.engine.trace()
    d2h: Dict[int, int] = {}
    h2d: Dict[int, int] = {}  # a storage saved as several views is reloaded per unpack: first one
    for i, e in enumerate(trace):
        (d2h if e["direction"] == "d2h" else h2d).setdefault(e["host_ptr"], i)
    index = {k: i for i, k in enumerate(run.frames[1].keys_seen)}  # B's forward order
    offload_at = {index[key]: d2h[ptr] for key, ptr in run.b_offloads if ptr in d2h}
    reload_at = {j: [h2d.get(st.handle.host_ptr, -1) for st in run.problem.targets[j]]
                 for j, t in enumerate(run.problem.tasks) if t.kind == TaskKind.RELOAD}
    return offload_at, reload_at, sorted(h2d, key=h2d.get)


def expected_reload_blocks(run: Run) -> List[int]:
    tasks = run.problem.tasks
    return [st.handle.host_ptr for j in run.schedule.issue_order(tasks) if tasks[j].kind == TaskKind.RELOAD
            for st in run.problem.targets[j]]


@pytest.fixture(scope="module")
def reference():
    model, a, b = make_model()
    return plain_run(model, a, b)


PICKS = {
    "all_before_forward": lambda k, t: -1,
    "one_per_forward_op": lambda k, t: k,
    "every_third_op": lambda k, t: 3 * k,
    "lazy": lambda k, t: t.op - 1,
}


@pytest.mark.parametrize("pick", sorted(PICKS))
def test_reloads_enter_the_engine_at_the_scheduled_forward_points(reference, pick):
    model, a, b = make_model()
    run = Run(model, Choice.OFFLOAD)
    try:
        out = run.run(a, b, lambda p: spread(p, PICKS[pick]))
        fa, fb = run.frames
        assert_bitwise(out, reference)
        offload_at, reload_at, blocks = trace_positions(run)
        tasks, issue, problem = run.problem.tasks, run.schedule.issue_after, run.problem
        reloads = [j for j, t in enumerate(tasks) if t.kind == TaskKind.RELOAD]
        assert len(reloads) >= 8 and len(offload_at) >= 20
        assert all(p >= 0 for j in reloads for p in reload_at[j]), "every reload went through the engine"
        # Order: the engine saw A's stores reloaded in the schedule's issue order.
        assert blocks == expected_reload_blocks(run)
        # Points: a reload issued after forward op s enters the engine after B's offloads of the
        # keys op s ends with, and before B's offloads of later keys.
        n_forward = len(problem.segment_end)
        for j in reloads:
            s = issue[j]
            last_key = -1 if s < 0 else (problem.segment_end[s] if s < n_forward else 1 << 30)
            for key_index, pos in offload_at.items():
                for p in reload_at[j]:
                    if key_index <= last_key:
                        assert p > pos, f"reload {j} (after op {s}) came before B's offload of key {key_index}"
                    else:
                        assert p < pos, f"reload {j} (after op {s}) came after B's offload of key {key_index}"
        assert run.runtime.ledger.resident == 0
        del out, fa, fb, problem
        run.frames = None
        run.problem = None
        assert run.engine.arena.stats()["in_use"] == 0
    finally:
        run.close()


def test_dp_schedule_is_followed_and_exact(reference):
    model, a, b = make_model()
    run = Run(model, Choice.OFFLOAD, bubble_s=0.002)
    try:
        out = run.run(a, b)
        assert_bitwise(out, reference)
        assert run.schedule.feasible
        _, _, blocks = trace_positions(run)
        expected = expected_reload_blocks(run)
        assert blocks == expected
        issued = sum(run.driver.stats[k] for k in ("reloads_forward", "reloads_bubble", "reloads_backward"))
        assert issued == len(expected) and run.driver.stats["reloads_deferred"] == 0
        assert run.driver.stats["pairs"] == 1
    finally:
        run.close()


@pytest.fixture(params=["default_threads", "one_thread"])
def intra_op_threads(request):
    """The caller's intra-op thread count: pipeline ranks run with 1 and the early-recompute
    worker must compute with the caller's count (the multi-process recompute_all+overlap
    exactness test in test_pipeline.py is the one that showed the difference)."""
    before = torch.get_num_threads()
    if request.param == "one_thread":
        torch.set_num_threads(1)
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def test_early_recomputes_run_in_the_bubble_and_are_charged_until_backward_ends(intra_op_threads):
    model, a, b = make_model(expert_hidden_size=128)
    reference = plain_run(model, a, b)
    run = Run(model, Choice.RECOMPUTE, bubble_s=0.01)
    early_nodes: List = []

    def all_early(problem):
        assert problem.bubble is not None
        issue, flags = [], []
        for j, t in enumerate(problem.tasks):
            if t.kind == TaskKind.RECOMPUTE:
                issue.append(problem.bubble - 1)
                flags.append(True)
                early_nodes.extend(problem.targets[j])
            else:
                issue.append(t.op if t.kind == TaskKind.OFFLOAD else t.op - 1)
                flags.append(False)
        return Schedule(tuple(issue), tuple(flags), True, 0.0, 0)

    resident: Dict[str, int] = {}
    begin = run.driver.backward_begin

    def observe_begin() -> None:
        begin()
        resident["after_join"] = run.runtime.ledger.resident
        # rebuilt into the recompute cache, or held anyway (block inputs anchored for recipes)
        resident["ready"] = sum(node.cache.get(node.position, state) is not None
                                or (node.anchor is not None and node.anchor[1] == state)
                                for node, state in early_nodes)
        # what the recompute cache holds: the targets and the unsaved inputs rebuilt for them
        resident["cached"] = early_nodes[0][0].cache.nbytes

    run.driver.backward_begin = observe_begin
    try:
        out = run.run(a, b, all_early)
        assert_bitwise(out, reference)
        assert len(early_nodes) >= 5
        assert run.driver.stats["early_recomputes"] == len(early_nodes)
        assert run.driver.stats["worker_errors"] == 0
        assert resident["ready"] == len(early_nodes), "early recomputes are ready when backward starts"
        rebuilt = {id(node): node.nbytes for node, state in early_nodes
                   if not (node.anchor is not None and node.anchor[1] == state)}
        assert resident["cached"] >= sum(rebuilt.values())
        assert resident["after_join"] == run.observed["resident"] + resident["cached"], \
            "each storage the early recomputes rebuilt (and the cache holds) is charged to the ledger once"
        early_nodes.clear()  # the test's own references to A's recipes (and their anchors)
        run.problem = run.frames = None
        assert run.runtime.ledger.resident == 0
    finally:
        run.close()


def test_a_schedule_for_another_pair_is_refused():
    model, a, b = make_model()
    run = Run(model, Choice.OFFLOAD)
    try:
        _, fa = run.forward(a, SEEDS[0])
        with pytest.raises(ValueError, match="places 1 tasks"):
            run.driver.pair(fa, Schedule((0,), (False,), True, 0.0, 0))
    finally:
        run.close()


def test_an_untraced_frame_pairs_with_nothing_to_schedule_and_stays_exact() -> None:
    """A calm (untraced) backward frame has no operator keys: its pair schedules nothing, and
    what it offloaded past the budget reloads at unpack."""
    model, a, b = make_model()
    ref = plain_run(model, a, b)
    run = Run(model, Choice.KEEP)
    run.runtime.residency.budget_bytes = 0  # every save of an untraced frame crosses it: all offloaded

    def forward(tokens: torch.Tensor, seed: int) -> Tuple[torch.Tensor, Frame]:
        frame = Frame()
        frame.traced = False
        torch.manual_seed(seed)
        with run.runtime.frame(frame):
            loss = run.model(tokens).float().pow(2).mean()
        return loss, frame

    run.forward = forward
    assert_bitwise(run.run(a, b), ref)
    assert run.frames[0].stats.bytes_by_choice["keep"] == 0 < run.frames[0].stats.bytes_by_choice["offload"]
    assert run.driver.stats["pairs"] == 1 and run.driver.stats["reloads_forward"] == 0
    run.close()


def test_the_schedule_is_followed_while_other_subscribers_listen_to_the_same_events(reference):
    """The driver's events are subscriber lists: a second party listening to frame starts,
    first saves and released unpacks (subscribed after the driver, which a single callback slot
    would have handed to the last writer) hears every one of them, and the driver still issues
    each reload at its scheduled forward point. Closing the driver removes only its own
    subscriptions."""
    model, a, b = make_model()
    run = Run(model, Choice.OFFLOAD)
    frames: List[Frame] = []
    saved: Dict[int, List[str]] = {}
    unpacked: List[str] = []

    def on_frame(frame: Frame) -> None:
        frames.append(frame)
        saved[len(frames) - 1] = []
        frame.on_saved.subscribe(saved[len(frames) - 1].append)

    heard = run.runtime.on_frame_start.subscribe(on_frame)
    run.runtime.residency.on_released_unpack.subscribe(unpacked.append)
    try:
        out = run.run(a, b, lambda p: spread(p, PICKS["one_per_forward_op"]))
        assert_bitwise(out, reference)
        fa, fb = run.frames
        assert frames == [fa, fb]
        assert saved == {0: list(fa.keys_seen), 1: list(fb.keys_seen)} and saved[1]
        assert {st.key for st in fa.offload_stores() + fb.offload_stores()} == set(unpacked)
        _, _, blocks = trace_positions(run)
        assert blocks == expected_reload_blocks(run)
        assert run.driver.stats["reloads_forward"] > 0
    finally:
        run.close()
    assert heard.active and len(run.runtime.on_frame_start.subscribers) == 1
    assert len(run.runtime.residency.on_released_unpack.subscribers) == 1  # the driver's went with its pair
    run.forward(a, SEEDS[0])
    assert len(frames) == 3
