"""A resumed run decides as the uninterrupted one would (``Provisioner.state_dict`` /
``load_state_dict``), in one process; tests/test_resume_ep.py does it across processes with
real expert parallelism.

A run trains, checkpoints (model, optimizer, RNG, provisioner, through ``torch.save`` with
``weights_only`` loading), and goes on; a second model is built as the first was, loads the
checkpoint and runs the same later steps. Its losses and gradients are bit-exact with the
uninterrupted run's, it profiles and calibrates nothing, its micro-batches are traced where
the uninterrupted run's were and predict the same bytes, and the first spike after the resume
is planned at its gates. Without the state (the control) the resumed run profiles again and
its first spike is not planned. A state from another model, version or rank layout, or one
that is partial or corrupt, is refused naming why, and leaves the provisioner as it was.
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer
from test_faults import keep_all_peak, make_model, step

# Spikes (2.6x on one expert): a run of two before the checkpoint, the first step after it one.
TRACE = (0.0, 0.0, 0.0, 2.6, 2.6, 2.6, 0.0, 2.6, 2.6, 0.0)
CHECKPOINT_AFTER = 5


def _train(model: MoETransformer, opt: torch.optim.Optimizer, steps: range) -> List[Tuple[torch.Tensor, List[torch.Tensor]]]:
    out = []
    for i in steps:
        out.append(step(model, i, TRACE[i]))
        opt.step()
    return out


def _decided(prov: Any, first: int) -> List[Tuple[Any, ...]]:
    """Per micro-batch from index ``first``: traced, profiled or calibrating, and the first
    decision's predicted bytes (plans may differ between runs by measured time; bytes not)."""
    decisions: Dict[int, int] = {}
    for d in prov.telemetry.decisions:
        decisions.setdefault(d.micro_batch, d.predicted_bytes)
    return [(m.micro_batch, m.traced, m.calibrating, decisions.get(m.micro_batch))
            for m in prov.telemetry.micro_batches if m.micro_batch >= first]


def _planned(prov: Any, micro_batch: int) -> bool:
    """Whether a gate of ``micro_batch`` planned a release (a traced forward, met by a plan, not
    by the runtime offloading what an untraced one could not fit)."""
    return any(d.micro_batch == micro_batch and d.planned_bytes < d.predicted_bytes for d in prov.telemetry.decisions)


