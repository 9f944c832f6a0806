"""The Python facades over the C++ host arena and copy engine (csrc/offload): tensors in,
handles out; the invariants are in this package's docstring."""
from __future__ import annotations

import collections
import operator
from typing import Any, List, Optional, Sequence, Union

import torch

from bagualu2._C import CopyEngine as NativeCopyEngine, HostArena as NativeHostArena, Ticket as NativeTicket
from bagualu2.offload.backends import resolve_backend

__all__ = ["HostArena", "CopyEngine", "OffloadHandle", "ReloadHandle"]

_SPAN = 0  # payload = the tensor's memory span, rebuilt with as_strided semantics
_COMPACT = 1  # payload = tensor.contiguous(), rebuilt with empty_strided(...).copy_()


def _stream_handle(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"stream must be an int handle or have .cuda_stream/.handle, got {type(stream)}")


def _device_index(device: Union[int, str, torch.device, None]) -> int:
    """The cuda device index of ``device`` (None: torch's current device)."""
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"a gpu backend needs a cuda device, got {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _positive_bytes(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    value = operator.index(value)  # ints and numpy ints; TypeError otherwise
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class HostArena:
    """Pinned host memory reserved up front; best-fit blocks with splitting and coalescing.

    ``capacity_bytes`` are reserved now. With ``max_capacity`` (bytes, at least
    ``capacity_bytes``) a request that fits no free block reserves one more segment, at least as
    large as the arena so far, until ``max_capacity`` is reached; ``reserve`` grows it ahead of
    need. Segments are kept until the arena dies. ``allocate``/``free`` are the raw block
    interface (addresses as ints); tensors go through :class:`CopyEngine`.

    The memory is portable: engines of every device copy through it. On a gpu backend it is
    reserved and freed in the context of ``device`` (default: torch's current device), a device
    the process already uses, never device 0 by default.
    """

    __slots__ = ("_impl", "__weakref__")

    def __init__(self, capacity_bytes: int, backend: str = "cpu", max_capacity: Optional[int] = None,
                 device: Union[int, str, torch.device, None] = None) -> None:
        capacity_bytes = _positive_bytes("capacity_bytes", capacity_bytes)
        if max_capacity is None:
            max_capacity = 0
        else:
            max_capacity = _positive_bytes("max_capacity", max_capacity)
            if max_capacity < capacity_bytes:
                raise ValueError(f"max_capacity={max_capacity} is below capacity_bytes={capacity_bytes}: "
                                 f"pass at least capacity_bytes, or None for an arena that does not grow")
        backend = resolve_backend(backend)
        index = _device_index(device) if backend != "cpu" else -1
        self._impl = NativeHostArena(capacity_bytes, backend, max_capacity, index)

    @property
    def capacity(self) -> int:
        """Bytes reserved so far (all segments)."""
        return self._impl.capacity

    @property
    def max_capacity(self) -> int:
        """Bytes the arena may grow to (its capacity when it does not grow)."""
        return self._impl.max_capacity

    @property
    def segments(self) -> List[tuple]:
        """(base address, bytes) of every reserved segment, oldest first."""
        return self._impl.segments

    @property
    def backend(self) -> str:
        return self._impl.backend

    @property
    def alignment(self) -> int:
        return NativeHostArena.alignment

    def allocate(self, nbytes: int) -> Optional[int]:
        """Address of a new block of at least ``nbytes`` bytes, or None when none fits."""
        return self._impl.allocate(nbytes)

    def reserve(self, nbytes: int) -> bool:
        """Grow the capacity to ``nbytes`` now, with one segment of what is missing (up to
        ``max_capacity``), so offloads later find the room without reserving it themselves.
        Returns whether the arena holds at least ``nbytes``."""
        return self._impl.reserve(_positive_bytes("nbytes", nbytes))

    def free(self, ptr: int, after: Sequence[Any] = ()) -> None:
        """Free a block; it is reused only once every fence (or ticket) in ``after`` is ready."""
        fences = [f.fence if isinstance(f, NativeTicket) else f for f in after]
        self._impl.free(ptr, [f for f in fences if f is not None])

    def stats(self) -> dict:
        """capacity, max_capacity, segments, in_use, pending, peak_in_use, largest_free_block,
        free, fragmentation, num_blocks, num_allocs, num_frees, num_failed."""
        return self._impl.stats()

    def reset_stats(self) -> None:
        """Peak := current use; counters := 0."""
        self._impl.reset_stats()

    def __repr__(self) -> str:
        s = self._impl.stats()
        grows = f", max_capacity={s['max_capacity']}" if s["max_capacity"] > s["capacity"] else ""
        return f"HostArena(capacity={s['capacity']}{grows}, in_use={s['in_use']}, backend={self.backend!r})"


