"""The provisioned forward: what ``enable`` puts on a model in place of its own forward, and the
provisioners whose forward runs on each thread.

Owns ``ProvisionedForward`` (the wrapper), ``Wrapping`` (where it went and what it calls),
``plain_forward`` (whether a model's forward is its own), ``unwrap_compiled`` (where the wrapper
goes on a ``torch.compile``d model) and ``active`` (the per-thread stack of running
provisioners, innermost last).

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

__all__ = ["ProvisionedForward", "Wrapping", "active", "plain_forward", "unwrap_compiled"]

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


class Wrapping:
    """Where a provisioner's forward goes on a model, and what it calls: the compile facts found
    at ``enable``.

    ``root`` is the ``torch.compile`` wrapper the provisioned forward goes on (``unwrap_compiled``),
    or None for the model itself; ``regions``, the paths of the compiled regions gates report
    from (``[""]``: the whole model is one); ``root_rerunnable``, whether a compiled root may
    rerun whole (it issues no collective); ``order``, each module's place in the model.
    """

    def __init__(self, model: torch.nn.Module, root: Optional[torch.nn.Module], regions: List[str],
                 root_rerunnable: bool) -> None:
        self.root = root
        self.regions = [""] if root is not None else regions
        self.root_rerunnable = root_rerunnable
        self.order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        self._host = root if root is not None else model
        self.forward = self._host.forward  # the host's own: what the provisioned forward calls

    @property
    def compiled(self) -> bool:
        """Whether the whole model is one compiled region (a ``torch.compile`` wrapper's)."""
        return self.root is not None

    def install(self, run: Callable[..., Any]) -> Callable[[], None]:
        """Put ``run`` on the host as its forward; returns what takes it off again."""
        host = self._host
        host.forward = ProvisionedForward(run, self.forward)  # type: ignore[method-assign]

        def undo() -> None:  # a compiled wrapper gets its compiled forward back; the model, its class's
            if self.root is not None:
                host.forward = self.forward  # type: ignore[method-assign]
            else:
                host.__dict__.pop("forward", None)
        return undo

    def call(self, runtime: Any, args: tuple, kwargs: dict) -> Any:
        """The model's own forward, in the runtime's running frame: a compiled root's call is one
        compiled region (``runtime.regions``, key ``':compiled'``), which a rerun calls again
        where ``root_rerunnable``."""
        if self.root is None:
            return self.forward(*args, **kwargs)
        runtime.regions.enter(self.forward, "", args, kwargs, self.root_rerunnable)
        try:
            return self.forward(*args, **kwargs)
        finally:
            runtime.regions.leave()


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
