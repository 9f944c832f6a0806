"""The provisioned forward: what ``enable`` puts on a model in place of its own forward, and the
provisioners whose forward runs on each thread.

Owns ``ProvisionedForward`` (the wrapper), ``plain_forward`` (whether a model's forward is its
own), ``unwrap_compiled`` (where the wrapper goes on a ``torch.compile``d model) and ``active`` (the per-thread stack of running provisioners, innermost last).

Invariants: a routing report (``on_gating``) belongs to the thread that makes it, and so to the
model that thread runs: the stack is per thread, and a provisioner is on it only while its
forward runs (one an interrupt left there has no active frame, and is skipped). A copy of a
provisioned model (``copy.deepcopy``, or ``torch.save`` of the whole module) gets the model's own
forward back: a plain model, never one that runs through the original.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, List, Optional, Tuple

import torch

from bagualu2.runtime.regions import check_compile_options, is_compiled

__all__ = ["ProvisionedForward", "active", "plain_forward", "unwrap_compiled"]

_LOCAL = threading.local()


def active() -> List[Any]:
    """The provisioners whose forward is running on this thread, innermost last."""
    stack = getattr(_LOCAL, "active", None)
    if stack is None:
        stack = _LOCAL.active = []
    return stack


class ProvisionedForward:
    """The provisioned forward bagualu2 puts on a model in place of its own.

    Under torch.compile it runs eagerly: the tracing mode, the saved-tensor hooks and the gating
    callbacks are Python that Dynamo would otherwise try to trace, graph-breaking and
    recompiling at every op. A copy of the model (``copy.deepcopy``, or ``torch.save`` of the
    whole module) gets the model's own forward back: the copy is a plain model, not one that
    runs through the original (with the original's parameters).
    """

    __slots__ = ("run", "original")
    _hidden_from_dynamo = False  # __call__ wrapped by torch.compiler.disable, at the first enable()

    def __init__(self, run: Callable[..., Any], original: Callable[..., Any]) -> None:
        cls = type(self)
        if not cls._hidden_from_dynamo:  # here, not at import: it imports torch._dynamo (about 1 s)
            cls.__call__ = torch.compiler.disable(cls.__call__)  # type: ignore[method-assign]
            cls._hidden_from_dynamo = True
        self.run = run
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., Any]:
        return copy.deepcopy(self.original, memo)  # a bound method: bound to the copy

    def __reduce__(self) -> Tuple[Any, tuple]:
        return _same, (self.original,)  # pickled as the bound method it is


def _same(x: Any) -> Any:
    return x


def plain_forward(model: torch.nn.Module) -> bool:
    """Whether the forward in ``model.__dict__`` is the class's own, bound to ``model`` (what a
    copy of a provisioned model holds)."""
    forward = model.__dict__.get("forward")
    return (getattr(forward, "__self__", None) is model
            and getattr(forward, "__func__", None) is getattr(type(model), "forward", None))


def unwrap_compiled(model: torch.nn.Module) -> Tuple[Optional[torch.nn.Module], torch.nn.Module]:
    """``(wrapper, the module it wraps)`` for a ``torch.compile(model)`` wrapper, else ``(None,
    model)``. The whole forward is then one compiled region, called by the wrapper: the
    provisioned forward goes on the wrapper, around the compiled call (never inside it).

    Raises:
        RuntimeError: the wrapper is provisioned already.
        ValueError: it was compiled with an option that stays refused (``check_compile_options``).
    """
    wrapped = getattr(model, "_orig_mod", None)
    if not (isinstance(wrapped, torch.nn.Module) and is_compiled(model)):
        return None, model
    if isinstance(model.__dict__.get("forward"), ProvisionedForward):
        raise RuntimeError(f"this compiled {type(wrapped).__name__} already has bagualu2 enabled; call "
                           f"disable() on the existing Provisioner first")
    check_compile_options(model, f"the model ({type(wrapped).__name__})")
    return model, wrapped
