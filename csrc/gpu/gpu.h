// The neutral gpu:: runtime API: streams, events, pinned host memory, async copies.
//
// Design note
// -----------
// bagualu2's C++ core never includes a vendor header. Everything talks to a `gpu::Runtime`, an
// interface of real wrapper functions (no `#define cudaX hipX`), with two implementations:
//
//   cpu_backend.cpp     always built. A stream is one worker thread executing its operations in
//                       FIFO order (on an idle stream, the submitting thread runs them at
//                       once); large copies are split across a shared pool of copy threads
//                       (the thread running the copy joins in) and the stream moves on only
//                       when every piece is done. Each record of an event is a fresh completion
//                       flag with a timestamp; a wait captures the record current at the call.
//                       Stream handle 0 means "the calling host thread": work on it runs
//                       synchronously, and recording an event on it completes the event at once.
//   device_backend.cpp  one implementation for every GPU runtime, over a table of function
//                       pointers (gpu/device_api.h). The table is filled at first use by
//                       dlopen: cuda_api.cpp from the CUDA driver API (libcuda.so.1, shipped
//                       with the NVIDIA driver, so nothing ties the build to a cudart version),
//                       hip_api.cpp from the HIP runtime (libamdhip64.so; AMD GPUs, Hygon
//                       DCUs). Their prototypes are declared locally (gpu/cuda_abi.h,
//                       gpu/hip_abi.h), so building needs no GPU toolkit; CI checks them
//                       against the vendor headers (gpu/check_abi.cpp).
//
// The backend is chosen at run time, per object, by name ("cpu", "cuda", "hip") through
// `gpu::runtime(name)`. A name that was not compiled in throws bagualu2::Error (Python
// ValueError) naming the compiled backends; a compiled GPU backend whose library is missing, or
// that sees no device, throws bagualu2::RuntimeError saying which library was looked for and
// how to get it. `backend_status()` reports the same without throwing. A library is looked
// for once per process (the first runtime() or backend_status() call).
//
// Devices and threads. The CUDA driver binds work to a per-thread current context, and
// bagualu2's objects are used, and finalized, on any thread (the garbage collector's, torch's
// autograd threads). So every call that acts on an object runs inside a DeviceGuard for the
// object's own device: it binds that device, and gives the thread back exactly what it had,
// nothing included (gpu/cuda_api.cpp). Nothing binds a device by default; an object's device
// is fixed when it is created (an explicit index, or the caller's current device, refused
// when the thread has none).
//
// Streams handed to torch. A copy engine's streams reach torch (ExternalStream,
// tensor.record_stream): torch's caching allocator records an event on such a stream when a
// tensor recorded on it is freed, inside a storage deleter, where an error is fatal, possibly
// long after the engine died. So GPU copy streams are process-wide, one per (device,
// direction), created on first use and never destroyed, as torch's own stream pool keeps its
// streams (copy_stream() below). The cpu backend's streams are worker threads torch never
// sees; each engine owns and joins its own (UniqueStream).
//
// Fork. A child forked after a runtime was created inherits its handles but not what backs
// them: CUDA and HIP contexts do not survive fork(), and neither do the cpu backend's worker
// threads (DataLoader workers fork). pthread_atfork (runtime.cpp) counts forks; every runtime
// remembers the count it was created at, and in a later child every call that needs the
// device or a worker refuses with a RuntimeError saying so (`check_not_forked`), before
// reaching the driver, so the child neither hangs nor talks to its parent's contexts. A child
// forked before a runtime was created uses it as a fresh process would.
//
// Invariants every backend keeps:
//   * Operations enqueued on one stream execute in enqueue order.
//   * An event that was never recorded reports complete (as in CUDA).
//   * `event_query` never blocks; `event_synchronize` and `stream_synchronize` block the caller
//     (callers release the GIL around them). Both throw bagualu2::WorkFailed (common/check.h)
//     only when the runtime reports that the work before the event failed on the device (it
//     ended); any other failure of theirs is a plain RuntimeError and says nothing about the
//     work (offload/fence.h keeps such a block pending).
//   * Raw handles are opaque integers-as-pointers. Whatever this library creates is owned by
//     a UniqueStream or UniqueEvent (below), or an EventPool (offload/fence.h: the copies'
//     timing events, destroyed with the pool), never by a bare handle, so a constructor that
//     throws half-way leaks nothing, except the process-wide copy streams, which are never
//     destroyed on purpose. Runtime failures throw bagualu2::RuntimeError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace bagualu2::gpu {

// Opaque stream and event handles (CUstream / hipStream_t / cpu objects).
using Stream = void*;
using Event = void*;

// The runtime interface one backend implements. Instances are process-wide singletons.
class Runtime {
public:
    virtual ~Runtime() = default;

    /// Backend name: "cpu", "cuda" or "hip".
    virtual const char* name() const = 0;

    /// True for the cpu backend, where stream 0 is the calling host thread and every
    /// "device" pointer is ordinary host memory.
    virtual bool is_host() const = 0;

    /// Number of devices visible to this backend (1 for cpu; 0 when no GPU is present).
    virtual int device_count() = 0;

