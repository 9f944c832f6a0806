"""Which copy backend serves a device, and whether each compiled backend can run here
(GPU runtime libraries are loaded at first use: docs/backends.md)."""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch

from bagualu2._C import backend_status as native_backend_status, backends as native_backends

__all__ = ["backend_for_device", "backend_status", "resolve_backend", "torch_gpu_backend"]


def torch_gpu_backend() -> Optional[str]:
    """The GPU backend that matches this torch when it sees a device (``"hip"`` on a ROCm
    build, ``"cuda"`` on a CUDA build), else None."""
    if not torch.cuda.is_available():
        return None
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def backend_status() -> Dict[str, dict]:
    """``{name: {"compiled", "usable", "reason", "library"}}`` for cpu, cuda and hip.

    A GPU backend is usable when its runtime library loads and sees a device (the C++ side,
    loading each library once per process) and it is the one this process's torch drives: a
    backend copies torch's tensors on torch's streams, so it must match torch's build and torch
    must see a device."""
    status = {name: dict(entry) for name, entry in native_backend_status().items()}
    want = torch_gpu_backend()
    for name in ("cuda", "hip"):
        entry = status[name]
        if not entry["usable"]:
            continue
        if want is None:
            entry["usable"] = False
            entry["reason"] = (f"{entry['library']} works, but this torch ({torch.__version__}) "
                               f"sees no GPU: install a {'ROCm' if name == 'hip' else 'CUDA'} "
                               f"build of torch")
        elif want != name:
            entry["usable"] = False
            entry["reason"] = (f"this torch ({torch.__version__}) is a {want} build; its tensors "
                               f"and streams are {want}'s")
    return status


def resolve_backend(backend: str) -> str:
    """Validate a backend name; ``"auto"`` picks the GPU backend matching torch when torch sees
    a device (else ``"cpu"``). A name not compiled in raises ValueError; a compiled GPU backend
    that cannot run here raises RuntimeError with the reason (missing library, no device,
    torch without a GPU or of the other vendor)."""
    compiled = list(native_backends())
    if backend == "auto":
        want = torch_gpu_backend()
        if want is None or want not in compiled:
            return "cpu"
        backend = want
    if backend not in compiled:
        raise ValueError(
            f"backend {backend!r} is not compiled into this build of bagualu2; "
            f"compiled backends: {compiled} (rebuild with BAGUALU2_BACKEND=auto, cuda or hip)"
        )
    if backend != "cpu":
        entry = backend_status()[backend]
        if not entry["usable"]:
            raise RuntimeError(f"backend {backend!r} is compiled in but not usable: {entry['reason']}")
    return backend


def backend_for_device(device: Union[str, torch.device]) -> str:
    """The backend that copies tensors of ``device``: ``"cpu"`` for every non-GPU device (cpu,
    meta, ...), the GPU backend matching torch for ``cuda`` devices."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    want = torch_gpu_backend()
    if want is None:
        raise RuntimeError(f"tensors on {dev} need a GPU, but this torch ({torch.__version__}) sees none")
    return resolve_backend(want)
