"""``bagualu2 demo``, the README's main job, end to end through the command line (shortened)."""
from __future__ import annotations

import json

import pytest

from bagualu2.cli import main
from bagualu2.cli.demo import Ratio, _spans, busy_note, paired_ratio, rounds_of


def test_demo_trains_every_policy_exactly_and_adaptive_holds_the_budget(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--micro-batches", "24", "--spike-rate", "0.15", "--batch-size", "4",
               "--seq-len", "64", "--rounds", "3", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "expect about" in printed  # the time, said before training
    assert "frozen" in printed and "static" in printed  # what each policy is, static included
    assert "adaptive over recompute_all" in printed and "rounds" in printed
    assert "losses: equal bit for bit under every policy" in printed
    assert "profiled the operators or calibrated" in printed  # adaptive's lower first micro-batches, said
    result = json.loads((out / "demo_results.json").read_text())
    runs = result["results"]
    assert set(runs) == {"keep_all", "recompute_all", "static", "adaptive"}
    assert len(result["spikes"]) == round(0.15 * 24)
    for name, run in runs.items():  # the same losses under every plan, bit for bit
        assert run["losses_match_keep_all"] is True
        # one peak: the table's is the largest of the plotted per-micro-batch peaks
        assert run["peak_bytes"] == max(result["peaks"][name]) and len(result["peaks"][name]) == 24
        lines = (out / f"telemetry_{name}.jsonl").read_text().splitlines()  # --out's telemetry
        assert sum('"kind": "micro_batch"' in line for line in lines) == 24
    assert runs["adaptive"]["over_budget_micro_batches"] == 0 and runs["adaptive"]["violations"] == 0
    assert runs["adaptive"]["peak_bytes"] <= result["budget_bytes"] < runs["keep_all"]["peak_bytes"]
    assert runs["keep_all"]["over_budget_micro_batches"] >= len(result["spikes"])  # every spike crosses
    assert runs["recompute_all"]["over_budget_micro_batches"] == 0
    assert runs["adaptive"]["traced_micro_batches"] < 24
    assert len(result["rounds"]) == 3
    for c in result["comparisons"].values():
        assert c["low"] <= c["high"] and c["tie"] == (c["low"] <= 1.0 <= c["high"])
    assert (out / "memory_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_cover_the_timed_micro_batches_once() -> None:
    spans = rounds_of(25, 3, warmup=5)
    assert [i for r in spans for i in r] == list(range(5, 25)) and len(spans) == 3
    with pytest.raises(ValueError, match="--rounds 30"):
        rounds_of(25, 30, warmup=5)


def test_paired_ratio_calls_a_difference_inside_the_spread_a_tie() -> None:
    spans = [range(0, 2), range(2, 4)]
    fast, slow = [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 1.5, 1.5]
    clear = paired_ratio(fast, slow, spans)  # a 1.5x-2x faster in every round
    assert (clear.low, clear.high, clear.value) == (1.5, 2.0, 7.0 / 4.0) and not clear.tie
    assert "tie" not in clear.text()
    mixed = paired_ratio(fast, [1.2, 1.2, 0.9, 0.9], spans)  # faster in one round, slower in the other
    assert mixed.tie and "a tie" in mixed.text()
    calm = paired_ratio(fast, slow, spans, keep={0, 2})  # only the kept micro-batches count
    assert (calm.low, calm.high) == (1.5, 2.0)
    assert Ratio(1.0, 0.9, 1.1).tie


def test_spans_name_runs_of_micro_batches() -> None:
    assert _spans([0, 1, 2, 3, 4, 9]) == "0-4, 9" and _spans([2]) == "2" and _spans([]) == ""


def test_busy_note_only_when_the_machine_was_busy() -> None:
    assert busy_note(first_s=0.05, calm_s=0.055, load=1.0, cpus=2, threads=2) is None
    slow = busy_note(first_s=0.05, calm_s=0.2, load=1.0, cpus=2, threads=2)
    assert slow is not None and "4.0x as long" in slow and "torch's 2 threads" in slow
    assert busy_note(first_s=0.05, calm_s=0.05, load=9.0, cpus=2, threads=2) is not None


@pytest.mark.parametrize("argv, match", [
    (["--policies", "keep_all,fastest"], "unknown policies"),
    (["--micro-batches", "5"], "too few"),
    (["--spike-rate", "1.5"], "spike-rate"),
    (["--spike-rate", "0.7", "--micro-batches", "20"], "at most half may spike"),
    (["--rounds", "0"], "--rounds 0 must be in"),
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