class OffloadHandle:
    """A tensor's bytes in (or on their way to) the host arena."""

    __slots__ = ("_engine", "_ticket", "nbytes", "dtype", "shape", "stride", "device", "_mode",
                 "__weakref__")

    def __init__(self, engine: "CopyEngine", ticket: Any, nbytes: int, t: torch.Tensor,
                 mode: int) -> None:
        self._engine = engine
        self._ticket = ticket
        self.nbytes = nbytes
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        self.device = t.device
        self._mode = mode

    def done(self) -> bool:
        """Whether the offload copy completed (the source may be reused). Raises after release,
        and RuntimeError once the copy ended failed (the source holds the only copy then)."""
        return self._ticket.done()

    def wait(self) -> None:
        """Block until the offload copy completed (GIL released). Raises after release, and
        RuntimeError when the copy failed."""
        self._ticket.wait()
        self._engine.prune()

    def release(self) -> None:
        """Free the host block (reused only after the copies using it end). Raises if released."""
        self._ticket.release()

    def host_view(self) -> torch.Tensor:
        """The offloaded tensor where its bytes lie in the arena: a cpu tensor equal to what
        ``reload(h, device="cpu")`` returns, without the copy back (what a host consumer
        reads). Waits for the offload copy. The tensor and every view of it hold the block:
        ``release()`` meanwhile frees it when the last of them dies. Writing through it
        changes what later reloads return. A tensor offloaded with negative or overlapping
        strides comes back contiguous."""
        self.wait()
        if not self.nbytes:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        flat = torch.frombuffer(self._ticket.host_view(), dtype=self.dtype)
        if self._mode == _SPAN:
            return flat.as_strided(self.shape, self.stride)
        return flat.view(self.shape)

    @property
    def released(self) -> bool:
        return self._ticket.released

    @property
    def host_ptr(self) -> int:
        """Address of the arena block holding the bytes (how ``CopyEngine.trace`` names it)."""
        return self._ticket.host_ptr

    def __repr__(self) -> str:
        state = "released" if self._ticket.released else ("done" if self._ticket.finished else "copying")
        return (f"OffloadHandle(nbytes={self.nbytes}, dtype={self.dtype}, shape={tuple(self.shape)}, "
                f"{state})")


class ReloadHandle:
    """A reload in flight; ``wait()`` returns the tensor, ready for the current stream."""

    __slots__ = ("_engine", "_ticket", "_result", "_staging", "_allocated_on")

    def __init__(self, engine: "CopyEngine", ticket: Any, result: torch.Tensor,
                 staging: Optional[torch.Tensor], allocated_on: Any) -> None:
        self._engine = engine
        self._ticket = ticket
        self._result = result
        self._staging = staging
        self._allocated_on = allocated_on  # the torch stream the destination belongs to (gpu)

    def done(self) -> bool:
        """Whether the reload copy completed."""
        return self._ticket.done()

    @property
    def destination(self) -> torch.Tensor:
        """The device buffer the copy writes (valid to read only after ``wait()``)."""
        if self._result is None:
            raise ValueError("ReloadHandle.destination after wait(): the tensor was already returned")
        return self._staging if self._staging is not None else self._result

    def wait(self, stream: Any = None) -> torch.Tensor:
        """Make the consumer (``stream`` or the current stream; on cpu the calling thread) wait
        for the copy and return the reloaded tensor. A consumer stream other than the one the
        tensor was allocated on is recorded on it (``record_stream``), so the caching allocator
        does not reuse its memory before the consumer's work ends."""
        result = self._result
        if result is None:
            raise ValueError("ReloadHandle.wait() called twice: the tensor was already returned")
        consumer = self._engine._consume(self._ticket, result, stream)
        if consumer is not None and consumer.cuda_stream != self._allocated_on.cuda_stream:
            result.record_stream(consumer)
            if self._staging is not None:
                self._staging.record_stream(consumer)
        if self._staging is not None:
            self._engine._unstage(self._staging, result, consumer)
            self._staging = None
        self._result = None
        return result


