"""The one guard of the engine test modules: import the engine, or skip the module where it is
not installed; where CI installed it (the environment variable set), a failed import fails."""
from __future__ import annotations

import importlib
import os

import pytest

TORCHTITAN = ("torchtitan", "BAGUALU2_REQUIRE_TORCHTITAN",
              "torchtitan 0.3.0 is not installed (pip install torchtitan==0.3.0 triton==3.9.0, then "
              "huggingface-hub==2.4.0: docs/engines.md)")


def require(module: str, env: str, reason: str) -> None:
    if os.environ.get(env) == "1":
        importlib.import_module(module)
    else:
        pytest.importorskip(module, reason=reason)
