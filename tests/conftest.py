"""The one place for backend parametrization and skip markers.

* ``backend`` fixture: ``"cpu"`` always, plus the compiled GPU backend that matches torch's
  device when one is present (``"cuda"`` on CUDA torch, ``"hip"`` on ROCm torch).
* ``device`` fixture: the torch device the chosen backend copies from (cpu or cuda).
* ``@pytest.mark.cuda_only``: skipped unless torch sees a CUDA/ROCm device and the matching
  backend is usable (compiled in, its runtime library loaded; ``bagualu2.backend_status()``).
* ``BAGUALU2_VERIFY=sample`` for every provisioner the suite makes (``enable(verify=...)``).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

from bagualu2 import backend_status


def _gpu_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    want = "hip" if getattr(torch.version, "hip", None) else "cuda"
    return [want] if backend_status()[want]["usable"] else []  # compiled, loaded, sees a device


# The exactness check runs sampled in every provisioner the tests make (and the processes they
# start) unless a test asks otherwise: what a released activation brings back is checked suite-wide.
os.environ.setdefault("BAGUALU2_VERIFY", "sample")

GPU_BACKENDS = _gpu_backends()
BACKENDS = ["cpu"] + GPU_BACKENDS


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda_only: needs a CUDA/ROCm device and the matching compiled backend")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if GPU_BACKENDS:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm device and a compiled GPU backend")
    for item in items:
        if "cuda_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def device(backend: str) -> torch.device:
    return torch.device("cpu") if backend == "cpu" else torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def gpu_backend() -> str:
    if not GPU_BACKENDS:
        pytest.skip("needs a CUDA/ROCm device and a compiled GPU backend")
    return GPU_BACKENDS[0]


@pytest.fixture(autouse=True)
def _thread_state_left_as_found():
    """A test that leaves torch's grad mode off, saved-tensor hooks or a dispatch mode on the
    thread errors here (and they are cleared), instead of failing whichever test the same
    process runs next."""
    yield
    left = []
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        left.append("grad mode disabled")
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        left.append("saved-tensor hooks")
    while _get_current_dispatch_mode_stack():
        left.append(f"dispatch mode {type(_pop_mode()).__name__}")
    if left:
        pytest.fail(f"the test left on the thread: {', '.join(left)}")
