"""Calm blocks: the outermost blocks of a traced forward that its plan releases nothing from.

Design note
-----------
Tracing costs every aten op of the forward a Python call (``TracingMode``), though a plan
that releases the operators of a few blocks needs recipes only there. A frame with
``Frame.releasing_modules`` runs every outermost block that holds none of the modules named
there untraced: the tracing mode off torch's dispatch stack and the module hooks idle until the
block returns. Its saves are kept as an untraced frame keeps them (by the C++ pack hook;
offloaded when one would cross an enforced budget), and the traced ops after it that read its
outputs hold those as they hold the forward's inputs (``Leaf``s, version-checked at replay).
A ``CalmBlock`` is the record of one such call while it runs.

Invariants (tests/test_calm_blocks.py):

* Exactness: a storage of a traced block that a calm block writes in place through one of its
  tensor arguments ends its node's replayable states there (``TracingMode.untraced_write``): a
  later read of it is held as it is, never rebuilt as it was before the write. A block called
  with an argument that is neither a tensor nor a plain value (a KV cache it may write into), or
  entered while another dispatch mode runs above the tracing mode, is traced instead.
* Nothing of a calm block is planned: its saves have no node and its operators no key seen, so
  only a plan that no gate changes during the forward (a fixed plan) runs blocks calm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from bagualu2.runtime.recipes import StorageNode, is_plain
from bagualu2.runtime.rerun import unrestorable

if TYPE_CHECKING:
    from bagualu2.runtime.frame import Frame
    from bagualu2.runtime.tracing import TracingMode

__all__ = ["CalmBlock", "enter", "leave"]


def enter(frame: "Frame", mode: "TracingMode", module: torch.nn.Module, name: str, args: tuple,
          kwargs: Dict[str, Any]) -> bool:
    """Run this call of outermost block ``name``, which ``frame``'s plan releases nothing from,
    untraced (the module hooks' call as it begins); False (trace it) in a profiled or ``strict``
    frame, one whose first saves an overlap driver follows (``Frame.on_saved``), when another
    dispatch mode was entered inside ``mode``, or when an argument is an object the block may
    write into unseen (``unrestorable``)."""
    if (frame.profile or frame.strict or frame.on_saved.subscribers
            or _get_current_dispatch_mode() is not mode):
        return False
    flat = tree_flatten((args, kwargs))[0]
    if unrestorable(flat) is not None:
        return False
    run = frame.runtime_state
    run.calm_block = CalmBlock(module, name, flat, mode.nodes)
    mode.place(False)  # off torch's dispatch stack: the block's ops skip Python
    run.calm = True
    frame.stats.calm_blocks += 1
    return True


def leave(frame: "Frame", mode: "TracingMode") -> None:
    """End ``frame``'s calm block call (as it returns, or as an error leaves it): what it wrote
    of the traced storages it was given ends their replayable states, and tracing resumes."""
    run = frame.runtime_state
    block, run.calm_block = run.calm_block, None
    run.calm = False
    if block is not None:
        for node in block.written():
            mode.untraced_write(node, f"{block.name} wrote it in place, untraced (a block the plan keeps)")
    mode.place(True)


class CalmBlock:
    """One call of an outermost block running untraced in a traced frame: the module, its path,
    and the traced storages among its tensor arguments with their version counters at entry."""

    __slots__ = ("module", "name", "_watched")

    def __init__(self, module: torch.nn.Module, name: str, flat_args: List[Any], nodes: Dict[int, StorageNode]) -> None:
        self.module = module
        self.name = name
        self._watched: List[Tuple[StorageNode, torch.Tensor, int]] = []
        for x in flat_args:
            if isinstance(x, torch.Tensor) and is_plain(x):
                node = nodes.get(x.untyped_storage()._cdata)
                if node is not None:
                    self._watched.append((node, x, x._version))

    def written(self) -> List[StorageNode]:
        """The traced storages the block wrote in place through its arguments, once each."""
        out: List[StorageNode] = []
        for node, x, version in self._watched:
            if x._version != version and all(n is not node for n in out):
                out.append(node)
        return out
