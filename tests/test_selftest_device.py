"""The device>0 row of `bagualu2 selftest` (bagualu2/cli/selftest_device.py), without a GPU: what
its probe process is given and how its verdict reads the driver's answer (issue #58, 8). The
probe's driver query itself runs against the stand-in driver (tests/test_fake_driver.py,
test_the_device0_probe_asks_the_driver)."""
from __future__ import annotations

import json
import subprocess

from bagualu2.cli import selftest_device


def _probe_run(monkeypatch, context_on_device0: bool) -> dict:
    seen: dict = {}

    def run(cmd, env=None, **kwargs):
        seen["env"] = env
        out = {"device": 3, "offload_all_exact": True, "round_trip_exact": True,
               "visible_devices": (env or {}).get("CUDA_VISIBLE_DEVICES"),
               "context_on_device0": context_on_device0}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(selftest_device.subprocess, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    ok, line, data = selftest_device.check_other_device(0)
    seen.update(ok=ok, line=line, data=data)
    return seen


def test_the_probe_sees_the_devices_the_caller_sees(monkeypatch):
    """The probe process keeps CUDA_VISIBLE_DEVICES: dropping it checked other GPUs than the
    run's (and device 0 of the machine, not of the run)."""
    seen = _probe_run(monkeypatch, False)
    assert seen["env"] is not None and seen["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert seen["ok"] and "inactive" in seen["line"]


def test_an_active_context_on_device_0_fails_the_row(monkeypatch):
    """The verdict is the driver's answer: device 0's primary context active in the probe
    fails the row, however exact the rest was."""
    seen = _probe_run(monkeypatch, True)
    assert not seen["ok"] and "ACTIVE" in seen["line"]
