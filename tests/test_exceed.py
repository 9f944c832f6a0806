"""A budget violation is never silent: under ``on_exceed="record"`` the first one warns, once per
provisioner, and under ``"raise"`` the error says what would help for the policy in use."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(ep_size=4))


def _steps(model: MoETransformer, n: int) -> None:
    for i in range(n):
        torch.manual_seed(i)
        tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(i))
        model(tokens).backward()


def _calm_peak(model: MoETransformer) -> int:
    probe = copy.deepcopy(model)
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    _steps(probe, 1)
    return prov.report()["peak_bytes"]


def test_first_recorded_violation_warns_once_naming_budget_peak_and_micro_batch() -> None:
    model = _model()
    budget = _calm_peak(model) // 2
    prov = bagualu2.enable(model, budget=budget, policy="keep_all", min_bytes=0)
    with pytest.warns(UserWarning, match=r"micro-batch 0 went over the activation budget") as seen:
        _steps(model, 3)
    told = [w for w in seen if "went over the activation budget" in str(w.message)]
    assert len(told) == 1  # three micro-batches over it, one warning
    text = str(told[0].message)
    first = prov.telemetry.micro_batches[0]
    assert f"({budget:,} bytes)" in text and f"peak {first.peak_bytes:,} bytes" in text
    assert "policy='adaptive'" in text  # what helps keep_all
    assert prov.report()["violations"] >= 3  # recorded all the same
    # A second provisioner warns again: once per provisioner, not once per process.
    prov.disable()
    bagualu2.enable(model, budget=budget, policy="keep_all", min_bytes=0)
    with pytest.warns(UserWarning, match="went over the activation budget"):
        _steps(model, 1)


def test_no_violation_no_warning() -> None:
    model = _model()
    bagualu2.enable(model, budget=4 * _calm_peak(model), policy="keep_all", min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(model, 2)


@pytest.mark.parametrize("policy, helps, not_said", [
    ("keep_all", "use policy='adaptive'", "releases all it can"),
    ("recompute_all", "recompute_all releases all it can already", "policy='adaptive'"),
    ("adaptive", "raise the budget or shrink the micro-batch", "use policy='adaptive'"),
])
def test_budget_exceeded_error_names_what_helps_for_the_policy(policy, helps, not_said) -> None:
    err = bagualu2.BudgetExceededError(2000, 1000, "layers.0.experts.0.w1", policy)
    assert helps in str(err) and not_said not in str(err)
    assert "1,000" in str(err) and "layers.0.experts.0.w1" in str(err) and err.policy == policy


def test_raise_carries_the_policy_of_the_provisioner() -> None:
    model = _model()
    bagualu2.enable(model, budget=_calm_peak(model) // 2, policy="keep_all", on_exceed="raise", min_bytes=0)
    with pytest.raises(bagualu2.BudgetExceededError, match="policy 'keep_all' does not adapt") as info:
        _steps(model, 1)
    assert info.value.policy == "keep_all"
