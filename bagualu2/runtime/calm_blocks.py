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

Invariants (tests/test_calm_blocks.py):

* Exactness: a traced storage that untraced code writes in place ends its node's replayable
  states (``TracingMode.untraced_write``), so no rebuild reproduces it as it was before the write
  for a read made after it. The writes are seen through what the traced blocks return (checked
  as each traced block begins, as the forward ends, and before untraced code's save of a traced
  storage) and through a calm block's tensor arguments (checked as it returns), while those
  tensors live (held weakly: watching extends no activation's life); a write through another
  tensor of the storage after they died is not seen. A calm block called with an argument that
  is neither a tensor nor a plain value (a KV cache), or entered while another dispatch mode runs
  above the tracing mode, is traced instead.
* A storage a traced op made is saved as the plan says wherever it is saved: untraced code's
  saves of it take the full way, after the writes above are seen.
* Nothing untraced is planned: it has no node and its operators no key seen. Profiled and
  ``strict`` frames, and frames whose first saves an overlap driver follows, are traced whole.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, AbstractSet, Any, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from bagualu2.runtime.recipes import StorageNode, is_plain
from bagualu2.runtime.rerun import unrestorable

if TYPE_CHECKING:
    from bagualu2.runtime.frame import Frame
    from bagualu2.runtime.tracing import TracingMode

__all__ = ["CalmBlock", "Scopes", "TraceScope", "begins", "enter", "enter_traced", "leave", "leave_traced",
           "trace_scope", "traced_ends", "watch_written", "watched_written"]

# A traced storage a tensor handed to or from untraced code views: (node, that tensor, held
# weakly, its version counter then)
_Watched = Tuple[StorageNode, "weakref.ref[torch.Tensor]", int]


class TraceScope(NamedTuple):
    """What a frame with ``released_modules`` traces (see the module note)."""

    blocks: FrozenSet[str]
    """The outermost blocks holding a module it may release from: traced."""
    whole: bool
    """An operator outside every such block may be released, or one in a block not yet seen
    called inside a frame: the forward is traced but for the other outermost blocks (calm
    blocks); else only ``blocks`` are."""


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

    def of(self, frame: "Frame") -> Optional[TraceScope]:
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


def _watch(xs: List[Any], nodes: Dict[int, StorageNode]) -> List[_Watched]:
    out: List[_Watched] = []
    for x in xs:
        if isinstance(x, torch.Tensor) and is_plain(x):
            node = nodes.get(x.untyped_storage()._cdata)
            if node is not None:
                out.append((node, weakref.ref(x), x._version))
    return out


def watch_written(watched: List[_Watched], mode: "TracingMode", why: str) -> None:
    """End the replayable states of the watched traced storages written in place since they
    were watched (their version counters moved), once per write seen: ``watched`` is updated,
    and loses what died (a tensor is held weakly: watching extends no activation's life)."""
    alive: List[_Watched] = []
    for node, ref, version in watched:
        x = ref()
        if x is None:
            continue
        if x._version != version:
            mode.untraced_write(node, why)
        alive.append((node, ref, x._version))
    watched[:] = alive


def _written_by(block: str) -> str:
    return f"{block} wrote it in place, untraced (a block the plan keeps)"


def watched_written(frame: "Frame", mode: "TracingMode") -> None:
    """``watch_written`` over all ``frame`` watches now: the traced blocks' outputs and the
    running calm block's arguments."""
    run = frame.runtime_state
    watch_written(run.watched, mode, "written in place untraced (outside the blocks the plan releases from)")
    if run.calm_block is not None:
        watch_written(run.calm_block.watched, mode, _written_by(run.calm_block.name))


class CalmBlock:
    """One call of an outermost block running untraced in a forward traced otherwise: the
    module, its path, and the traced storages among its tensor arguments with their versions."""

    __slots__ = ("module", "name", "watched")

    def __init__(self, module: torch.nn.Module, name: str, watched: List[_Watched]) -> None:
        self.module = module
        self.name = name
        self.watched = watched


def begins(frame: "Frame", mode: "TracingMode", module: torch.nn.Module, name: str, args: tuple,
           kwargs: Dict[str, Any]) -> bool:
    """Outermost block ``name`` begins in ``frame``, which has a scope: True when it runs
    untraced (a calm block: ``enter``); else it is traced, the mode turned on first when the
    scope traces only its blocks (``enter_traced``)."""
    scope = frame.runtime_state.scope
    if name not in scope.blocks:
        return enter(frame, mode, module, name, args, kwargs)
    if not scope.whole:
        enter_traced(frame, mode, name)
    return False


def traced_ends(frame: "Frame", mode: "TracingMode", out: Any) -> None:
    """A traced outermost block of ``frame``, which has a scope, returned ``out``."""
    if not frame.runtime_state.scope.whole:
        leave_traced(frame, mode, out)


def enter(frame: "Frame", mode: "TracingMode", module: torch.nn.Module, name: str, args: tuple,
          kwargs: Dict[str, Any]) -> bool:
    """Run this call of outermost block ``name``, which ``frame``'s plan releases nothing from,
    untraced (the module hooks' call as it begins); False (trace it) when another dispatch mode
    was entered inside ``mode``, or when an argument is an object the block may write into
    unseen (``unrestorable``)."""
    if _get_current_dispatch_mode() is not mode:
        return False
    flat = _flat(args, kwargs)
    if unrestorable(flat) is not None:
        return False
    run = frame.runtime_state
    run.calm_block = CalmBlock(module, name, _watch(flat, mode.nodes))
    mode.place(False)  # off torch's dispatch stack: the block's ops skip Python
    run.calm = True
    return True


def leave(frame: "Frame", mode: "TracingMode") -> None:
    """End ``frame``'s calm block call (as it returns, or as an error leaves it): what it wrote
    of the traced storages it was given ends their replayable states, and tracing resumes."""
    run = frame.runtime_state
    block, run.calm_block = run.calm_block, None
    run.calm = False
    if block is not None:
        watch_written(block.watched, mode, _written_by(block.name))
    mode.place(True)


def enter_traced(frame: "Frame", mode: "TracingMode", name: str) -> None:
    """A block the plan may release from begins in a frame that traces only such blocks:
    what untraced code wrote of the earlier traced blocks' outputs is seen, then tracing
    starts."""
    run = frame.runtime_state
    watch_written(run.watched, mode, f"written in place untraced before {name} (outside the blocks the plan "
                                     f"releases from)")
    mode.place(True)
    run.calm = False


def leave_traced(frame: "Frame", mode: "TracingMode", out: Any) -> None:
    """Such a block returned ``out``: its traced storages are watched, and tracing stops."""
    run = frame.runtime_state
    run.watched.extend(_watch(tree_flatten(out)[0] if not isinstance(out, torch.Tensor) else [out], mode.nodes))
    run.calm = True
    mode.place(False)
