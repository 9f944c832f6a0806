"""Trace scopes: a traced forward traces only the outermost blocks its plan may release from.

Design note
-----------
Tracing costs every aten op of the forward a Python call (``TracingMode``), though a plan that
releases the operators of a few blocks needs recipes only there. A frame with
``Frame.released_modules`` (a fixed plan's: no gate changes it while the forward runs) is traced
only as far as those modules need (``TraceScope``):

* When each of them lies inside an outermost block (a plain module, not a compiled region, that
  an earlier frame saw called inside it), only those blocks are traced: the module hooks are on
  them and the modules inside them, and nowhere else; a traced block turns the tracing mode on
  as it begins and off as it returns (``enter_traced``, ``leave_traced``). Everything else
  saves as an untraced frame does (by the C++ pack hook; offloaded when a save would cross an
  enforced budget).
* Otherwise (an operator outside every such block may be released) the forward is traced but
  for the outermost blocks that hold none of them: each such call (a ``CalmBlock``) turns the
  mode off as it begins and on as it returns (``enter``, ``leave``).

What a traced op reads of a storage made untraced it holds as it holds the forward's inputs
(``Leaf``s, version-checked at replay).

Invariants (tests/test_calm_blocks.py, tests/test_aliasing.py):

* Exactness: a traced storage that untraced code writes in place is never rebuilt as it was
  before the write for a read made after it. Each traced storage's node knows the version its
  tensors' counter reads after the last op the tracing mode saw on it (``StorageNode.version``);
  every traced read of it (a recorded op's argument, an in-place op's target, a save, a block
  input anchored) compares the tensor's counter first, and a counter that moved ends the
  node's replayable states (``TracingMode.seen``). Every tensor that aliases a storage through
  torch's view machinery shares one counter (views, ``detach()``, and so module attributes,
  buffers, closures and containers holding them), so the write is seen whoever made it, through
  whichever tensor, and however long after the tensors the traced blocks returned died. A
  write that moves no counter (through ``.data``, a NumPy or DLPack alias) is outside what
  autograd itself checks, and outside this: ``enable(verify=...)`` catches what it corrupts.
  What a traced op reads of a storage made untraced is a leaf, version-checked when a rebuild
  reads it: so a model whose traced forwards read a storage and then wrote it in place where it
  was not made (another block, or the code between blocks) is traced whole from then on
  (``TracingMode.writes_across_blocks``). A calm block called with an argument that is neither
  a tensor nor a plain value (a KV cache), or entered while another dispatch mode runs above
  the tracing mode, is traced instead.
* A storage a traced op made is saved as the plan says wherever it is saved: untraced code's
  saves of it take the full way, where the same check runs.
* Nothing untraced is planned: it has no node and its operators no key seen. Profiled and
  ``strict`` frames, and frames whose first saves an overlap driver follows, are traced whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Any, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from bagualu2.runtime.frame import CalmBlock, Frame, TraceScope
from bagualu2.runtime.rerun import unrestorable

if TYPE_CHECKING:
    from bagualu2.runtime.tracing import TracingMode

__all__ = ["CalmBlock", "Scopes", "TraceScope", "begins", "enter", "enter_traced", "leave", "leave_traced",
           "trace_scope", "traced_ends"]


def trace_scope(released: Iterable[str], outermost: AbstractSet[str], framed: AbstractSet[str]) -> TraceScope:
    """The scope of a frame whose plan may release the operators of the modules ``released``,
    in a model whose plain outermost blocks are ``outermost`` (module paths), of which those in
    ``framed`` have been seen called inside a frame (a block called before its forward begins,
    as a pipeline's model chunk is, would never turn the tracing mode on)."""
    blocks = set()
    whole = False
    for path in released:
        parts = path.split(".")
        block = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in outermost), None)
        if block is not None:
            blocks.add(block)
        whole = whole or block not in framed
    return TraceScope(frozenset(blocks), whole)


class Scopes:
    """A runtime's plain outermost blocks (``outermost``, module paths: not compiled regions),
    those it has seen called inside a frame (``framed``), and the scope a frame traces (``of``)."""

    def __init__(self) -> None:
        self.outermost: Set[str] = set()
        self.framed: Set[str] = set()
        # The scope last computed: (released_modules, len(outermost), len(framed), the scope)
        self._last: Optional[Tuple[FrozenSet[str], int, int, Optional[TraceScope]]] = None

    def of(self, frame: Frame) -> Optional[TraceScope]:
        """What ``frame`` traces; None: all of it (or, untraced, nothing)."""
        released = frame.released_modules
        if released is None or not frame.traced or frame.profile or frame.strict or frame.on_saved.subscribers:
            return None
        last = self._last
        if last is None or last[:3] != (released, len(self.outermost), len(self.framed)):
            scope = trace_scope(released, self.outermost, self.framed)
            # Every block traced: tracing all of it spares turning the mode on and off.
            self._last = last = (released, len(self.outermost), len(self.framed),
                                 None if scope.blocks >= self.outermost else scope)
        return last[3]


def _flat(args: tuple, kwargs: Dict[str, Any]) -> List[Any]:
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args)  # the common call: a pytree flatten costs more than the rest here
    return tree_flatten((args, kwargs))[0]


def begins(frame: Frame, mode: "TracingMode", module: torch.nn.Module, name: str, args: tuple,
           kwargs: Dict[str, Any]) -> bool:
    """Outermost block ``name`` begins in ``frame``, which has a scope: True when it runs
    untraced (a calm block: ``enter``); else it is traced, the mode turned on first when the
    scope traces only its blocks (``enter_traced``)."""
    scope = frame.runtime_state.scope
    if name not in scope.blocks:
        return enter(frame, mode, module, name, args, kwargs)
    if not scope.whole:
        enter_traced(frame, mode)
    return False


def traced_ends(frame: Frame, mode: "TracingMode") -> None:
    """A traced outermost block of ``frame``, which has a scope, returned."""
    if not frame.runtime_state.scope.whole:
        leave_traced(frame, mode)


def enter(frame: Frame, mode: "TracingMode", module: torch.nn.Module, name: str, args: tuple,
          kwargs: Dict[str, Any]) -> bool:
    """Run this call of outermost block ``name``, which ``frame``'s plan releases nothing from,
    untraced (the module hooks' call as it begins); False (trace it) when another dispatch mode
    was entered inside ``mode``, or when an argument is an object the block may change unseen
    (``unrestorable``)."""
    if _get_current_dispatch_mode() is not mode:
        return False
    flat = _flat(args, kwargs)
    if unrestorable(flat) is not None:
        return False
    run = frame.runtime_state
    run.calm_block = CalmBlock(module, name)
    mode.place(False)  # off torch's dispatch stack: the block's ops skip Python
    run.calm = True
    return True


def leave(frame: Frame, mode: "TracingMode") -> None:
    """End ``frame``'s calm block call (as it returns, or as an error leaves it): tracing
    resumes."""
    run = frame.runtime_state
    run.calm_block = None
    run.calm = False
    mode.place(True)


def enter_traced(frame: Frame, mode: "TracingMode") -> None:
    """A block the plan may release from begins in a frame that traces only such blocks:
    tracing starts."""
    mode.place(True)
    frame.runtime_state.calm = False


def leave_traced(frame: Frame, mode: "TracingMode") -> None:
    """Such a block returned: tracing stops."""
    frame.runtime_state.calm = True
    mode.place(False)
