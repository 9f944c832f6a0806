"""Residency ledger: the device bytes the activation runtime holds, counted once per storage.

``ResidencyLedger`` and the kept-save record (``Kept``), with the hooks' common cases
(``CalmPack``, ``KeptUnpack``), are C++ (``bagualu2._saves``, csrc/saves/ledger.h, whose design
note states their invariants): a step counts and gives back one count per saved tensor, and in
C++ neither runs Python code nor can be cut short by an interrupt. ``_saves`` links against
torch's C++ API and loads only under the torch release it was built against; under any other
(or where it was not built: a build that could not import torch) the same types come from
``bagualu2.runtime.saves_python``, their Python form (same results, bit for bit; the host cost
and the interrupt guarantees differ, as its note says), with one ``SavePathWarning`` that says
what it costs and how to rebuild. Here: ``Pin`` (the handle that holds one count for any other holder) and
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

import importlib.util
import os
import threading
import warnings
from types import ModuleType
from typing import Optional, Tuple

import torch

# The command that builds the compiled save path against the torch installed here (its build
# requirements first: no build isolation, so that it sees this torch; --no-deps: torch stays as it is).
REBUILD = ("pip install setuptools wheel pybind11 cmake ninja && pip install --no-build-isolation --no-deps "
           "--force-reinstall --no-binary bagualu2 bagualu2 (from a checkout: pip install --no-build-isolation "
           "--no-deps --force-reinstall .)")


class SavePathWarning(UserWarning):
    """The save path runs in its Python form: the compiled one (``bagualu2._saves``) is missing or
    was built for another torch release."""


def _compiled() -> Tuple[Optional[ModuleType], str]:
    """``bagualu2._saves`` where it loads with this torch, else None and why not."""
    if importlib.util.find_spec("bagualu2._saves") is None:
        return None, "was not built (the build that installed bagualu2 did not see torch: an isolated build)"
    try:
        from bagualu2._saves import torch_release
    except ImportError as e:  # another torch's symbols
        return None, f"does not load with torch {torch.__version__} ({e})"
    built = tuple(torch_release)
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) != built:
        return None, f"was built against torch {'.'.join(map(str, built))} and this process runs torch {torch.__version__}"
    return importlib.import_module("bagualu2._saves"), ""


# BAGUALU2_SAVE_PATH: auto (the compiled form where it loads, else the Python form with one
# warning), python (the Python form, no warning: the tests run both), compiled (the compiled form
# or an ImportError: what CI checks a build by).
_CHOICE = os.environ.get("BAGUALU2_SAVE_PATH", "auto")
if _CHOICE not in ("auto", "python", "compiled"):
    raise ImportError(f"bagualu2: BAGUALU2_SAVE_PATH={_CHOICE!r}: expected auto, python or compiled")
_saves, _why = (None, "was not asked for (BAGUALU2_SAVE_PATH=python)") if _CHOICE == "python" else _compiled()
if _saves is not None:
    from bagualu2._saves import CalmPack, Kept, KeptUnpack, Ledger as ResidencyLedger
    SAVE_PATH = "compiled"
else:
    if _CHOICE == "compiled":
        raise ImportError(f"bagualu2: the compiled save path bagualu2._saves {_why} (BAGUALU2_SAVE_PATH=compiled). "
                          f"To build it against this torch: {REBUILD}")
    from bagualu2.runtime.saves_python import CalmPack, Kept, KeptUnpack, Ledger as ResidencyLedger
    SAVE_PATH = "python"
    if _CHOICE == "auto":
        warnings.warn(
            f"bagualu2: the compiled save path (bagualu2._saves) {_why}; the save path runs in Python instead: "
            f"the same results, bit for bit, at about 7 times the save hooks' host cost (some 2 microseconds more "
            f"per saved tensor on a desktop CPU). To build it against this torch: {REBUILD}",
            SavePathWarning, stacklevel=2)
# Which form runs (compiled or python), and why not the compiled one ("" when it runs).
SAVE_PATH_REASON = _why

__all__ = ["CalmPack", "Kept", "KeptUnpack", "Pin", "REBUILD", "ResidencyLedger", "SAVE_PATH", "SavePathWarning"]


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
