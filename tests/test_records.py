"""Measurements cross a layer boundary as frozen records (bagualu2.shared.records): the runtime
hands back what one backward measured as one ``Measurements``, the C++ planner its solve as a
``SolvedPlan`` with named, read-only fields; no receiver can change what another will read."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bagualu2 import _C
from bagualu2.models import MoEConfig, MoETransformer
from bagualu2.offload import CopyEngine, HostArena
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.shared import Choice, CopyTimes, Measurements, OpReplayTimes, ReplayTimes


def test_one_backward_s_measurements_are_one_frozen_record_and_taking_them_starts_again() -> None:
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny())
    rt = ActivationRuntime(CopyEngine(HostArena(64 << 20)), reload_in_place=False)
    rt.residency.set_parameters(list(model.parameters()))
    hooks = rt.attach(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16))
    measured = []
    for choice in (Choice.OFFLOAD, Choice.RECOMPUTE):
        with rt.frame(Frame(default=choice)):
            loss = model(tokens).float().pow(2).mean()
        loss.backward()
        del loss
        measured.append(rt.residency.take_measurements())
    offloads, rebuilds = measured
    for m in measured:
        assert type(m) is Measurements and type(m.copies) is CopyTimes
    assert offloads.copies.offloads > 0 and offloads.copies.nbytes > 0 and offloads.copies.seconds > 0
    assert not offloads.replays and not rebuilds.copies.offloads
    assert rebuilds.replays and all(type(r) is ReplayTimes and r.micro_batches == 1 and r.seconds > 0
                                    for r in rebuilds.replays.values())
    assert rebuilds.op_replays and all(type(r) is OpReplayTimes and r.replays >= r.timed
                                       for r in rebuilds.op_replays.values())
    with pytest.raises(AttributeError):
        rebuilds.copies.seconds = 0.0  # type: ignore[misc]
    empty = rt.residency.take_measurements()
    assert empty == Measurements({}, {}, CopyTimes(0.0, 0, 0))
    for h in hooks:
        h.remove()


def test_the_planner_binding_returns_a_solve_by_field_name_read_only() -> None:
    solved = _C.Planner(0, 0.0, 0).solve_columns(
        ["a", "b", "c"], [100, 200, 300], [1.0, 0.5, 3.0], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1],
        [False, False, False], [True, True, True], 250, 0.0, 0.0)
    assert solved.choices == [2, 2, 0] and solved.feasible and solved.freed_bytes == 300
    assert solved.shortfall_bytes == 0 and solved.exposed_s == pytest.approx(1.5) and solved.bound_s >= solved.exposed_s
    assert solved.quantum_bytes >= 1
    with pytest.raises(AttributeError):
        solved.feasible = False
    assert not dataclasses.is_dataclass(solved)  # a bound C++ struct, not a Python copy


def test_a_plan_is_installed_through_one_method_that_checks_it() -> None:
    """``Frame.replan``: the keys replanned drop what they had (back to the frame's default unless
    the new plan names them) and the new choices are set; a value that is not a ``Choice`` is
    refused, named, and nothing changes."""
    frame = Frame({"a": Choice.OFFLOAD, "b": Choice.RECOMPUTE, "c": Choice.OFFLOAD})
    frame.replan({"b": Choice.KEEP}, keys=["a", "b"])
    assert frame.choices == {"b": Choice.KEEP, "c": Choice.OFFLOAD} and frame.choice("a") == Choice.KEEP
    with pytest.raises(TypeError, match="'recompute' is not a bagualu2.Choice"):
        frame.replan({"c": "recompute"}, keys=["c"])  # type: ignore[dict-item]
    assert frame.choices == {"b": Choice.KEEP, "c": Choice.OFFLOAD}
