"""The copy engine a provisioner makes: its host arena, what its copies cost, and the arena's
room reserved for offloads.

Owns ``make_engine`` (the ``CopyEngine`` and its ``HostArena``, both on the model's device,
never the current one, unless the user brings one), ``measure_copy_costs`` (the copy path timed as the runtime uses it, for the cost
model) and ``reserve_arena`` (the arena grown in one step to what offloading may need: ``arena_need``).

Invariants: the arena starts small (room for the copy-cost probes and the first offloads) and
may grow only up to half of this process's share of host memory unless the user says
otherwise; the one reservation ahead of need is capped at ``_ARENA_AHEAD_BYTES``, the arena grows
by segments beyond it; a reservation happens between micro-batches, never inside an offload,
whose copies it would hold up for as long as pinning takes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, List, Optional, Tuple

import torch

from bagualu2.inputs import host_memory_bytes, local_processes

__all__ = ["make_engine", "measure_copy_costs", "reserve_arena"]

# The host arena at enable, when the user does not size it: room for the copy-cost probes and
# the first offloads. Once the profiled micro-batches show how large activations get, what
# offloading may need is reserved in one step, up to _ARENA_AHEAD_BYTES (reserve_arena); the
# arena grows by segments beyond that.
_ARENA_START_BYTES = 64 << 20
_ARENA_AHEAD_BYTES = 8 << 30


def make_engine(device: torch.device, arena_bytes: Optional[int], arena_max_bytes: Optional[int]) -> Any:
    """A ``CopyEngine`` over a new ``HostArena`` of ``arena_bytes`` (default: a small start) that
    may grow to ``arena_max_bytes`` (default: half of this process's share of host memory), on
    the backend that serves ``device``."""
    from bagualu2.offload import CopyEngine, HostArena, backend_for_device

    backend = backend_for_device(device)  # meta/cpu models: cpu, never a GPU backend
    if arena_bytes is None:
        arena_bytes = _ARENA_START_BYTES
    if arena_max_bytes is None:
        arena_max_bytes = max(arena_bytes, host_memory_bytes() // (2 * local_processes()))
    # The model's GPU, not the current one, for both: the arena pins, grows and frees its
    # memory with its device's context bound, and under torchrun without set_device every
    # rank's current device is GPU 0.
    gpu = device if backend != "cpu" else None
    arena = HostArena(arena_bytes, backend, max_capacity=arena_max_bytes, device=gpu)
    return CopyEngine(arena, backend, gpu)


def measure_copy_costs(engine: Any, device: torch.device, in_place: bool) -> Tuple[float, float, Tuple[float, float]]:
    """Measure ``engine``'s path as the runtime uses it (offload, wait; reload into a fresh
    ``device`` buffer, or with ``in_place`` the bytes read where they lie) at 64 KiB and 8 MiB:
    bandwidth per direction from the difference, the rest of the small copy's time as a fixed
    cost per copy. Returns (offload bandwidth, reload bandwidth, (offload, reload) fixed
    seconds)."""
    times = {}
    for nbytes in (64 << 10, 8 << 20):
        probe = torch.empty(nbytes, dtype=torch.uint8, device=device)
        samples: List[tuple] = []
        for _ in range(5):
            t0 = time.perf_counter()
            handle = engine.offload(probe)
            if handle is None:
                return 1e9, 1e9, (0.0, 0.0)
            handle.wait()
            t1 = time.perf_counter()
            back = handle.host_view() if in_place else engine.reload(handle)
            if back.is_cuda:
                torch.cuda.current_stream(back.device).synchronize()
            t2 = time.perf_counter()
            del back
            handle.release()
            samples.append((t1 - t0, t2 - t1))
        times[nbytes] = [statistics.median(s[i] for s in samples) for i in (0, 1)]
    small, big = times[64 << 10], times[8 << 20]
    bandwidth = [((8 << 20) - (64 << 10)) / max(1e-9, big[i] - small[i]) for i in (0, 1)]
    fixed = [max(0.0, small[i] - (64 << 10) / bandwidth[i]) for i in (0, 1)]
    return bandwidth[0], bandwidth[1], (fixed[0], fixed[1])


def arena_need(worst_bytes: int, stacked: int, budget: Optional[int], adaptive: bool, offloads: bool) -> int:
    """The host arena's room for offloads once the profiled micro-batches tell how large they
    can get (``worst_bytes``, at the worst routing): the micro-batches in flight (this one and
    the ``stacked`` on it; two at least), less the ``budget`` where the planner keeps what fits
    (``adaptive``; nothing when it all fits), or nothing when a fixed plan never ``offloads``."""
    worst = (1 + max(1, stacked)) * worst_bytes
    if adaptive:
        return worst - budget if budget is not None else 0
    return worst if offloads else 0  # a fixed plan (the named static policies are not profiled)


def reserve_arena(engine: Any, need: int) -> None:
    """Reserve ``need`` bytes of ``engine``'s arena now, at most ``_ARENA_AHEAD_BYTES``, unless it
    has that room already."""
    need = min(need, _ARENA_AHEAD_BYTES)
    if need > engine.arena.capacity:
        engine.arena.reserve(need)