def _run(budget: int, resume: Optional[bytes], load_provisioner: bool = True):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The planner's learned state is what a resume restores; block reruns also need the blocks
    # seen traced in this process (relearned by the first forward after a resume, not saved).
    prov = bagualu2.enable(model, budget=budget, min_bytes=0, releases="operators")
    checkpoint = None
    if resume is None:
        _train(model, opt, range(CHECKPOINT_AFTER))
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                    "bagualu2": prov.state_dict()}, buf)
        checkpoint = buf.getvalue()
    else:
        state = torch.load(io.BytesIO(resume), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if load_provisioner:
            prov.load_state_dict(state["bagualu2"])
    later = _train(model, opt, range(CHECKPOINT_AFTER, len(TRACE)))
    return prov, later, checkpoint


@pytest.fixture(scope="module")
def runs() -> Dict[str, Any]:
    budget = int(keep_all_peak(make_model()) * 0.75)
    whole, whole_later, checkpoint = _run(budget, None)
    resumed, resumed_later, _ = _run(budget, checkpoint)
    cold, cold_later, _ = _run(budget, checkpoint, load_provisioner=False)
    return dict(whole=whole, whole_later=whole_later, resumed=resumed, resumed_later=resumed_later, cold=cold,
                cold_later=cold_later)


@pytest.fixture(scope="module")
def profiled() -> Any:
    """A provisioner that has profiled, planned and calibrated (a short run of the trace)."""
    model = make_model()
    prov = bagualu2.enable(model, budget=int(keep_all_peak(make_model()) * 0.75), min_bytes=0)
    for i in range(CHECKPOINT_AFTER):
        step(model, i, TRACE[i])
    return prov


@pytest.mark.slow
def test_resumed_losses_and_gradients_are_bit_exact_with_the_uninterrupted_run(runs: Dict[str, Any]) -> None:
    for (loss_a, grads_a), (loss_b, grads_b) in zip(runs["whole_later"], runs["resumed_later"]):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.slow
def test_resumed_run_decides_as_the_uninterrupted_one_and_plans_its_first_spike(runs: Dict[str, Any]) -> None:
    whole, resumed, cold = runs["whole"], runs["resumed"], runs["cold"]
    assert _decided(resumed, CHECKPOINT_AFTER) == _decided(whole, CHECKPOINT_AFTER)
    assert not any(m.calibrating for m in resumed.telemetry.micro_batches)
    assert resumed.cost.frames == whole.cost.frames  # nothing profiled again
    assert _planned(whole, CHECKPOINT_AFTER) and _planned(resumed, CHECKPOINT_AFTER)
    assert resumed.report()["violations"] == 0
    # The control: a resumed run without the state starts over, and does not plan that spike.
    assert not _planned(cold, CHECKPOINT_AFTER)
    assert _decided(cold, CHECKPOINT_AFTER) != _decided(whole, CHECKPOINT_AFTER)


def _refused(prov: Any, state: Any, match: str) -> None:
    before = prov.state_dict()
    with pytest.raises(ValueError, match=match):
        prov.load_state_dict(state)
    assert prov.state_dict() == before  # nothing was loaded


def test_a_state_from_another_model_version_or_rank_layout_or_a_partial_one_is_refused(profiled: Any) -> None:
    saved = profiled.state_dict()
    entry = saved["rank_0"]
    target = bagualu2.enable(make_model(), budget=profiled.budget, min_bytes=0)
    step(target.model, 0)  # profiled once: its operators are known
    _refused(target, {"rank_1": entry}, r"no entry for this process \(rank_0\)")
    _refused(target, {"rank_0": {**entry, "version": 99}}, "version 99")
    _refused(target, {"rank_0": {k: v for k, v in entry.items() if k != "learned"}}, r"partial: \['learned'\]")
    _refused(target, {"rank_0": {**entry, "learned": entry["learned"][: len(entry["learned"]) // 2]}},
             "truncated or corrupt")
    _refused(target, {"rank_0": {**entry, "learned": b"\x80\x04cos\nsystem\n."}}, "truncated or corrupt")
    torch.manual_seed(0)
    other = bagualu2.enable(MoETransformer(MoEConfig.tiny(dropout=0.1, expert_hidden_size=48)), budget=None)
    _refused(other, saved, r"another model's: its modules differ \(entry \d+: saved .*gate_proj")
    fewer_gates = bagualu2.enable(make_model(), budget=None, gates=[])
    _refused(fewer_gates, saved, "another model's: its gates differ")



def test_a_version_1_state_loads_with_its_grouped_operators_read_as_grouped(profiled: Any) -> None:
    """Version 1 wrote a grouped-experts operator's expert as -1 (``SIZE``'s value, since
    ``GROUPED`` became -2): such a state still loads, and decides as the run that saved it."""
    from bagualu2.plan.cost_model import GROUPED
    from bagualu2.provision.state import VERSION

    key, op = next(iter(profiled.cost.ops.items()))
    was = op.expert
    op.expert = -1  # what version 1 wrote for a grouped operator
    try:
        entry = profiled.state_dict()["rank_0"]
    finally:
        op.expert = was
    assert VERSION == 4
    fresh = bagualu2.enable(make_model(), budget=profiled.budget, min_bytes=0)
    fresh.load_state_dict({"rank_0": {**entry, "version": 1}})
    assert fresh.cost.ops[key].expert == GROUPED
    assert [o.expert for k, o in fresh.cost.ops.items() if k != key] == \
        [o.expert for k, o in profiled.cost.ops.items() if k != key]

def test_a_version_3_state_loads_as_one_that_saw_no_tracing_pins(profiled: Any) -> None:
    """Version 3's footprint did not learn what tracing pins (``traced_bytes``): such a state
    loads as one that has seen none yet, and the rest of what it learned is kept."""
    fp = profiled.footprint
    had = fp.traced_bytes
    del fp.traced_bytes  # what version 3 wrote
    try:
        entry = profiled.state_dict()["rank_0"]
    finally:
        fp.traced_bytes = had
    fresh = bagualu2.enable(make_model(), budget=profiled.budget, min_bytes=0)
    fresh.load_state_dict({"rank_0": {**entry, "version": 3}})
    assert fresh.footprint.traced_bytes == 0
    assert fresh.footprint.worst_bytes == fp.worst_bytes and fresh.footprint.pinned_bytes == fp.pinned_bytes


# torch warns that a save without a process group is a single process's: that is the intent here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torch_distributed_checkpoint_saves_and_loads_the_provisioner_as_a_stateful(profiled: Any,
                                                                                    tmp_path: Any) -> None:
    """``dcp.save({"bagualu2": prov})`` calls ``state_dict()``; ``dcp.load`` fills a fresh
    provisioner's own ``state_dict()`` and hands it to ``load_state_dict``."""
    import torch.distributed.checkpoint as dcp

    whole = profiled
    dcp.save({"bagualu2": whole}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = bagualu2.enable(make_model(), budget=whole.budget, min_bytes=0)
    dcp.load({"bagualu2": fresh}, checkpoint_id=str(tmp_path), no_dist=True)
    assert fresh.cost.frames == whole.cost.frames and fresh.cost.order == whole.cost.order
    assert fresh.footprint.worst_bytes == whole.footprint.worst_bytes
    assert fresh.routing.sums == whole.routing.sums and fresh.stacking.deepest() == whole.stacking.deepest()
    assert fresh.footprint.cost is fresh.cost and fresh.decisions.cost is fresh.cost
