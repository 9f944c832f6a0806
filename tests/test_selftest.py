"""`bagualu2 selftest`: its CPU form runs end to end and says which device rows it did not run."""
from __future__ import annotations

import json

import pytest
import torch

from bagualu2.cli import main


@pytest.mark.slow
def test_selftest_cpu_form_runs_every_row_and_writes_json_and_png(tmp_path, capsys) -> None:
    out = tmp_path / "selftest"
    rc = main(["selftest", "--cpu", "--micro-batches", "40", "--max-copy", "4M", "--out", str(out)])
    result = json.loads((out / "selftest.json").read_text())
    verdicts = {r["name"]: r["verdict"] for r in result["rows"]}
    assert rc == 0, result["failed"]
    assert verdicts == {"exact": "pass", "budget": "pass", "bandwidth": "info", "overlap": "not run",
                        "oom-allocator": "not run", "oom-driver": "not run", "growth": "pass",
                        "device>0": "not run"}
    assert result["running"] is None  # the last write is the final one
    assert (out / "selftest.png").stat().st_size > 0
    assert result["form"] == "cpu"
    assert "device rows were not run" in capsys.readouterr().out


def test_selftest_refuses_too_few_micro_batches(tmp_path) -> None:
    with pytest.raises(SystemExit, match="at least 40"):
        main(["selftest", "--cpu", "--micro-batches", "3", "--out", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_selftest_environment_names_each_backend(tmp_path) -> None:
    from bagualu2.cli.selftest import environment

    env = environment(torch.device("cpu"))
    assert set(env["backend_status"]) == {"cpu", "cuda", "hip"}
    assert "cpu: usable" in env["backend_status_line"]


def test_device_rows_copy_64_mib_and_up_and_nvml_answers_or_says_it_cannot() -> None:
    from bagualu2.cli.selftest_device import _nvml_context_pids, _sizes

    assert _sizes(None) == [64 << 20, 256 << 20, 1 << 30]
    assert _sizes("128M") == [64 << 20]
    assert _sizes("16M") == [64 << 20]  # never below 64 MiB: smaller copies measure overhead
    pids = _nvml_context_pids("GPU-00000000-0000-0000-0000-000000000000")
    assert pids is None or pids == []  # no GPU has that uuid