    /// Current device of the calling thread, -1 when it has none (CUDA: no current context).
    virtual int get_device() = 0;

    /// Make `device` current for the calling thread (DeviceGuard's half; use DeviceGuard).
    /// \param[in] device  device index in [0, device_count()).
    /// \return what was current before, for restore() (CUDA: the raw context, 0 for none).
    virtual std::uintptr_t bind(int device) = 0;

    /// Make current again what bind() returned (none included).
    /// \param[in] previous  bind()'s result.
    virtual void restore(std::uintptr_t previous) = 0;

    /// Allocate page-locked host memory (page-aligned on cpu).
    /// \param[in] bytes  number of bytes, > 0.
    /// \return the allocation; throws RuntimeError when the runtime refuses.
    virtual void* host_alloc(std::size_t bytes) = 0;

    /// Free memory returned by host_alloc.
    /// \param[in] ptr  pointer returned by host_alloc of this runtime.
    virtual void host_free(void* ptr) = 0;

    /// Create a non-blocking stream on the current device.
    virtual Stream stream_create() = 0;

    /// Destroy a stream created by stream_create; pending work still completes first.
    /// \param[in] stream  stream to destroy.
    virtual void stream_destroy(Stream stream) = 0;

    /// Block the caller until all work enqueued on `stream` has completed.
    /// \param[in] stream  stream handle (0: the default/legacy stream; on cpu a no-op).
    virtual void stream_synchronize(Stream stream) = 0;

    /// Make all future work on `stream` wait until `event`'s latest record has completed.
    /// \param[in] stream  the waiting stream.
    /// \param[in] event   the event; an event never recorded imposes no wait.
    virtual void stream_wait_event(Stream stream, Event event) = 0;

    /// Throws bagualu2::Error when `stream` is not a live stream of `device` (cpu checks its
    /// registry of live streams; CUDA asks the driver which context a non-null handle belongs
    /// to; HIP asks hipStreamGetDevice where the runtime has it (ROCm 6), else accepts every
    /// handle). Handle 0 is the current device's default stream, so callers check it, and
    /// use it, inside a DeviceGuard for `device`.
    /// \param[in] stream  stream handle received from Python.
    /// \param[in] device  the device the caller's work is on.
    virtual void check_stream(Stream stream, int device) = 0;

    /// Create an event.
    /// \param[in] timing  whether event_elapsed_ms may be used on it.
    virtual Event event_create(bool timing) = 0;

    /// Destroy an event (legal while a record of it is still pending).
    /// \param[in] event  event returned by event_create.
    virtual void event_destroy(Event event) = 0;

    /// Record `event` at the current tail of `stream`.
    /// \param[in] event   event to record.
    /// \param[in] stream  stream handle.
    virtual void event_record(Event event, Stream stream) = 0;

    /// Non-blocking: has the latest record of `event` completed?
    /// \param[in] event  event handle.
    virtual bool event_query(Event event) = 0;

    /// Block until the latest record of `event` has completed.
    /// \param[in] event  event handle.
    virtual void event_synchronize(Event event) = 0;

    /// Milliseconds between two completed timing events.
    /// \param[in] start  earlier event.
    /// \param[in] end    later event.
    virtual double event_elapsed_ms(Event start, Event end) = 0;

    /// Enqueue an asynchronous copy of `bytes` bytes (direction inferred from the pointers).
    /// \param[out] dst    destination pointer.
    /// \param[in]  src    source pointer.
    /// \param[in]  bytes  number of bytes.
    /// \param[in]  stream stream handle.
    virtual void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream stream) = 0;

    /// Enqueue a host function that runs when the stream reaches it (it must not call the
    /// runtime).
    /// \param[in] stream  stream handle.
    /// \param[in] fn      function to run.
    virtual void launch_host_func(Stream stream, std::function<void()> fn) = 0;
};

/// The runtime of a compiled backend.
/// \param[in] name  "cpu", "cuda" or "hip".
/// \return the process-wide runtime; throws bagualu2::Error naming the compiled backends when
///         `name` is not one of them, bagualu2::RuntimeError with the reason when it is compiled
///         but not usable (library missing, no device).
Runtime& runtime(const std::string& name);

/// Names of the compiled backends, "cpu" first.
std::vector<std::string> compiled_backends();

// What backend_status() says of one backend.
struct BackendStatus {
    std::string name;
    bool compiled = false;
    bool usable = false;
    std::string reason;   // why not usable ("" when usable)
    std::string library;  // the library and versions found (GPU backends, when loaded)
};

/// Every known backend ("cpu", "cuda", "hip"), compiled or not; loads each compiled GPU
/// library if no earlier call did. Never throws.
std::vector<BackendStatus> backend_status();

/// The entry point other extension modules use to reach this process's runtimes (exported by
/// bagualu2._C as the capsule `_runtime_api`), so a stream they create is one _C knows.
/// Returns nullptr and sets *error (when non-null) instead of throwing.
using RuntimeLookup = Runtime* (*)(const char* name, std::string* error);
Runtime* lookup_runtime(const char* name, std::string* error);

