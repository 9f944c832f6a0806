"""Residency ledger: the device bytes the activation runtime holds, counted once per storage.

``ResidencyLedger`` and the kept-save record (``Kept``) are C++ (``bagualu2._saves``,
csrc/saves/ledger.h, whose design note states their invariants): a step counts and
gives back one count per saved tensor, and in C++ neither runs Python code nor can be cut short
by an interrupt. Here: ``Pin`` (the handle that holds one count for any other holder) and
``_drain_failed_backward``, which frees what a failed backward pass left holding counts inside
autograd. Everything else in the runtime that holds a storage on the device (an offload's source
while its copy runs, a leaf a recipe pins, a copy backward reloads or rebuilds for more readers)
does it through a pin, so the budget is checked against one number that is exact whichever
frames share a storage.

Invariants: a storage's bytes are counted while at least one live holder holds it, and given back
once none does (a dead pin's at the next read of the ledger), even when an interrupt lands in the
middle of the bookkeeping (the count and the registration of its holder change inside one call of
the ledger's), and a pin has no finalizer to be cut short.
"""

from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch

_REBUILD = ("bagualu2's save path (bagualu2._saves) links against torch and is built against the torch "
            "of its build environment: reinstall bagualu2 with this torch (pip install --force-reinstall "
            "--no-build-isolation bagualu2, or from a checkout: pip install --no-build-isolation .)")
try:
    from bagualu2._saves import CalmPack, Kept, KeptUnpack, Ledger as ResidencyLedger, torch_release
except ImportError as e:  # built against another torch release than this process runs
    raise ImportError(f"bagualu2: bagualu2._saves does not load with torch {torch.__version__}: {e}. {_REBUILD}") from e
if tuple(int(v) for v in torch.__version__.split(".")[:2]) != tuple(torch_release):
    raise ImportError(f"bagualu2: bagualu2._saves was built against torch {'.'.join(map(str, torch_release))} and this "
                      f"process runs torch {torch.__version__}. {_REBUILD}")

__all__ = ["CalmPack", "Kept", "KeptUnpack", "Pin", "ResidencyLedger"]


class Pin:
    """Holds one ledger count on a storage for as long as this object lives (or until
    ``drop``). No finalizer: the ledger notices its death through a weak reference whose callback
    is a C method, and gives the count back at its next read."""

    __slots__ = ("_ledger", "_ref", "__weakref__")

    def __init__(self, ledger: ResidencyLedger, storage: torch.UntypedStorage) -> None:
        self._ledger = ledger
        self._ref: Optional[object] = None
        ledger.acquire(storage, self)

    def drop(self) -> None:
        ref = self._ref
        if ref is not None:
            self._ref = None
            self._ledger.release(ref)


_THREAD = threading.local()


def _drain_graph() -> Tuple[torch.Tensor, torch.Tensor]:
    """This thread's drain graph (a leaf and a clone of it), made at its first call."""
    graph = getattr(_THREAD, "drain", None)
    if graph is None:
        with torch.enable_grad(), torch.autograd.graph.disable_saved_tensors_hooks("bagualu2: drain graph"):
            leaf = torch.zeros((), requires_grad=True)
            graph = _THREAD.drain = (leaf, leaf.clone())  # clone saves nothing
    return graph


def _drain_failed_backward() -> bool:
    """Free what a failed backward pass on this thread left queued; whether it ran.

    When a backward pass on the cpu raises (an interrupt, an error in a hook), torch leaves the
    tasks it had queued in the calling thread's ready queue, each holding its node and so the
    saved activations of the graph below it, and a later backward pass on that thread leaves
    them there too: it stops once its own graph is done, and the queue serves nodes made later
    first. A backward pass through a graph made before them (``_drain_graph``, made before the
    thread's first frame) ends only after the queue has served them, and it drops each one whose
    pass is gone. It costs a backward pass of one node (tens of microseconds), so it runs only
    where something is still held between frames; never inside a backward pass."""
    if torch._C._current_graph_task_id() != -1 or torch.is_inference_mode_enabled():
        return False
    leaf, out = _drain_graph()
    torch.autograd.grad(out, leaf, retain_graph=True)
    return True
