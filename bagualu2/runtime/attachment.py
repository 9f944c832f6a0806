"""Module hooks bagualu2 puts on a user's modules, and one module tree's set of them.

Owns ``AttachedHook`` (a hook that copies as a no-op: a copy of a provisioned model is a plain
model) and ``_Attachment`` (``ActivationRuntime.attach``'s hooks, installed while traced frames
run; ``module.compile()``d regions get a ``RegionCall`` in ``_compiled_call_impl`` instead of
module hooks, which Dynamo would trace).
"""

from __future__ import annotations

from typing import Any, Callable, FrozenSet, List, Optional, Tuple

import torch

from bagualu2.runtime.regions import RegionCall

__all__ = ["AttachedHook"]


def _unattached(*args: Any, **kwargs: Any) -> None:
    """What a copy of a module holds in place of an ``AttachedHook``: a hook that does nothing."""


def _detached() -> Callable[..., None]:
    return _unattached


class AttachedHook:
    """A module hook bagualu2 installs on a user's module (through ``register_forward_*``).

    A copy of the module (``copy.deepcopy``: an EMA or teacher model; ``torch.save`` of the
    whole module) is a plain module: it gets a hook that does nothing in this one's place, so
    it neither runs through nor reports to the original's runtime, and it pickles.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _unattached

    def __reduce__(self) -> Tuple[Callable[[], Callable[..., None]], tuple]:
        return _detached, ()


# One module's hooks: (module, enter, leave, the path of the outermost block it is in or None,
# whether it is a block: held in a ModuleList)
Hooks = Tuple[torch.nn.Module, Callable[..., Any], Callable[..., Any], Optional[str], bool]


class _Attachment:
    """One module tree's hooks (``ActivationRuntime.attach``): installed while traced frames
    run (those inside the given outermost blocks only, when a frame traces only those; or those
    of the blocks themselves, when a frame only reruns blocks), and ``remove()`` takes them off for good, and out of ``attached``, the list of its runtime's
    attachments it was added to."""

    def __init__(self, attached: List["_Attachment"], hooks: List[Hooks], calls: List[Hooks]) -> None:
        self._attached = attached
        self._hooks = hooks
        self._calls = calls  # module.compile()d regions: their hooks go around _compiled_call_impl
        self._handles: List[Any] = []
        self._swapped: List[Tuple[torch.nn.Module, Any]] = []
        # the blocks the installed hooks are limited to, and whether to the blocks' own
        self._blocks: Tuple[Optional[FrozenSet[str]], bool] = (None, False)

    def install(self, on: bool, blocks: Optional[FrozenSet[str]] = None, blocks_only: bool = False) -> None:
        """Put the hooks on (``on``; only those inside the outermost ``blocks`` unless None;
        only the blocks' own with ``blocks_only``) or take them all off."""
        if on and (self._handles or self._swapped) and (blocks, blocks_only) != self._blocks:
            self.install(False)
        if on and not self._handles and not self._swapped:
            self._blocks = (blocks, blocks_only)
            for module, enter, leave, block, is_block in self._hooks:
                if (blocks is not None and block not in blocks) or (blocks_only and not is_block):
                    continue
                self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
                self._handles.append(module.register_forward_hook(leave))
            for module, enter, leave, block, _ in self._calls:
                if blocks is not None and block not in blocks or blocks_only:
                    continue
                compiled = module._compiled_call_impl
                if isinstance(compiled, RegionCall):  # another runtime's, left on: not ours to wrap
                    continue
                module._compiled_call_impl = RegionCall(module, compiled, enter, leave)
                self._swapped.append((module, compiled))
        elif not on:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            for module, compiled in self._swapped:
                module._compiled_call_impl = compiled
            self._swapped = []

    def remove(self) -> None:
        self.install(False)
        if self in self._attached:
            self._attached.remove(self)
