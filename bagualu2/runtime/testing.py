"""Testing hooks of the activation runtime: for tests and fault injection, not for training.

Owns ``wrap_step``, which runs a test's wrapper in place of one of an ``ActivationRuntime``'s
internal steps (to interrupt it, count its calls, or force a path), and ``STEPS``, the steps it
can name. Listed in docs/CONTRACTS.md under "Testing hooks". The steps' signatures are the
runtime's own and change with it; a wrapper passes its arguments through unchanged.

Invariant: nothing here runs unless a test calls it; the runtime looks each step up on the
instance as it calls it, so a wrapper sees every later call on that runtime, and undoing it
leaves the runtime as it was.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

__all__ = ["STEPS", "wrap_step"]

# step -> the runtime's method it names
STEPS: Dict[str, str] = {
    "pack_hook": "_pack",            # the saved-tensor pack hook of traced frames: (tensor) -> packed
    "calm_pack_hook": "_pack_calm",  # ... of untraced frames: keeps the common case, else calls pack_hook
    "pack": "_pack_in",              # the pack hook's bookkeeping, inside its scopes: (frame, tensor)
    "offload": "_start_offload",     # an offload's start: (frame, storage, key) -> store or None
    "unpack_hook": "_unpack",        # the saved-tensor unpack hook: (packed) -> tensor
    "close_frame": "_close_frame",   # a frame's cleanup as its forward ends: (frame)
}


def wrap_step(runtime: Any, step: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Testing hook: until the returned function is called, ``runtime`` (an
    ``ActivationRuntime``) runs ``wrapper(original)`` wherever it runs ``step`` (a key of
    ``STEPS``). For fault injection (an interrupt at a named point of a step) and for tests
    that count or force a path; never needed to train. The hook functions a frame installs are
    taken as it starts: wrap ``pack_hook``, ``calm_pack_hook`` or ``unpack_hook`` before it.
    The returned function puts back what ``step`` was before this wrap."""
    if step not in STEPS:
        raise ValueError(f"unknown runtime step {step!r}; one of {sorted(STEPS)}")
    name = STEPS[step]
    own = runtime.__dict__
    wrapped, previous = name in own, own.get(name)
    setattr(runtime, name, wrapper(getattr(runtime, name)))

    def undo() -> None:
        if wrapped:
            setattr(runtime, name, previous)
        else:
            own.pop(name, None)

    return undo
