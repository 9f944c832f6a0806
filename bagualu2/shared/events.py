"""``Event``: an extension point any number of parties subscribe to, each one heard.

The runtime announces what integrations and tools follow (a frame starting, a released
activation unpacked, a backward pass ending, a saved-tensor hook timed, an operator's first
save) through events instead of single callback slots: a second party subscribing leaves the
first subscribed, and each one removes only its own subscription.

Invariants:

* Subscribers are called in subscription order (a prepended one first), each once per emission, with the event's
  arguments; a subscriber's exception propagates from the emitting point (the subscribers after
  it are not called for that emission), as a single callback's would.
* An emission calls the subscribers present when it began: subscribing or unsubscribing
  inside a subscriber takes effect from the next emission.
* With no subscriber an emitting point costs one truth test of ``subscribers`` (an empty tuple),
  which is how hot paths guard an emission.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

__all__ = ["Event", "Subscription"]


class Subscription:
    """One subscriber of an ``Event``: ``unsubscribe()`` removes it (again: nothing), and a
    ``with`` block around the subscription unsubscribes at its end."""

    __slots__ = ("event", "fn")

    def __init__(self, event: "Event", fn: Callable[..., Any]) -> None:
        self.event = event
        self.fn = fn

    @property
    def active(self) -> bool:
        """Whether ``fn`` is still called on emissions."""
        return any(s is self for s in self.event.entries)

    def unsubscribe(self) -> None:
        """Stop calling ``fn``; the event's other subscribers stay."""
        self.event.entries = tuple(s for s in self.event.entries if s is not self)
        self.event.subscribers = tuple(s.fn for s in self.event.entries)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.unsubscribe()


class Event:
    """Subscribers to one named event, called in subscription order (the module note).

    ``subscribers`` is the tuple of functions an emission calls: empty (false) when nobody
    listens, for the emitting point to skip the call."""

    __slots__ = ("name", "entries", "subscribers")

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: Tuple[Subscription, ...] = ()
        self.subscribers: Tuple[Callable[..., Any], ...] = ()

    def subscribe(self, fn: Callable[..., Any], prepend: bool = False) -> Subscription:
        """Call ``fn`` with the event's arguments on every emission from now on, after the
        subscribers already there (``prepend``: before them), until the returned subscription's
        ``unsubscribe()``. The same function subscribed twice is called twice."""
        if not callable(fn):
            raise TypeError(f"a subscriber of {self.name!r} must be callable, got {type(fn).__name__}")
        subscription = Subscription(self, fn)
        self.entries = (subscription,) + self.entries if prepend else self.entries + (subscription,)
        self.subscribers = tuple(s.fn for s in self.entries)
        return subscription

    def emit(self, *args: Any) -> None:
        """Call each subscriber with ``args``."""
        for fn in self.subscribers:
            fn(*args)

    def __repr__(self) -> str:
        return f"Event({self.name!r}, {len(self.subscribers)} subscriber(s))"
