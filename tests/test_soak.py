"""Soak (DESIGN invariants 2, 3, 7 over a long run): benchmarks/soak.py at 500 micro-batches.

Random spikes (about 3% of micro-batches, 1.5-3x on a local expert) under a budget 5% above the
calm peak: no violation, ledger and arena back to 0 at the end, no growth of the arena from the
middle of the run to its end, and the process's resident set about flat.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_a_500_micro_batch_soak_holds_the_budget_and_leaks_nothing() -> None:
    spec = importlib.util.spec_from_file_location("soak", _SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)  # type: ignore[union-attr]
    args = argparse.Namespace(config="tiny", micro_batches=500, batch=2, seq=32, spike_rate=0.03,
                              spike_min=1.5, spike_max=3.0, slack=0.05, seed=0, progress=0, out=None)
    result = soak.run(args)
    end = result["snapshots"]["end"]
    assert result["violations"] == 0
    assert end["ledger_bytes"] == 0 and end["arena_in_use_bytes"] == 0
    assert result["arena_capacity_growth_middle_to_end"] == 0
    # Over 250 micro-batches the allocator's own noise is a few hundred KiB at most.
    assert result["rss_growth_middle_to_end"] < 0.02, result["snapshots"]
    assert result["peak_bytes"] <= result["budget_bytes"]
