"""Move torch tensors to pinned host memory and back, asynchronously.

Contract (docs/CONTRACTS.md, "bagualu2.offload"):

    arena = HostArena(capacity_bytes, backend="cpu")        # reserved once, best-fit blocks inside
    engine = CopyEngine(arena)                               # backend defaults to the arena's
    h = engine.offload(t)            -> OffloadHandle | None  # None: the arena has no block that fits
    h.nbytes; h.done(); h.wait(); h.release()
    out = engine.reload(h, out=None, device=None)            # consumer stream waits for the copy
    r = engine.reload_async(h, out=None, device=None); r.done(); r.wait() -> Tensor
    engine.stats()

Invariants kept here (the C++ ones are in csrc/offload/*.h):
  * Round trips are bit-exact and preserve dtype, shape and strides. A tensor whose strides
    cover its memory span densely (contiguous, transposed, channels-last, expanded, ...) is copied
    as that span and rebuilt with the same strides; a view with large gaps is copied compacted
    and rebuilt with `empty_strided(...).copy_()`.
  * The source stays alive until its copy completed: host sources are held by the engine until
    the copy is seen complete; device sources are handed to the caching allocator with
    `record_stream` on the engine's D2H stream, so their memory is reusable as soon as the copy
    ends without any Python call.
  * Dropping an OffloadHandle releases its block (after the copies using it end), so host copies
    live exactly as long as whatever holds the handle (for activations: the autograd graph).
  * No threads are created per call; the per-call Python work is a few attribute reads.
"""
from bagualu2.offload.backends import backend_for_device, backend_status, resolve_backend, torch_gpu_backend
from bagualu2.offload.facade import CopyEngine, HostArena, OffloadHandle, ReloadHandle

__all__ = ["HostArena", "CopyEngine", "OffloadHandle", "ReloadHandle", "backend_for_device",
           "backend_status", "resolve_backend", "torch_gpu_backend"]
