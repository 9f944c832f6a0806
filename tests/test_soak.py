"""Soak (docs/CONTRACTS.md invariants 2 and 3 over a long run): benchmarks/soak.py at 500 micro-batches,
one process, and with ``--pressure`` on 2 expert-parallel ranks.

Random spikes (about 3% of micro-batches, 1.5-3x on a local expert) under a budget 5% above the
calm peak: no violation, ledger and arena back to 0 at the end, no growth of the arena from the
middle of the run to its end, and the process's resident set about flat.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
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


@pytest.mark.slow
def test_a_500_micro_batch_pressure_soak_on_two_ep_ranks_holds_each_budget_and_leaks_nothing(tmp_path) -> None:
    """``--pressure``: real expert parallelism on 2 gloo ranks, 2.6x spikes aimed at either rank,
    routing that drifts; each rank under its own budget 5% above its calm keep-all peak. Run as a
    user runs it, the script in a process of its own: its spawned ranks import it by name."""
    out = tmp_path / "pressure.json"
    subprocess.run([sys.executable, str(_SOAK), "--pressure", "--micro-batches", "500", "--progress", "0",
                    "--out", str(out)], check=True, timeout=1800)
    result = json.loads(out.read_text())
    assert len(result["ranks"]) == 2
    for r in result["ranks"]:
        end, middle = r["snapshots"]["end"], r["snapshots"]["middle"]
        assert r["violations"] == 0, r
        assert end["ledger_bytes"] == 0 and end["arena_in_use_bytes"] == 0, r
        assert end["arena_capacity_bytes"] == middle["arena_capacity_bytes"], r
        assert r["rss_growth_middle_to_end"] < 0.02, r["snapshots"]
        assert r["peak_bytes"] <= r["budget_bytes"]
    # The spikes were aimed at both ranks, gates decided (the profiled and calibrating micro-batches
    # are traced), and each rank released something for its spikes: at its gates (a plan), or,
    # where a spike overflows by no more than tracing itself would pin, as its untraced forward
    # saved (the runtime's offloads, counted as fallbacks).
    assert all(r["spikes_aimed_here"] > 0 for r in result["ranks"])
    assert all(r["decisions"] > 0 for r in result["ranks"])
    assert all(r["planned_micro_batches"] + r["fallbacks"] > 0 for r in result["ranks"]), result["ranks"]
