"""Installing bagualu2 never changes torch (issue #60): no build requirement brings a torch, the
package asks for a range with a floor only, and the device check's preflight names what a build
needs. The install itself, in fresh venvs on other torches, is `.ci/run` step 6."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib is Python 3.11+")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_no_build_requirement_brings_a_torch_and_the_dependency_has_a_floor_only() -> None:
    """A torch among the build requirements would be one more torch to download (or the wrong
    one to build against); a pin or a ceiling among the dependencies would make pip replace the
    torch a user has."""
    project = _pyproject()
    assert not [r for r in project["build-system"]["requires"] if re.match(r"torch\b", r)]
    torch_reqs = [r for r in project["project"]["dependencies"] if re.match(r"torch\b", r)]
    assert torch_reqs == ["torch>=2.11"], torch_reqs
    assert "dependencies" not in project["project"].get("dynamic", [])


def _preflight():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("device_preflight", ROOT / "benchmarks" / "device_preflight.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_preflight_names_what_is_missing_and_passes_warnings() -> None:
    pre = _preflight()
    assert pre.check_python()["status"] == "ok"
    torch_check = pre.check_torch()
    assert torch_check["status"] in ("ok", "warn") and torch_check["torch"]
    saves = pre.check_saves(after_build=False)
    assert saves["status"] == "ok", saves
    results = {"python": {"status": "ok", "detail": ""}, "torch": {"status": "warn", "detail": "no device"}}
    assert pre.ok(results)
    results["build-tools"] = {"status": "missing", "detail": "cmake not found"}
    assert not pre.ok(results) and "MISSING build-tools" in pre.report(results)