/// The device an object is created on: `device`, or for device < 0 the calling thread's
/// current one; throws bagualu2::Error when that is out of range or the thread has none. 0 on
/// cpu.
/// \param[in] rt      runtime of the object.
/// \param[in] device  requested device (< 0: the current one).
/// \param[in] what    the object, for the error ("CopyEngine", "HostArena").
int resolve_device(Runtime& rt, int device, const char* what);

// A process-wide copy stream and the lock its submitters share: engines of one device enqueue
// each copy (its timing events and chunks) under it, so no other engine's work lands between
// a copy's start and end events on the stream they share.
struct CopyStream {
    Stream stream = nullptr;
    std::mutex* submit = nullptr;
};

/// A process-wide stream of `device`, created on first use and never destroyed (see "Streams
/// handed to torch" above), with its submission lock; GPU backends only.
/// \param[in] rt      runtime of the stream.
/// \param[in] device  its device.
/// \param[in] slot    which one (the copy engine uses 0 for D2H, 1 for H2D).
CopyStream copy_stream(Runtime& rt, int device, int slot);

/// Forks of this process so far, counted in the child by pthread_atfork (see "Fork").
std::uint64_t fork_generation();

/// Throws bagualu2::RuntimeError when this process is a child forked after generation `born`
/// (a runtime created then cannot be used here; see "Fork").
/// \param[in] born     fork_generation() when the runtime was created.
/// \param[in] backend  its name, for the message.
void check_not_forked(std::uint64_t born, const char* backend);

// Makes `device` current for the guard's lifetime and then gives the thread back exactly what
// it had, none included (no-op on cpu or for device < 0).
class DeviceGuard {
public:
    /// \param[in] rt      runtime to act on.
    /// \param[in] device  device to make current; < 0 leaves the thread alone.
    DeviceGuard(Runtime& rt, int device) : rt_(rt) {
        if (device < 0 || rt.is_host()) {
            return;
        }
        previous_ = rt.bind(device);
        active_ = true;
    }
    ~DeviceGuard() {
        if (active_) {
            try {
                rt_.restore(previous_);
            } catch (...) {
                // A destructor must not throw; the thread keeps the guarded device.
            }
        }
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    // Runtime, whether the guard bound anything, and what to give back.
    Runtime& rt_;
    bool active_ = false;
    std::uintptr_t previous_ = 0;
};

// The one owner of a stream this library created and never hands to torch (cpu copy streams,
// the test hooks' streams): created on `device` in the constructor, drained (pending work
// completes) and destroyed in the destructor.
class UniqueStream {
public:
    /// \param[in] rt      runtime to create the stream with.
    /// \param[in] device  device of the stream (< 0: the current one).
    UniqueStream(Runtime& rt, int device) : rt_(&rt), device_(device) {
        DeviceGuard guard(rt, device);
        stream_ = rt.stream_create();
    }
    ~UniqueStream() {
        if (stream_ == nullptr) {
            return;
        }
        try {
            DeviceGuard guard(*rt_, device_);
            rt_->stream_synchronize(stream_);
            rt_->stream_destroy(stream_);
        } catch (...) {
            // A destructor must not throw; a failing runtime at teardown leaks one stream.
        }
    }
    UniqueStream(const UniqueStream&) = delete;
    UniqueStream& operator=(const UniqueStream&) = delete;

    Stream get() const { return stream_; }
    int device() const { return device_; }

private:
    // Runtime, device and the stream itself.
    Runtime* rt_;
    int device_;
    Stream stream_ = nullptr;
};

// The one owner of an event this library created on `device` (destroying one whose record is
// still pending is legal in every runtime); created and destroyed with its device bound.
class UniqueEvent {
public:
    /// \param[in] rt      runtime to create the event with.
    /// \param[in] device  device of the event (< 0: the current one).
    /// \param[in] timing  whether event_elapsed_ms may be used on it.
    UniqueEvent(Runtime& rt, int device, bool timing) : rt_(&rt), device_(device) {
        DeviceGuard guard(rt, device);
        event_ = rt.event_create(timing);
    }
    ~UniqueEvent() {
        try {
            DeviceGuard guard(*rt_, device_);
            rt_->event_destroy(event_);
        } catch (...) {
            // A destructor must not throw; a failing runtime at teardown leaks one event.
        }
    }
    UniqueEvent(const UniqueEvent&) = delete;
    UniqueEvent& operator=(const UniqueEvent&) = delete;

    Event get() const { return event_; }
    int device() const { return device_; }

private:
    // Runtime, device and the event it created.
    Runtime* rt_;
    int device_;
    Event event_ = nullptr;
};

// Backend factories: cpu_backend.cpp, and device_backend.cpp for the compiled GPU backends
// (each throws bagualu2::RuntimeError with the reason when its library is not usable).
Runtime& cpu_runtime();
#ifdef BAGUALU2_WITH_CUDA
Runtime& cuda_runtime();
#endif
#ifdef BAGUALU2_WITH_HIP
Runtime& hip_runtime();
#endif
/// Status of one compiled GPU backend (device_backend.cpp).
BackendStatus device_backend_status(const std::string& name);

}  // namespace bagualu2::gpu
