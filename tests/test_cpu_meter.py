"""The CPU allocation meter (csrc/meter/cpu_meter.h; bagualu2._saves): what benchmarks judge memory
on. Once installed, the counting allocator is torch's CPU allocator for the rest of the process,
so every check runs in a process of its own (``python tests/test_cpu_meter.py``), and the rest
of the suite keeps torch's own allocator.

The property: under any program of allocations, frees, resizes and switches of the charged
account, each account's bytes are the sizes of its storages alive now (a storage stays charged
to the account it was allocated under, whichever is charged when it dies), and each high-water
mark is the most its account held since the mark was last reset.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bagualu2._saves")

ACCOUNTS = (1, 2, 3)  # no other code in the child charges these


def test_the_meter_in_a_process_of_its_own() -> None:
    # The child imports the very modules this process did (a sanitized build's, under CI's ASan run).
    import bagualu2._saves

    package_root = str(Path(bagualu2._saves.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "meter checks passed" in done.stdout
    assert f"meter from {package_root}" in done.stdout, done.stdout


def _check_programs() -> None:
    import torch
    from hypothesis import given, settings, strategies as st

    from bagualu2 import _saves

    _saves.meter_install()
    assert _saves.meter_installed()
    print(f"meter from {Path(_saves.__file__).resolve().parent.parent}")
    action = st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 1 << 20)),
        st.tuples(st.just("free"), st.integers(0, 63)),
        st.tuples(st.just("resize"), st.integers(0, 63), st.integers(0, 1 << 21)),
        st.tuples(st.just("charge"), st.sampled_from(ACCOUNTS)),
        st.tuples(st.just("reset"), st.sampled_from(ACCOUNTS), st.integers(0, 1)),
    )

    @settings(max_examples=200, deadline=None)
    @given(st.lists(action, max_size=40))
    def program(actions: list) -> None:
        alive: list = []  # [tensor, account, bytes]
        charged = _saves.meter_charge_to(ACCOUNTS[0])
        try:
            base = {a: _saves.meter_bytes(a) for a in ACCOUNTS}
            for a in ACCOUNTS:
                for mark in (0, 1):
                    _saves.meter_reset_mark(a, mark)
            marks = {(a, m): base[a] for a in ACCOUNTS for m in (0, 1)}
            current = ACCOUNTS[0]
            for act in actions:
                if act[0] == "alloc":
                    alive.append([torch.empty(act[1], dtype=torch.uint8), current, act[1]])
                elif act[0] == "free" and alive:
                    del alive[act[1] % len(alive)]
                elif act[0] == "resize" and alive:
                    entry = alive[act[1] % len(alive)]
                    if act[2] > entry[2]:
                        # A larger storage is allocated, the old one's bytes copied, then it is freed:
                        # for a moment the account charged now holds both.
                        during = base[current] + sum(e[2] for e in alive if e[1] == current) + act[2]
                        for m in (0, 1):
                            marks[(current, m)] = max(marks[(current, m)], during)
                        entry[1], entry[2] = current, act[2]
                    entry[0].resize_(act[2])
                    del entry  # the list of what is alive is the one holder of its tensors
                elif act[0] == "charge":
                    assert _saves.meter_charge_to(act[1]) == current
                    current = act[1]
                elif act[0] == "reset":
                    _saves.meter_reset_mark(act[1], act[2])
                    marks[(act[1], act[2])] = _saves.meter_bytes(act[1])
                for a in ACCOUNTS:
                    held = base[a] + sum(e[2] for e in alive if e[1] == a)
                    assert _saves.meter_bytes(a) == held, (act, a)
                    for m in (0, 1):
                        marks[(a, m)] = max(marks[(a, m)], held)
                        assert _saves.meter_high_water(a, m) == marks[(a, m)], (act, a, m)
            # aligned as torch aligns its own
            assert all(e[2] == 0 or e[0].data_ptr() % 64 == 0 for e in alive)
            alive.clear()
            for a in ACCOUNTS:
                assert _saves.meter_bytes(a) == base[a]
        finally:
            alive.clear()
            _saves.meter_charge_to(charged)

    program()

    # A storage dies under another account: taken from its own, and computing with it is plain.
    _saves.meter_charge_to(1)
    x = torch.randn(1000)
    _saves.meter_charge_to(2)
    before = _saves.meter_bytes(1), _saves.meter_bytes(2)
    y = (x * 2).sum()
    del x
    assert _saves.meter_bytes(1) == before[0] - 4000 and _saves.meter_bytes(2) >= before[1]
    assert torch.isfinite(y)
    _saves.meter_charge_to(0)

    for bad, call in ((64, lambda: _saves.meter_charge_to(64)), (-1, lambda: _saves.meter_bytes(-1)),
                      (2, lambda: _saves.meter_high_water(1, 2))):
        try:
            call()
        except ValueError as e:
            assert str(bad) in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted")
    print("meter checks passed")


if __name__ == "__main__":
    _check_programs()
