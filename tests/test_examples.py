"""The engine examples show what docs/engines.md says they show, run as the docs say (torchrun,
2 gloo processes): on the rank the spike lands on, keep_all goes over the budget and adaptive
does not, on every rank every loss equals the engine's own without bagualu2, and rank 0 alone
prints (no two ranks' lines interleave)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _needs(module: str, require: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        if os.environ.get(require) == "1":
            pytest.fail(f"{module} is required here ({require}=1) and does not import")
        pytest.skip(f"{module} is not installed ({install}: docs/engines.md)")


def _torchrun(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           f"examples/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _check(out: str, spiked_ranks: tuple) -> None:
    assert out.count("loss of each step, by rank") == 1  # printed once, by rank 0
    summary = {int(k): block for k, block in re.findall(r"^rank (\d): budget [\d,]+ KiB\n((?:  .*\n)+)", out, re.M)}
    assert set(summary) == {0, 1}, out
    for rank, block in summary.items():
        over = {name: int(n) for name, n in re.findall(r"^  (\w+): peak [\d,]+ KiB from step \d+ on, over the "
                                                      r"budget in (\d+) steps", block, re.M)}
        assert over.keys() == {"keep_all", "adaptive"}, block
        assert over["adaptive"] == 0, block
        if rank in spiked_ranks:
            assert over["keep_all"] >= 1, block  # the spike: an out-of-memory crash on a device
        assert block.count("losses equal to plain") == 2 and "DIFFERENT" not in block, block


@pytest.mark.slow
def test_torchtitan_example_shows_keep_all_over_and_adaptive_within_with_equal_losses() -> None:
    _needs("torchtitan", "BAGUALU2_REQUIRE_TORCHTITAN", "pip install torchtitan==0.3.0")
    _check(_torchrun("torchtitan_moe.py"), spiked_ranks=(1,))


@pytest.mark.slow
def test_megatron_example_shows_keep_all_over_and_adaptive_within_with_equal_losses() -> None:
    _needs("megatron.core", "BAGUALU2_REQUIRE_MEGATRON", "pip install megatron-core==0.16.1")
    _check(_torchrun("megatron_moe.py"), spiked_ranks=(1,))
