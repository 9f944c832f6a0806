"""``bagualu2 demo``, the README's main job, end to end through the command line (shortened)."""
from __future__ import annotations

import json

import pytest

from bagualu2.cli import main


def test_demo_trains_every_policy_exactly_and_adaptive_holds_the_budget(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--micro-batches", "24", "--spike-rate", "0.15", "--batch-size", "4",
               "--seq-len", "64", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "adaptive speedup over recompute_all" in printed and "micro-batches traced" in printed
    result = json.loads((out / "demo_results.json").read_text())
    runs = result["results"]
    assert set(runs) == {"keep_all", "recompute_all", "static", "adaptive"}
    assert len(result["spikes"]) == round(0.15 * 24)
    for run in runs.values():  # the same losses under every plan, bit for bit
        assert run["losses_match_keep_all"] is True
    assert runs["adaptive"]["violations"] == 0
    assert runs["adaptive"]["peak_bytes"] <= result["budget_bytes"] < runs["keep_all"]["peak_bytes"]
    assert runs["recompute_all"]["violations"] == 0
    assert runs["adaptive"]["traced_micro_batches"] < 24
    assert (out / "memory_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, match", [
    (["--policies", "keep_all,fastest"], "unknown policies"),
    (["--micro-batches", "5"], "too few"),
    (["--spike-rate", "1.5"], "spike-rate"),
    (["--budget", "-5"], "--budget -5 must be a positive"),
    (["--imbalance", "0.5"], r"imbalance=0.5 is outside \[1, 4\]"),
    (["--seq-len", "100000"], r"--seq-len 100000 must be in \[1, 128\]"),
    (["--ep-size", "3"], "ep_size=3 must be a positive int dividing"),
    (["--batch-size", "0"], "batch_size >= 1"),
    (["--budget", "100", "--batch-size", "1", "--seq-len", "16", "--micro-batches", "20"],
     "--budget: budget 100 bytes cannot be met"),
])
def test_demo_refuses_bad_arguments_by_name(tmp_path, argv, match) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["demo", "--out", str(tmp_path), *argv])
