"""``Budget``: the device bytes one micro-batch's forward is held to (set by the provisioner,
enforced by the runtime)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["Budget"]


@dataclass(frozen=True)
class Budget:
    """What one micro-batch's forward holds its saved activations to, in device bytes.

    ``limit`` is the budget: only crossing it is a violation. Releases aim lower, at the
    ``target``: ``reserve`` is left for the micro-batches that will stack on this rank before
    this one's backward (pipeline warm-up), and ``pin_headroom`` within the rest for what
    recipes pin and nothing can release (the forward's inputs, labels the loss reads at the
    end), which only those pins may use.
    """

    limit: int
    reserve: int = 0
    pin_headroom: int = 0

    def target(self, pins: bool = False) -> int:
        """Where releases aim: the limit less the reserve, less the pin headroom unless the
        bytes are ``pins`` it is left for."""
        return max(0, self.limit - self.reserve - (0 if pins else self.pin_headroom))

    @functools.cached_property
    def save_target(self) -> int:
        """``target()``, where every save aims: computed once (the budget is frozen), read at
        each save of a calm forward."""
        return self.target()
