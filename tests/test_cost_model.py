"""The cost model's pieces on their own: bytes against routed tokens, what rebuilds and copies
cost as backward measures them, and the fits that learn them (``bagualu2.plan.cost_model``)."""
from __future__ import annotations

import statistics
from typing import Dict, List, Sequence, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

def test_cost_model_copies_on_cpu_are_never_hidden_and_pay_a_fixed_cost() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({}, d2h_bandwidth=1e9, h2d_bandwidth=2e9, copy_fixed_s=(1e-4, 2e-4), copies_overlap=False)
    cost.observe({"a:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    (cand,), _ = cost.candidates(["a:op:0"], {}, min_bytes=0, can_offload=True)
    assert cand.offload_s == pytest.approx(1e-4 + 1e-3) and cand.reload_s == pytest.approx(2e-4 + 5e-4)
    assert cost.windows(1.0, stacked_forwards=3) == (0.0, 0.0)
    overlapping = CostModel({}, copies_overlap=True)
    overlapping.observe({"a:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    assert overlapping.windows(1.0) == (pytest.approx(0.05), pytest.approx(0.1))
    with pytest.raises(ValueError, match="copy_fixed_s"):
        CostModel({}, copy_fixed_s=(-1.0, 0.0))


def test_cost_model_floor_is_what_no_plan_can_release() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({0: "experts"})
    saved = {"small:op:0": (100, 1e-3, True, ()), "anchor:op:0": (4000, 1e-3, True, ()),
             "rng:op:0": (2000, 1e-3, False, ()), "experts.0:mm:0": (800, 1e-3, True, ()),
             "empty:op:0": (0, 1e-3, True, ())}
    cost.observe(saved, {0: [8, 24]}, forward_seconds=0.01)
    keys = list(saved)
    routed = {0: [16, 16]}  # expert 0 gets twice the tokens; the micro-batch is as large
    for can_offload, floor in ((True, 100 + 4000), (False, 100 + 4000 + 2000)):
        cands, cand_floor = cost.candidates(keys, routed, 500, can_offload, fixed=["anchor:op:0"])
        assert cand_floor == floor
        released = {c.key: c.nbytes for c in cands}
        assert released == ({"rng:op:0": 2000, "experts.0:mm:0": 1600} if can_offload else {"experts.0:mm:0": 1600})
        # Without anchors: what no plan releases (small ones too), and what nothing can release
        # (the runtime releases small ones when the budget demands it; without a copy engine,
        # what cannot be recomputed stays).
        soft, hard = cost.floors(keys, routed, 500, can_offload)
        assert soft == cost.candidates(keys, routed, 500, can_offload)[1] == floor - 4000
        assert hard == (0 if can_offload else 2000)


def test_cost_model_sizes_non_expert_operators_by_the_micro_batch_not_by_rounded_loads() -> None:
    from bagualu2.plan.cost_model import SIZE, CostModel

    cost = CostModel({0: "experts"})
    cost.observe({"attn:op:0": (1000, 1e-3, True, ()), "experts.0:mm:0": (100, 1e-3, True, ())},
                 {0: [10, 10]}, forward_seconds=0.01)
    assert cost.predict_bytes("attn:op:0", {0: [20, 20]}) == 2000  # twice the tokens
    rounded = {0: [12, 12], SIZE: [10, 10]}  # planning rounds each load up; the size stays
    assert cost.predict_bytes("attn:op:0", rounded) == 1000
    assert cost.predict_bytes("experts.0:mm:0", rounded) == 120


def test_cost_model_learns_recompute_cost_from_measured_replays() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    cost.observe({"a:op:0": (1000, 1e-3, True, ()), "b:op:0": (1000, 2e-3, True, ())}, {}, forward_seconds=0.01)
    assert cost.recompute_seconds("b:op:0", {}) == pytest.approx(2e-3)  # nothing measured: profiled time
    # Rebuilds that really cost 0.1 ms each plus twice their profiled time. One plan alone
    # cannot tell a fixed cost from a factor: the factor takes it all.
    cost.observe_replays({"a:op:0": (3 * (1e-4 + 2e-3), 3)}, {})  # a, rebuilt in 3 micro-batches
    assert (cost.replay_fixed_s, cost.replay_factor) == (0.0, pytest.approx(2.1))
    assert cost.recompute_seconds("b:op:0", {}) == pytest.approx(4.2e-3)
    # Plans that also rebuild b separate them (exact data: any weighting recovers them).
    cost.observe_replays({"a:op:0": (1e-4 + 2e-3, 1), "b:op:0": (1e-4 + 4e-3, 1)}, {})
    cost.observe_replays({"b:op:0": (2 * (1e-4 + 4e-3), 2)}, {})
    assert cost.replay_fixed_s == pytest.approx(1e-4) and cost.replay_factor == pytest.approx(2.0)
    assert cost.recompute_seconds("b:op:0", {}) == pytest.approx(1e-4 + 4e-3)
    cost.observe_replays({"unknown:op:0": (1.0, 1)}, {})  # keys the model does not know: ignored
    assert cost.replay_factor == pytest.approx(2.0)
    assert cost.replay_frame_s == 0.0


def test_cost_model_prices_an_op_s_replay_as_backward_measured_it() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({0: "experts"})
    profiled = {"a:op:0": (1e-3, ()), "b:op:0": (2e-3, ()), "c:op:0": (4e-3, ("u:op:0",)), "experts.0:op:0": (1e-3, ())}
    cost.observe({k: (1000, s, True, unsaved) for k, (s, unsaved) in profiled.items()}, {0: [10, 10]},
                 forward_seconds=0.01, unsaved={"u:op:0": 5e-4})
    assert cost.recompute_seconds("c:op:0", {0: [10, 10]}) == pytest.approx(4.5e-3)  # nothing replayed: profiled
    # a replayed twice at 3x its profiled time, b once at half of it, the expert's op at two loads
    # after a first, cold replay (which the next replaces); a key the model does not know is ignored.
    cost.observe_op_replays({"a:op:0": (2 * 3e-3, 2, 2, 0.0, 0), "b:op:0": (1e-3, 1, 1, 0.0, 0), "unknown:op:0": (1.0, 1, 1, 0.0, 0)}, {0: [10, 10]})
    cost.observe_op_replays({"experts.0:op:0": (9e-3, 1, 1, 0.0, 0)}, {0: [10, 10]})
    cost.observe_op_replays({"experts.0:op:0": (3e-3, 1, 1, 0.0, 0)}, {0: [10, 10]})
    cost.observe_op_replays({"experts.0:op:0": (5e-3, 1, 1, 0.0, 0)}, {0: [20, 0]})
    counts = {0: [15, 5]}
    assert cost.op_replay_seconds(cost.ops["a:op:0"], counts) == pytest.approx(3e-3)
    assert cost.recompute_seconds("a:op:0", counts) == pytest.approx(3e-3)
    assert cost.recompute_seconds("b:op:0", counts) == pytest.approx(1e-3)
    assert cost.recompute_seconds("experts.0:op:0", counts) == pytest.approx(4e-3)  # 1e-3 + 2e-4 per token
    # c and its unsaved input, never replayed: their profiled times at the median ratio measured
    # against the profiled times of the ops replayed (3, 0.5 and, at its last load, 2.5: 2.5).
    assert cost.recompute_seconds("c:op:0", counts) == pytest.approx(2.5 * 4.5e-3)
    # A rebuild that held an op's first replay is not learned from; the next one is.
    cost.observe_op_replays({"c:op:0": (1e-3, 1, 1, 0.0, 0), "u:op:0": (1e-3, 1, 1, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (1.0, 1)}, counts)
    assert not cost.rebuild.fit.observed
    cost.observe_op_replays({"c:op:0": (1e-3, 1, 1, 0.0, 0), "u:op:0": (1e-3, 1, 1, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (2.2e-3, 1)}, counts)
    assert cost.rebuild.fit.observed and cost.recompute_seconds("c:op:0", counts) == pytest.approx(2.2e-3)
    # Nor one that replayed a call three times for one micro-batch (it rebuilt again to stay
    # under the budget); its op times are still learned ...
    coef = list(cost.rebuild.fit.coef)
    cost.observe_op_replays({"c:op:0": (3e-3, 3, 3, 0.0, 0), "u:op:0": (1e-3, 1, 3, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (9e-3, 1)}, counts)
    assert cost.rebuild.fit.coef == coef and cost.recompute_seconds("c:op:0", counts) == pytest.approx(2.2e-3)
    # ... and a rebuild of the same backward that replayed its calls once is learned from.
    c_last, b_seen = cost.ops["c:op:0"].replays[-1], len(cost.ops["b:op:0"].replays)
    cost.observe_op_replays({"c:op:0": (3e-3, 3, 3, 0.0, 0), "u:op:0": (1e-3, 1, 3, 0.0, 0), "b:op:0": (1e-3, 1, 1, 0.0, 0)}, counts)
    cost.observe_replays({"c:op:0": (9e-3, 1), "b:op:0": (1.2e-3, 1)}, counts)
    assert cost.ops["c:op:0"].replays[-1] is c_last and len(cost.ops["b:op:0"].replays) == b_seen + 1
    assert cost.rebuild.fit.coef != coef


def test_the_per_micro_batch_rebuild_part_stays_near_zero_until_rebuilds_tell_it_apart() -> None:
    """Calibrating micro-batches alone: a first rebuild of 147 ops (30 us each beyond their
    replay time, 10 ms) and two of 3 ops, with noise. Per micro-batch and per op cannot be told
    apart there; without the prior the fit puts about 4 ms of the large rebuild on every
    micro-batch, and prices a plan of one small rebuild at 25x its cost. With it the part stays
    near 0 and the plan is priced right. Where first and later rebuilds of the same size show
    it (0.15 ms), it is learned."""
    from bagualu2.plan.cost_model.fit import CostFit
    from bagualu2.plan.cost_model.rebuild import REPLAY_FACTOR_FLOOR, REPLAY_FACTOR_SD, REPLAY_FRAME_SD

    def fit(zero_sd: Dict[int, float], rows: List[Tuple[Tuple[float, ...], float]]) -> CostFit:
        out = CostFit(4, relative=False, prior_sd=REPLAY_FACTOR_SD, floor=REPLAY_FACTOR_FLOOR, zero_sd=zero_sd)
        for i in range(40):
            noise = (0.9, 1.0, 1.1)[i % 3]
            out.add([(x, y * noise) for x, y in rows], [int(x[1]).bit_length() for x, _ in rows])
        return out

    def cost(frame: float, ops: int, seconds: float) -> float:
        return frame + 30e-6 * ops + 20e-6 + seconds

    calibration = [((1.0, 147.0, 1.0, 10e-3), cost(0.0, 147, 10e-3)),
                   ((0.0, 3.0, 1.0, 0.2e-3), cost(0.0, 3, 0.2e-3)), ((0.0, 3.0, 1.0, 0.25e-3), cost(0.0, 3, 0.25e-3))]
    plan = (1.0, 2.0, 1.0, 0.1e-3)  # a plan's one rebuild, of two ops

    def predict(fitted: CostFit) -> float:
        return sum(c * v for c, v in zip(fitted.coef, plan))

    free, anchored = fit({}, calibration), fit({0: REPLAY_FRAME_SD}, calibration)
    assert free.coef[0] > 1e-3 and predict(free) > 10 * cost(0.0, 2, 0.1e-3)
    assert anchored.coef[0] < 0.2 * REPLAY_FRAME_SD
    assert predict(anchored) == pytest.approx(cost(0.0, 2, 0.1e-3), rel=0.1)
    plans = [((1.0, 2.0, 1.0, 0.1e-3), cost(150e-6, 2, 0.1e-3)), ((0.0, 2.0, 1.0, 0.1e-3), cost(0.0, 2, 0.1e-3)),
             ((0.0, 4.0, 1.0, 0.3e-3), cost(0.0, 4, 0.3e-3))]
    assert fit({0: REPLAY_FRAME_SD}, plans).coef[0] == pytest.approx(150e-6, rel=0.3)


def test_a_call_only_ever_replayed_first_in_its_rebuild_is_priced_as_it_measured_there() -> None:
    """A call every plan so far replayed as its rebuild's first is timed there (apart from the
    walk that enters the rebuild), not priced from its profiled time: on the reference model a
    profiled time scaled as the other replays measured priced one 2.5x what it measured."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    cost.observe({"a:op:0": (1000, 1e-3, True, ()), "b:op:0": (1000, 1e-3, True, ())}, {}, forward_seconds=0.01)
    a, b = cost.ops["a:op:0"], cost.ops["b:op:0"]
    cost.observe_op_replays({"a:op:0": (0.0, 0, 1, 9e-3, 1), "b:op:0": (2e-3, 1, 1, 0.0, 0)}, {})
    assert cost.op_replay_seconds(a, {}) == pytest.approx(9e-3)  # its first, cold replay: all there is
    cost.observe_op_replays({"a:op:0": (0.0, 0, 1, 3e-3, 1), "b:op:0": (2e-3, 1, 1, 0.0, 0)}, {})
    assert cost.op_replay_seconds(a, {}) == pytest.approx(3e-3)  # the next replaced it
    assert cost.op_replay_seconds(b, {}) == pytest.approx(2e-3)
    # Once timed inside a chain, where plans that rebuild more replay it, that time prices it.
    cost.observe_op_replays({"a:op:0": (1e-3, 1, 2, 3e-3, 1)}, {})
    cost.observe_op_replays({"a:op:0": (1.5e-3, 1, 2, 3e-3, 1)}, {})
    assert cost.op_replay_seconds(a, {}) == pytest.approx(1.5e-3)


def test_a_rebuild_far_slower_than_its_last_ones_counts_as_a_bounded_one() -> None:
    """A one-op rebuild that measured 1 to 1.2 ms five times, then 50 ms once (a preempted
    thread): the fit learns it as one of OUTLIER_RATIO times their median, as if it had measured
    that. Before three alike were seen, a rebuild is taken as it measured."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.cost_model.rebuild import OUTLIER_RATIO

    def learned(times: List[float]) -> List[float]:
        cost = CostModel({})
        cost.observe({"a:op:0": (1000, 1e-3, True, ())}, {}, forward_seconds=0.01)
        for seconds in times:
            cost.observe_op_replays({"a:op:0": (0.0, 0, 1, 0.0, 0)}, {})  # untimed: priced as profiled
            cost.observe_replays({"a:op:0": (seconds, 1)}, {})
        return list(cost.rebuild.fit.coef)

    usual = [1e-3, 1.2e-3, 1e-3, 1.1e-3, 1e-3]
    bound = OUTLIER_RATIO * statistics.median(usual)
    assert learned(usual + [50e-3]) == pytest.approx(learned(usual + [bound]))
    assert learned(usual + [0.9 * bound]) != pytest.approx(learned(usual + [bound]))
    assert learned(usual[:2] + [50e-3]) != pytest.approx(learned(usual[:2] + [bound]))


def test_cost_model_learns_a_cost_per_micro_batch_that_rebuilds() -> None:
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    profiled = {"a:op:0": 1e-3, "b:op:0": 2e-3, "c:op:0": 4e-3}
    cost.observe({k: (1000, v, True, ()) for k, v in profiled.items()}, {}, forward_seconds=0.01)
    # Backward pays 0.2 ms once per micro-batch that rebuilds anything, plus 1.5x the ops' time.
    # The 0.2 ms lands in the first rebuild backward enters: the latest key's.
    plans = [("a:op:0",), ("a:op:0", "b:op:0"), ("b:op:0", "c:op:0"), ("a:op:0", "b:op:0", "c:op:0")]
    for frames, keys in enumerate(plans, start=1):
        per_frame = {k: 1.5 * profiled[k] + (2e-4 if k == keys[-1] else 0.0) for k in keys}
        cost.observe_replays({k: (frames * v, frames) for k, v in per_frame.items()}, {})
    assert (cost.replay_frame_s, cost.replay_fixed_s, cost.replay_factor) == (
        pytest.approx(2e-4), pytest.approx(0.0, abs=1e-12), pytest.approx(1.5))
    plan = {"b:op:0": Choice.RECOMPUTE, "c:op:0": Choice.RECOMPUTE, "a:op:0": Choice.KEEP}
    assert cost.plan_seconds(plan, {}) == pytest.approx(2e-4 + 1.5 * 6e-3)  # the per-micro-batch part once
    assert cost.recompute_seconds("c:op:0", {}) == pytest.approx(1.5 * 4e-3)  # a key's own part
    assert cost.plan_seconds({"a:op:0": Choice.KEEP}, {}) == 0.0


def test_cost_model_learns_a_cost_per_rebuild_entered_and_none_for_a_key_rebuilt_inside_another() -> None:
    """RMSNorm's ``x * r`` then ``* weight``: with both recomputed, backward meets the second
    first and rebuilds the first inside it, so the plan enters one rebuild, not two."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    profiled = {"a:op:0": 1e-3, "b:op:0": 2e-3, "c:op:0": 4e-3}
    cost.observe({"a:op:0": (1000, 1e-3, True, (), ()), "b:op:0": (1000, 2e-3, True, (), ("a:op:0",)),
                  "c:op:0": (1000, 4e-3, True, (), ())}, {}, forward_seconds=0.01)
    assert cost.rebuild_profile(["a:op:0", "b:op:0"], {}) == (2, 1, pytest.approx(3e-3))
    assert cost.rebuild_profile(["a:op:0", "c:op:0"], {}) == (2, 2, pytest.approx(5e-3))

    def measured(keys: tuple) -> Dict[str, float]:  # 10 us per op, 200 us per rebuild entered, 1.5x the ops
        own = {k: 1e-5 + 1.5 * profiled[k] for k in keys}
        if "b:op:0" in keys and "a:op:0" in keys:  # b's rebuild makes a; a's unpack finds it made
            own["b:op:0"] += own.pop("a:op:0")
            own["a:op:0"] = 0.0
        return {k: v + (2e-4 if v else 0.0) for k, v in own.items()}

    def truth(keys: tuple) -> float:
        return sum(measured(keys).values())

    for keys in [("a:op:0",), ("a:op:0", "b:op:0"), ("b:op:0",), ("a:op:0", "c:op:0"), ("c:op:0",),
                 ("a:op:0", "b:op:0", "c:op:0")]:
        cost.observe_replays({k: (v, 1) for k, v in measured(keys).items()}, {})
    assert (cost.replay_frame_s, cost.replay_fixed_s, cost.replay_entry_s, cost.replay_factor) == (
        pytest.approx(0.0, abs=1e-12), pytest.approx(1e-5), pytest.approx(2e-4), pytest.approx(1.5))
    both = {"a:op:0": Choice.RECOMPUTE, "b:op:0": Choice.RECOMPUTE, "c:op:0": Choice.KEEP}
    assert cost.plan_seconds(both, {}) == pytest.approx(truth(("a:op:0", "b:op:0")))


def test_cost_model_runs_an_op_call_once_for_all_its_recomputed_outputs() -> None:
    """Attention saves its output and its log-sum-exp, two outputs of one call: recomputing
    both replays the call once (the runtime caches every output of a replayed call)."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    cost.observe({"attn:sdpa:0": (1000, 3e-3, True, (), ()), "attn:sdpa:0.1": (100, 3e-3, True, (), ()),
                  "attn:sdpa:1": (1000, 5e-3, True, (), ()), "o:mm:0": (1000, 1e-3, True, (), ())},
                 {}, forward_seconds=0.01)
    assert cost.rebuild_profile(["attn:sdpa:0", "attn:sdpa:0.1"], {}) == (1, 2, pytest.approx(3e-3))
    # another call of the same op (occurrence 1) is another call
    assert cost.rebuild_profile(["attn:sdpa:0.1", "attn:sdpa:1", "o:mm:0"], {}) == (3, 3, pytest.approx(9e-3))
    assert cost.rebuild_profile(["attn:sdpa:0.1"], {}) == (1, 1, pytest.approx(3e-3))


def test_cost_model_tells_a_cost_per_rebuild_from_a_factor_within_one_plan() -> None:
    """Rebuilds of one plan differ in size, so the same plan observed again and again tells a
    fixed cost per rebuild (40 us) from a factor on the ops' time (1x) and predicts a key it has
    never rebuilt; the plan's total alone would put everything in the factor."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})
    profiled = {"a:op:0": 1e-5, "c:op:0": 9e-5, "d:op:0": 3e-5}
    cost.observe({k: (1000, v, True, (), ()) for k, v in profiled.items()}, {}, forward_seconds=0.01)
    for _ in range(3):
        cost.observe_replays({k: (4e-5 + profiled[k], 1) for k in ("a:op:0", "c:op:0")}, {})
    assert cost.replay_fixed_s + cost.replay_entry_s == pytest.approx(4e-5)
    assert cost.replay_factor == pytest.approx(1.0)
    assert cost.recompute_seconds("d:op:0", {}) == pytest.approx(7e-5)


def test_replay_fit_reproduces_the_large_rebuilds_a_plan_s_cost_is_made_of() -> None:
    """Many one-op rebuilds with noisy timings (cold Python in backward) and one large rebuild
    per micro-batch: the shared fit is on the absolute error, so it reproduces the large one,
    which dominates a plan's total; a fit on the relative error lets the small ones decide."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({})

    def fitted(x):
        return sum(c * v for c, v in zip(cost.rebuild.fit.coef, x))

    noise = [0.7, 1.3, 0.9, 1.2, 0.8, 1.1, 1.0, 1.25, 0.75]
    small = [((0.0, 1.0, 1.0, p), (26e-6 + p) * n * (3.0 if i % 3 == 0 else 1.0))
             for i, (p, n) in enumerate(zip([5e-6, 7e-6, 9e-6, 6e-6, 8e-6, 10e-6, 5e-6, 7e-6, 9e-6], noise))]
    large = ((0.0, 8.0, 1.0, 270e-6), 15e-6 + 8 * 11e-6 + 270e-6)
    for _ in range(5):
        cost.rebuild.fit.add(small + [large])
    assert fitted(large[0]) == pytest.approx(large[1], rel=0.05)


def rebuild_seconds(cost, ops: int, seconds: float) -> float:
    """What the shared replay fit predicts for one rebuild (not a micro-batch's first) of ``ops``
    op calls whose replays take ``seconds``, from its learned coefficients."""
    return cost.replay_entry_s + ops * cost.replay_fixed_s + seconds * cost.replay_factor


def test_replay_fit_learned_from_small_rebuilds_predicts_a_large_one() -> None:
    """Rebuilds of one or two small ops (5-45 us profiled), whose measured time is mostly the
    replay's own overhead plus noise, tell little about the factor on the ops' time; fitted
    freely it came out anywhere from 0.5 to 1.5 and a 500 us op was predicted at 318 to 764 us.
    With the prior on the factor (1 unless the observations say otherwise), 513 to 566 us."""
    import random

    from bagualu2.plan.cost_model import CostModel

    rng = random.Random(0)
    for _ in range(20):
        cost = CostModel({})
        for _ in range(12):  # micro-batches
            rows = []
            for i in range(rng.randint(1, 3)):
                ops, profiled, first = rng.randint(1, 2), rng.uniform(5e-6, 45e-6), float(i == 0)
                measured = 40e-6 * first + 25e-6 + 10e-6 * ops + profiled + rng.gauss(0, 15e-6)
                rows.append(((first, float(ops), 1.0, profiled), max(1e-6, measured)))
            cost.rebuild.fit.add(rows)
        assert rebuild_seconds(cost, 1, 500e-6) == pytest.approx(25e-6 + 10e-6 + 500e-6, rel=0.1)


def test_cost_model_learns_what_each_key_s_rebuild_costs_beyond_the_shared_fit() -> None:
    """Two keys profiled alike whose rebuilds cost 100 us and 30 us: no shared fit tells them
    apart, each key's own correction does."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    cost.observe({"norm:mul:1": (1000, 1e-5, True, (), ()), "moe:index_select:0": (1000, 1e-5, True, (), ())},
                 {}, forward_seconds=0.01)
    true = {"norm:mul:1": 1e-4, "moe:index_select:0": 3e-5}
    for keys in [("norm:mul:1",), ("moe:index_select:0",), tuple(true)] * 3:
        cost.observe_replays({k: (true[k], 1) for k in keys}, {})
    for key, seconds in true.items():
        assert cost.recompute_seconds(key, {}) == pytest.approx(seconds)
    assert cost.plan_seconds({k: Choice.RECOMPUTE for k in true}, {}) == pytest.approx(1.3e-4)
    assert cost.replay_ratio("norm:mul:1") > 1.0 > cost.replay_ratio("moe:index_select:0")


def test_a_key_s_correction_holds_for_rebuilds_of_the_size_it_was_measured_at() -> None:
    """The LM head's loss, rebuilt alone, measured 3x what the shared fit predicts (its own
    small replay's overhead). In a plan that recomputes everything, backward enters one rebuild
    there that replays the body too: a rebuild of another size, priced by the shared fit, not
    at 3x. Its correction holds once it has measured CORRECTION_SAMPLES rebuilds of that size."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.cost_model.rebuild import CORRECTION_SAMPLES
    from bagualu2.plan.planner import Choice

    cost = CostModel({})
    body = [f"body:op:{i}" for i in range(20)]
    saved = {k: (1000, 1e-4, True, (), ()) for k in body}
    saved["head:loss:0"] = (1000, 1e-4, True, (), tuple(body))
    cost.observe(saved, {}, forward_seconds=0.01)
    for keys in [body[:1], body[1:3], body[3:6]] * 3:  # the shared fit: 1x the profiled time
        cost.observe_replays({k: (1e-4, 1) for k in keys}, {})
    cost.observe_replays({"head:loss:0": (3e-4, 1)}, {})
    assert cost.replay_ratio("head:loss:0") == 1.0  # one rebuild of its size: not yet a correction
    for _ in range(CORRECTION_SAMPLES - 1):
        cost.observe_replays({"head:loss:0": (3e-4, 1)}, {})
    assert cost.replay_ratio("head:loss:0") > 2.0 and cost.replay_ratio("head:loss:0", ops=21) == 1.0
    assert cost.recompute_seconds("head:loss:0", {}) == pytest.approx(
        cost.replay_ratio("head:loss:0") * (cost.replay_entry_s + cost.replay_fixed_s + 1e-4 * cost.replay_factor))
    everything = {k: Choice.RECOMPUTE for k in saved}
    assert cost.rebuild_profile(everything, {}) == (21, 1, pytest.approx(2.1e-3))
    assert cost.plan_seconds(everything, {}) == pytest.approx(
        cost.replay_frame_s + cost.replay_entry_s + 21 * cost.replay_fixed_s + 2.1e-3 * cost.replay_factor)
    assert cost.plan_seconds(everything, {}) < 1.5 * 2.1e-3


def test_cost_model_counts_an_unsaved_input_once_per_plan() -> None:
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({}, copies_overlap=False)
    saved = {"q:op:0": (1000, 1e-3, True, ("proj:mm:0",)), "k:op:0": (1000, 2e-3, True, ("proj:mm:0",)),
             "o:op:0": (1000, 4e-3, True, ())}
    cost.observe(saved, {}, forward_seconds=0.1, unsaved={"proj:mm:0": 10e-3})
    assert cost.recompute_seconds("q:op:0", {}) == pytest.approx(11e-3)  # alone: pays for proj
    assert cost.recompute_seconds("k:op:0", {}) == pytest.approx(12e-3)
    both = {"q:op:0": Choice.RECOMPUTE, "k:op:0": Choice.RECOMPUTE, "o:op:0": Choice.KEEP}
    assert cost.plan_seconds(both, {}) == pytest.approx(13e-3)  # proj rebuilt once, for both
    # Replays are fitted against the same plan-level profile: backward unpacks k first, whose
    # rebuild makes proj.
    cost.observe_replays({"q:op:0": (1e-3, 1), "k:op:0": (12e-3, 1)}, {})
    assert cost.replay_factor == pytest.approx(1.0) and cost.replay_fixed_s == 0.0


def _theil_sen(samples: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(a, b) of the median line: the median of all pairwise slopes (each pair once), then the
    median intercept; for one token count, the median value through the origin (or flat)."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(samples) for x2, y2 in samples[i + 1:] if x2 != x1]
    if not slopes:
        x = samples[0][0]
        return (0.0, statistics.median(y for _, y in samples) / x) if x > 0 else (statistics.median(y for _, y in samples), 0.0)
    b = statistics.median(slopes)
    return statistics.median(y - b * x for x, y in samples), b


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0.0, 1.0)), min_size=1, max_size=60))
def test_a_timing_fit_is_the_theil_sen_line_of_its_window_refitted_once_an_eighth_is_new(samples) -> None:
    from bagualu2.plan.cost_model.fit import FIT_WINDOW, LineFit

    fit = LineFit(robust=True)
    fitted: List[Tuple[float, float]] = []  # the window at the last refit
    new = 0
    for i, (tokens, seconds) in enumerate(samples):
        fit.add(float(tokens), seconds)
        window = [(float(x), y) for x, y in samples[max(0, i + 1 - FIT_WINDOW):i + 1]]
        new += 1
        if 8 * new >= len(window):
            fitted, new = window, 0
        a, b = _theil_sen(fitted)
        for x in (0.0, 3.0, 10.0):
            assert fit(x) == pytest.approx(max(0.0, a + b * x), abs=1e-12)


def test_cost_model_timings_drop_the_cold_first_micro_batch_and_outliers() -> None:
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({0: "experts"})
    cost.observe({"attn:op:0": (100, 50e-3, True, ()), "experts.0:mm:0": (400, 40e-3, True, ())},
                 {0: [4, 8]}, forward_seconds=1.0)  # cold: first touches, allocator growth
    for seconds, tokens in ((1e-3, 4), (9e-3, 8), (1e-3, 2), (1e-3, 6)):  # one preempted run
        cost.observe({"attn:op:0": (100, seconds, True, ()), "experts.0:mm:0": (100 * tokens, tokens * 1e-3, True, ())},
                     {0: [tokens, 12 - tokens]}, forward_seconds=0.1)  # micro-batches of one size
    assert cost.recompute_seconds("attn:op:0", {0: [10, 2]}) == pytest.approx(1e-3)
    assert cost.recompute_seconds("experts.0:mm:0", {0: [10, 2]}) == pytest.approx(10e-3)
    assert cost.predict_bytes("experts.0:mm:0", {0: [10, 2]}) == 1000


def test_cost_model_learns_what_offloads_cost() -> None:
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.planner import Choice

    cost = CostModel({}, d2h_bandwidth=1e9, h2d_bandwidth=1e9, copy_fixed_s=(1e-4, 1e-4))
    cost.observe({"a:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    (cand,), _ = cost.candidates(["a:op:0"], {}, min_bytes=0, can_offload=True)
    assert cand.offload_s == pytest.approx(1e-4 + 1e-3)  # nothing measured: the engine's figures
    # Offloads that really cost 0.3 ms per micro-batch (the first reload waits for a copy
    # nothing hid), 50 us each on the training thread, and 1.5x their copy time.
    def observed(copies: int, nbytes: int) -> float:
        return 3e-4 + copies * 5e-5 + 1.5 * (copies * 2e-4 + 2 * nbytes / 1e9)

    # One observation cannot tell the parts apart: the factor takes it all.
    cost.observe_copies(observed(2, 2 * 10**6), copies=2, nbytes=2 * 10**6)
    assert cost.copy_frame_s == cost.copy_overhead_s == 0.0
    assert cost.copy_factor == pytest.approx(observed(2, 2 * 10**6) / 4.4e-3)
    # Micro-batches with many small copies and with few large ones separate them (exact data:
    # any weighting recovers them).
    cost.observe_copies(observed(10, 10**5), copies=10, nbytes=10**5)
    cost.observe_copies(observed(1, 4 * 10**6), copies=1, nbytes=4 * 10**6)
    assert (cost.copy_frame_s, cost.copy_overhead_s, cost.copy_factor) == (
        pytest.approx(3e-4), pytest.approx(5e-5), pytest.approx(1.5))
    (cand,), _ = cost.candidates(["a:op:0"], {}, min_bytes=0, can_offload=True)
    assert cand.offload_s + cand.reload_s == pytest.approx(observed(1, 10**6) - 3e-4)  # the copy's own part
    # a plan pays the per-micro-batch part once, whatever it offloads
    cost.observe({"b:op:0": (10**6, 1e-3, True, ())}, {}, forward_seconds=0.05)
    plan = {"a:op:0": Choice.OFFLOAD, "b:op:0": Choice.OFFLOAD}
    assert cost.plan_seconds(plan, {}) == pytest.approx(observed(2, 2 * 10**6))
    assert cost.plan_seconds({"a:op:0": Choice.RECOMPUTE}, {}) == pytest.approx(cost.recompute_seconds("a:op:0", {}))
    cost.observe_copies(0.0, copies=3, nbytes=10)  # nothing measured: ignored
    assert cost.copy_factor == pytest.approx(1.5)


def test_many_small_offloading_plans_do_not_erase_what_offloading_everything_taught() -> None:
    """Plans offload a few storages every micro-batch, and calibrations 64 once in a while;
    each measurement is up to 10% off either way. Learned from the small plans alone, the parts
    are told apart by noise, and 64 offloads priced far from them: the fit forgets per offload
    count, so 100 small plans after the last calibration leave 64 priced as measured."""
    from bagualu2.plan.cost_model import CostModel

    cost = CostModel({}, d2h_bandwidth=1e9, h2d_bandwidth=1e9)

    def observed(copies: int, nbytes: int) -> float:
        return 3e-4 + copies * 5e-5 + 1.5 * 2 * nbytes / 1e9

    noise = [1.1, 0.9, 1.05, 0.95]
    for i in range(8):  # calibrations of everything, and plans of 5, in turn
        cost.observe_copies(observed(64, 10**7) * noise[i % 4], copies=64, nbytes=10**7)
        cost.observe_copies(observed(5, 2 * 10**6) * noise[(i + 1) % 4], copies=5, nbytes=2 * 10**6)
    for i in range(100):  # plans of 4 to 7 offloads, of 1 to 3 MB
        copies, nbytes = 4 + i % 4, 10**6 * (1 + i % 3)
        cost.observe_copies(observed(copies, nbytes) * noise[i % 4], copies=copies, nbytes=nbytes)

    def priced(copies: int, nbytes: int) -> float:
        return cost.copy_frame_s + copies * cost.copy_overhead_s + cost.copy_factor * 2 * nbytes / 1e9

    assert priced(64, 10**7) == pytest.approx(observed(64, 10**7), rel=0.05)
    assert priced(5, 2 * 10**6) == pytest.approx(observed(5, 2 * 10**6), rel=0.05)


@settings(max_examples=200, deadline=None)
@given(coef=st.tuples(st.floats(0, 1e-2), st.floats(0, 1e-3), st.floats(0.05, 5.0)),
       obs=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 64), st.floats(1e-5, 1e-1)), min_size=1, max_size=12),
       noise=st.lists(st.floats(-0.5, 0.5), min_size=12, max_size=12))
def test_cost_fit_reproduces_exact_costs_and_never_goes_negative(coef, obs, noise) -> None:
    from bagualu2.plan.cost_model.fit import CostFit

    exact, noisy, anchored, bucketed = CostFit(3), CostFit(3), CostFit(3, prior_sd=0.1), CostFit(3)
    floored, noisy_floored = CostFit(3, prior_sd=0.1, floor=0.5), CostFit(3, floor=0.5)
    zeroed, noisy_zeroed = CostFit(3, zero_sd={0: 1e-4}), CostFit(3, prior_sd=0.1, zero_sd={0: 1e-4, 1: 1e-5})
    for x, e in zip(obs, noise):
        y = sum(c * v for c, v in zip(coef, x))
        exact.add([(x, y)])
        bucketed.add([(x, y)], [x[0]])
        anchored.add([(x, y)])
        floored.add([(x, y)])
        zeroed.add([(x, y)])
        noisy.add([(x, y * (1 + e))])
        noisy_floored.add([(x, y * (1 + e))])
        noisy_zeroed.add([(x, y * (1 + e))])
        assert min(noisy.coef) >= 0 and min(exact.coef) >= 0 and min(anchored.coef) >= 0 and min(noisy_zeroed.coef) >= 0
        for fit in (floored, noisy_floored):  # the factor never below its floor, the rest >= 0
            assert fit.coef[-1] >= 0.5 and min(fit.coef) >= 0
    # Whatever split it finds, exact observations are reproduced, with a prior on the factor too,
    # and with a floor the factor they were made with is above (at the floor itself, as at 0
    # without one, rounding can leave the exact fit's factor a hair below and out of reach).
    # A part too small to lower the residual by more than the fit's tie tolerance is left out
    # (a coefficient of 1e-6 on 5 items of a 0.07 s total: 4e-5 off), and a prior toward 0 on
    # another part then weighs that residual as noise (1.2e-4 off): 3e-4 leaves room for both.
    for x in obs:
        for fit in (exact, anchored, bucketed, zeroed) + ((floored,) if coef[-1] >= 0.55 else ()):
            assert sum(c * v for c, v in zip(fit.coef, x)) == pytest.approx(sum(c * v for c, v in zip(coef, x)), rel=3e-4)


def test_cost_fit_forgets_only_the_buckets_a_batch_observes() -> None:
    """Rebuilds of one op cost 20 us + 150 us each, and one of 128 ops 20 us per op + 150 us:
    observed once, then 300 batches of one-op rebuilds alone (as budget plans replay) that
    cannot tell the per-op part from the per-rebuild part. In one bucket the large rebuild is
    forgotten (and predicted at 3.4x its cost); in buckets by size it stays known."""
    from bagualu2.plan.cost_model.fit import CostFit

    def cost(ops: int, seconds: float) -> float:
        return 20e-6 * ops + 150e-6 + seconds

    large, small = (128.0, 1.0, 5e-3), (1.0, 1.0, 40e-6)
    shared, bucketed = CostFit(3, relative=False), CostFit(3, relative=False)
    for fit, buckets in ((shared, None), (bucketed, [8, 1])):
        fit.add([(large, cost(128, 5e-3)), (small, cost(1, 40e-6))], buckets)
        for i in range(300):
            noisy = cost(1, 40e-6) * (1.2 if i % 2 else 0.8)  # one-op rebuilds alone, noisy
            fit.add([((1.0, 1.0, 40e-6), noisy)], buckets and [1])

    def predict(fit: CostFit) -> float:
        return sum(c * v for c, v in zip(fit.coef, large))

    assert predict(bucketed) == pytest.approx(cost(128, 5e-3), rel=0.05)
    assert abs(predict(shared) / cost(128, 5e-3) - 1) > 1.0


@pytest.mark.parametrize("spread", [0.2, 0.3])
def test_relative_cost_fit_is_not_biased_low_by_noise(spread: float) -> None:
    """Copy times of 1 ms + 2 ms per predicted ms, each observed low, on the mark and high by
    ``spread`` in turn (mean on the mark), none forgotten. Weighed by the observed totals, the
    fit would come out 5% (20% spread) to 12% (30%) low, as low totals weigh most; weighed by
    the totals it expected, it stays on the mark."""
    from bagualu2.plan.cost_model.fit import CostFit

    fit = CostFit(2, memory=1.0)
    for i in range(300):
        predicted = (0.5e-3, 1e-3, 2e-3)[i % 3]
        noise = (1 - spread, 1.0, 1 + spread)[i // 3 % 3]
        fit.add([((1.0, predicted), (1e-3 + 2 * predicted) * noise)])
    for predicted in (0.5e-3, 1e-3, 2e-3):
        assert sum(c * v for c, v in zip(fit.coef, (1.0, predicted))) == pytest.approx(1e-3 + 2 * predicted, rel=0.02)


def test_replay_factor_keeps_its_floor_when_cheap_rebuilds_measure_flat() -> None:
    """Rebuilds of cheap ops that all measured about 300 us whatever their profiled time (as
    elementwise ops and gathers did on the benchmark model): fitted freely, the factor on the
    ops' time goes to 0.1 and a rebuild of every matmul (130 ms profiled) is predicted at a
    fraction of that; the replay fit's floor keeps it at half at least."""
    from bagualu2.plan.cost_model import CostModel
    from bagualu2.plan.cost_model.fit import CostFit
    from bagualu2.plan.cost_model.rebuild import REPLAY_FACTOR_FLOOR, REPLAY_FACTOR_SD

    rows = [((0.0, 1.0, 1.0, p), 280e-6 + 0.1 * p) for p in (40e-6, 120e-6, 400e-6, 600e-6)]
    free = CostFit(4, relative=False, prior_sd=REPLAY_FACTOR_SD)
    cost = CostModel({})
    for _ in range(4):
        free.add(rows)
        cost.rebuild.fit.add(rows)
    assert free.coef[-1] == pytest.approx(0.1, abs=0.02)  # the case the floor is for
    assert cost.replay_factor >= REPLAY_FACTOR_FLOOR == 0.5
    assert rebuild_seconds(cost, 249, 0.13) >= 0.5 * 0.13
