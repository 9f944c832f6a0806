"""``Teardown``: what a provisioner undoes when disabled, its own wiring and its integrations'.

One mechanism for one need: the provisioner's hooks and forward wrapper, and what an engine or
pipeline integration wires around it (``Provisioner.on_disable``), are undone by one list.

Invariants: each function runs once, in reverse order of registration (what was wired last is
undone first, as nested ``with`` blocks would); when one raises, the others still run, and the
first error is raised once they all have; nothing is added once the list has run.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

__all__ = ["Teardown"]


class Teardown:
    """Functions to call once each, last first (the module note)."""

    def __init__(self) -> None:
        self._fns: List[Callable[[], Any]] = []
        self.done = False

    def add(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` at :meth:`run`.

        Raises:
            RuntimeError: the list has run already (nothing would call ``fn``).
        """
        if self.done:
            raise RuntimeError(f"{fn!r} registered for a teardown that has run already (the provisioner is "
                               f"disabled): undo what it undoes directly")
        if not callable(fn):
            raise TypeError(f"a teardown function must be callable, got {type(fn).__name__}")
        self._fns.append(fn)

    def run(self) -> None:
        """Call every function, last first; then raise the first error one raised, if any."""
        self.done = True
        error: Optional[BaseException] = None
        while self._fns:
            try:
                self._fns.pop()()
            except BaseException as e:  # the rest still run: a half-undone model is worse
                error = error or e
        if error is not None:
            raise error