class CopyEngine:
    """Asynchronous device-to-host (offload) and host-to-device (reload) copies of tensors.

    Args:
        arena: the host arena offloads allocate from.
        backend: ``"cpu"``, ``"cuda"`` or ``"hip"`` (default: the arena's).
        device: the device whose tensors it copies (gpu backends; default: the current one).
        chunk_bytes: largest single copy enqueued on a stream (default: the backend's, 4 MiB
            on cpu and 16 MiB on gpus).
    """

    def __init__(self, arena: HostArena, backend: Optional[str] = None,
                 device: Union[int, str, torch.device, None] = None,
                 chunk_bytes: Optional[int] = None) -> None:
        if not isinstance(arena, HostArena):
            raise TypeError(f"arena must be a bagualu2.HostArena, got {type(arena).__name__}")
        backend = arena.backend if backend is None else resolve_backend(backend)
        if backend != arena.backend:
            raise ValueError(f"CopyEngine backend {backend!r} differs from the arena's {arena.backend!r}")
        self.arena = arena
        self.backend = backend
        self._gpu = backend != "cpu"
        index = -1
        if self._gpu:
            index = _device_index(device)
            self.device = torch.device("cuda", index)
        else:
            if device is not None and torch.device(device).type != "cpu":
                raise ValueError(f"the cpu backend copies cpu tensors only, got device={device}")
            self.device = torch.device("cpu")
        self._impl = NativeCopyEngine(arena._impl, backend, index, chunk_bytes)
        self.chunk_bytes: int = self._impl.chunk_bytes
        self._inflight: collections.deque = collections.deque()  # (ticket, host tensor kept alive)
        if self._gpu:
            self._d2h = torch.cuda.ExternalStream(self._impl.d2h_stream, device=self.device)
            self._h2d = torch.cuda.ExternalStream(self._impl.h2d_stream, device=self.device)

    @property
    def d2h_stream(self) -> Optional[torch.cuda.Stream]:
        """The device stream offload copies run on, in submission order (None on the cpu
        backend): work queued on it runs in order with them."""
        return self._d2h if self._gpu else None

    @property
    def h2d_stream(self) -> Optional[torch.cuda.Stream]:
        """The device stream reload copies run on, in submission order (None on the cpu
        backend)."""
        return self._h2d if self._gpu else None

    # -- offload -------------------------------------------------------------------------------
    def offload(self, t: torch.Tensor, stream: Any = None) -> Optional[OffloadHandle]:
        """Start copying ``t`` into a new arena block once ``stream`` (default: the current
        stream of ``t``'s device) has produced it. Returns None when the arena has no block."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"offload expects a torch.Tensor, got {type(t).__name__}")
        if self._inflight:
            self.prune()
        on_device = t.is_cuda
        if on_device and not self._gpu:
            raise ValueError(f"the cpu backend cannot copy a tensor on {t.device}")
        if on_device:
            self._check_device(t.device, "offload of a tensor")
        # The producer: a torch stream of t's device (None for a host tensor).
        producer_stream = self._torch_stream(stream, t.device) if on_device else None
        producer = producer_stream.cuda_stream if on_device else _stream_handle(stream)
        if t.is_contiguous():
            src = t
            mode = _SPAN
            span = t.numel()
        else:
            # Compacted on the producer stream: t is complete there, and the copy below waits
            # for that stream only (on the current one it could read the buffer unwritten).
            with torch.cuda.stream(producer_stream):  # None (a host tensor): no-op
                src, mode, span = self._layout(t)
        nbytes = span * t.element_size() if mode == _SPAN else t.numel() * t.element_size()
        ticket = self._impl.offload(src.data_ptr() if nbytes else 0, nbytes, producer)
        if ticket is None:
            return None
        if nbytes:
            if on_device:
                src.record_stream(self._d2h)
            else:
                self._inflight.append((ticket, src))
        return OffloadHandle(self, ticket, nbytes, t, mode)

    @staticmethod
    def _layout(t: torch.Tensor):
        if any(s < 0 for s in t.stride()):
            return t.contiguous(), _COMPACT, t.numel()
        numel = t.numel()
        if numel == 0:
            return t, _SPAN, 0
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if span <= 2 * numel:
            return t, _SPAN, span
        return t.contiguous(), _COMPACT, numel

    # -- reload --------------------------------------------------------------------------------
    def reload(self, h: OffloadHandle, out: Optional[torch.Tensor] = None,
               device: Union[str, torch.device, None] = None, stream: Any = None) -> torch.Tensor:
        """Copy ``h``'s bytes back; the consumer ``stream`` (default: current) waits for them
        (on cpu the call returns when the data is there)."""
        ticket, result, staging, consumer, _ = self._start_reload(h, out, device, stream, waits=True)
        if not result.is_cuda:
            ticket.wait()  # a host consumer is the calling thread
        if staging is not None:
            self._unstage(staging, result, consumer)
        return result

    def reload_async(self, h: OffloadHandle, out: Optional[torch.Tensor] = None,
                     device: Union[str, torch.device, None] = None,
                     stream: Any = None) -> ReloadHandle:
        """Start copying ``h``'s bytes back (prefetch); ``wait()`` on the result hands the
        tensor to the consumer. Without ``out=`` the destination is allocated on the reload
        stream, so the copy starts at once instead of after the work already queued on the
        consumer stream."""
        ticket, result, staging, _, allocated_on = self._start_reload(h, out, device, stream, waits=False)
        target = staging if staging is not None else result
        if target.is_cuda:
            target.record_stream(self._h2d)  # the allocator may not reuse it before the copy ends
        elif ticket.nbytes:
            self._inflight.append((ticket, target))  # freeing it mid-copy would corrupt the heap
        return ReloadHandle(self, ticket, result, staging, allocated_on)

    def _start_reload(self, h, out, device, stream, waits):
        if not isinstance(h, OffloadHandle):
            raise TypeError(f"reload expects an OffloadHandle, got {type(h).__name__}")
        if h._engine is not self:
            raise ValueError("this OffloadHandle belongs to another CopyEngine")
        if h._ticket.released:
            raise ValueError("reload of a released OffloadHandle (use after release)")
        if self._inflight:
            self.prune()
        dev = h.device if device is None else torch.device(device)
        if dev.type == "cuda" and not self._gpu:
            raise ValueError(f"the cpu backend cannot reload into {dev}")
        if dev.type == "cuda":
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
            self._check_device(dev, "reload into")
        staging = None
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if not out.is_contiguous():
                raise ValueError("reload out= must be contiguous: it receives the raw payload bytes")
            if out.is_cuda and not self._gpu:
                raise ValueError(f"the cpu backend cannot reload into {out.device}")
            if out.is_cuda:
                self._check_device(out.device, "reload into out= on")
            cap = out.numel() * out.element_size()
            if cap < h.nbytes:
                raise ValueError(f"reload destination too small: out holds {cap} bytes, "
                                 f"the handle has {h.nbytes} bytes")
            result = dst = out
        target_device = out.device if out is not None else dev
        # The consumer: a torch stream on the destination's device (None for a host consumer).
        consumer = self._torch_stream(stream, target_device) if target_device.type == "cuda" else None
        # The stream the destination belongs to, which the copy orders itself after: the
        # consumer's for out= (its earlier work may still read it) and for a reload the
        # consumer waits for at once; the reload stream's own for a prefetch, which then waits
        # for nothing queued on the consumer (the consumer waits at wait(), and records it).
        allocated_on = consumer
        if out is None and consumer is not None and not waits:
            allocated_on = self._h2d
        if out is None:
            with torch.cuda.stream(allocated_on):  # None (a host consumer): no-op
                if h._mode == _SPAN:
                    result = dst = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=dev)
                else:
                    staging = dst = torch.empty(h.shape, dtype=h.dtype, device=dev)
                    result = torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=dev)
            cap = h.nbytes
        handle = allocated_on.cuda_stream if allocated_on is not None else _stream_handle(stream)
        ticket = self._impl.reload(h._ticket, dst.data_ptr() if h.nbytes else 0, cap, handle, waits)
        return ticket, result, staging, consumer, allocated_on

    def _check_device(self, device: torch.device, what: str) -> None:
        # torch's stream handle 0 means every device's default stream, and the engine's copies
        # order against its own device's streams only: another device's tensor would be copied
        # without waiting for its producer, or handed to a consumer that does not wait.
        if device != self.device:
            raise ValueError(f"{what} {device} on the CopyEngine of {self.device}: use an engine "
                             f"(and its arena) created with device={device.index}")

    def _torch_stream(self, stream: Any, device: torch.device):
        """The torch stream a gpu producer writes or consumer reads on: ``stream`` (a torch
        stream, or a raw handle of ``device``) or the current stream of ``device``."""
        if stream is None:
            return torch.cuda.current_stream(device)
        if isinstance(stream, torch.cuda.Stream):
            if stream.device != device:
                raise ValueError(f"stream on {stream.device}, tensor on {device}")
            return stream
        handle = _stream_handle(stream)
        if handle == 0:
            return torch.cuda.default_stream(device)
        return torch.cuda.ExternalStream(handle, device=device)

    def _consume(self, ticket: Any, result: torch.Tensor, stream: Any):
        """Makes the consumer wait for the copy; returns its torch stream (None on the host)."""
        if result.is_cuda:
            consumer = self._torch_stream(stream, result.device)
            self._impl.wait_on(ticket, consumer.cuda_stream)
            return consumer
        ticket.wait()
        self.prune()
        return None

    @staticmethod
    def _unstage(staging: torch.Tensor, result: torch.Tensor, consumer: Any) -> None:
        # The strided rebuild runs on the consumer stream, the one that waited for the copy.
        with torch.cuda.stream(consumer):  # None (a host consumer): no-op
            result.copy_(staging)

    # -- housekeeping --------------------------------------------------------------------------
    def prune(self) -> None:
        """Drop what the engine keeps for copies that completed (oldest first): their host
        tensors, and the tickets of handles that died meanwhile, whose blocks go back to the
        arena with them."""
        q = self._inflight
        while q and q[0][0].finished:
            q.popleft()

    def synchronize(self) -> None:
        """Block until every copy enqueued so far completed (GIL released)."""
        self._impl.synchronize()
        self.prune()

    def stats(self) -> dict:
        """Per direction (d2h_*, h2d_*): bytes, copies, busy_s, bytes_submitted, failed (copies
        that failed, counted in nothing else), untimed (copies that ended but whose time the
        runtime could not give, counted in nothing else), GBps; plus in_flight (host tensors
        still held for running copies)."""
        s = self._impl.stats()
        s["in_flight"] = len(self._inflight)
        return s

    def reset_stats(self) -> None:
        self._impl.reset_stats()

    def start_trace(self, capacity: int = 1 << 16) -> None:
        """Record every copy submitted from now on (up to ``capacity``; clears an earlier trace)."""
        if capacity < 0:
            raise ValueError(f"trace capacity={capacity} must be >= 0")
        self._impl.start_trace(int(capacity))

    def stop_trace(self) -> None:
        self._impl.stop_trace()

    def trace(self) -> List[dict]:
        """Copies submitted since ``start_trace()``, in the order they entered their streams:
        dicts with ``seq``, ``direction`` (``"d2h"`` offload, ``"h2d"`` reload), ``host_ptr``
        (the arena block, see ``OffloadHandle.host_ptr``), ``nbytes`` and ``submit_s``."""
        return self._impl.trace()

    def __del__(self) -> None:
        try:
            self._impl.synchronize()  # copies must end before the tensors they touch are freed
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"CopyEngine(backend={self.backend!r}, device={self.device}, arena={self.arena!r})"
