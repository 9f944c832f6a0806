// A stand-in for the CUDA driver API (libcuda.so.1), for tests only: the entry points bagualu2's
// cuda backend loads (csrc/gpu/cuda_abi.h), on host memory, so the shipped backend code runs
// on a machine without a GPU (BAGUALU2_CUDA_LIBRARY=<this library>). Never shipped.
//
// Design note
// -----------
// It is a test double for the driver only, strict where the real driver is lenient, and it
// records what a test needs to see:
//   * Devices: BAGUALU2_FAKE_CUDA_DEVICES of them (default 3), each with one primary context.
//     The current context is per thread (null at thread start). Per device it counts primary
//     context retains and whether its context was ever current on any thread, and answers
//     cuDevicePrimaryCtxGetState (active once retained: nothing here releases one).
//   * Every call that acts on a stream, an event or memory needs a current context, and the
//     context of the stream / event it acts on (cuStreamWaitEvent's event excepted, as in
//     CUDA); anything else is a violation.
//   * Memory kinds. Device memory (cuMemAlloc_v2, or fake_cuda_device_alloc for a test), pinned
//     host memory (cuMemHostAlloc) and pageable memory (anything else) are told apart by
//     address range. cuMemcpyAsync infers its direction, so the call an async copy on a stream of
//     device d must match is: one side device memory of d, the other device memory of d or
//     pinned host memory, each range inside one allocation. A pageable side (the real driver
//     stages it synchronously), another device's memory, a host-to-host copy or a range past
//     its allocation is refused (CUDA_ERROR_INVALID_VALUE) and listed.
//   * Lifetimes: live contexts, streams (default streams apart), events, pinned and device
//     allocations are counted (fake_cuda_live, fake_cuda_created), so a test sees what a
//     teardown left. Streams are worker threads that run their operations in FIFO order;
//     stream handle 0 is the current context's default stream (counted per device). A
//     destroyed stream or event is kept (never freed) so that any later use is caught as a
//     violation, not a crash.
//   * Events: each record is a fresh completion flag; a wait captures the record current at
//     the call (CUDA semantics); an event never recorded is complete.
//   * "Device" pointers are host pointers: cuMemcpyAsync is memcpy on the stream's thread.
//   * Errors from inside: fake_cuda_fail(call, code, count) makes the next `count` calls of an
//     entry point (or of every one, "*": a driver deinitialised mid-run) return `code`, before
//     they do anything; fake_cuda_misalign_host_allocs(n) makes the next n cuMemHostAlloc
//     return memory off the 256-byte alignment (freed like any other).
//   * Host functions: a CUDA call made inside a function cuLaunchHostFunc runs is refused
//     (CUDA_ERROR_NOT_PERMITTED, as CUDA forbids it) and listed.
//   * Names: the versioned entry points (cuStreamDestroy_v2, cuEventDestroy_v2,
//     cuEventElapsedTime_v2) and the plain ones a real libcuda also exports; <cuda.h> maps the
//     names to the versioned ones, so a call of a plain one means the loader took the wrong
//     symbol, and is listed.
//   * Fork: the driver remembers the process that initialised it; any call from a forked child
//     returns CUDA_ERROR_NOT_INITIALIZED without touching the parent's state, and is counted
//     (fake_cuda_calls_in_child, in the child's memory).
// Violations are returned as errors (CUDA_ERROR_INVALID_CONTEXT / _HANDLE / _VALUE /
// _NOT_PERMITTED) and also listed, so a test sees them even where the backend swallows the
// error (destructors).
//
// Test queries (extern "C", prefixed fake_cuda_) read the records; all state is allocated once
// and never freed, so worker threads still running at process exit touch nothing destroyed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

using Result = int;
constexpr Result kSuccess = 0;
constexpr Result kInvalidValue = 1;
constexpr Result kNotInitialized = 3;
constexpr Result kInvalidDevice = 101;
constexpr Result kInvalidContext = 201;
constexpr Result kInvalidHandle = 400;
constexpr Result kNotReady = 600;
constexpr Result kDeinitialized = 4;
constexpr Result kNotPermitted = 800;
constexpr Result kIllegalAddress = 700;

struct Context {
    int device;
};

// One record of an event: complete once its stream reaches it.
struct Record {
    bool done = false;
    std::chrono::steady_clock::time_point when{};
};

struct FakeStream;

struct FakeEvent {
    Context* ctx = nullptr;
    bool timing = false;
    bool destroyed = false;
    std::shared_ptr<Record> latest;  // guarded by State::mutex
};

struct FakeStream {
    Context* ctx = nullptr;
    bool destroyed = false;                  // guarded by State::mutex
    std::deque<std::function<void()>> ops;   // guarded by State::mutex
    std::size_t pending = 0;                 // enqueued and not finished
};

// An allocation the driver made: its size and device (-1: pinned host memory).
struct Allocation {
    std::size_t size = 0;
    int device = -1;
    void* base = nullptr;  // what to free (a misaligned pinned block's real start)
};

// Errors injected into an entry point ("*": every one): the next `count` calls (-1: until
// cleared) return `code`.
struct Injection {
    Result code = kSuccess;
    long count = 0;
};

struct State {
    std::mutex mutex;
    std::condition_variable changed;  // any record completed, any op finished
    int devices = 3;
    bool initialised = false;
    std::vector<Context*> contexts;
    std::vector<int> retains;
    std::vector<int> ever_current;
    std::vector<int> default_stream_uses;
    std::vector<FakeStream*> default_streams;
    std::set<FakeStream*> streams;  // every stream ever created, destroyed ones included
    std::set<FakeEvent*> events;
    std::map<std::uintptr_t, Allocation> memory;  // pinned and device allocations by address
    std::map<std::string, Injection> injections;
    int misaligned_left = 0;
    long streams_created = 0;
    long streams_destroyed = 0;
    long events_created = 0;
    long events_destroyed = 0;
    std::vector<std::string> violations;
};

// The process that initialised the driver, and calls made from a forked child (atomics: the
// child may have been forked while another thread held State::mutex).
std::atomic<long> owner_pid{0};
std::atomic<long> calls_in_child{0};
thread_local bool in_host_function = false;

State& state() {
    static State* s = [] {
        auto* st = new State;
        if (const char* env = std::getenv("BAGUALU2_FAKE_CUDA_DEVICES")) {
            st->devices = std::atoi(env);
        }
        for (int d = 0; d < st->devices; ++d) {
            st->contexts.push_back(new Context{d});
        }
        st->retains.assign(static_cast<std::size_t>(st->devices), 0);
        st->ever_current.assign(static_cast<std::size_t>(st->devices), 0);
        st->default_stream_uses.assign(static_cast<std::size_t>(st->devices), 0);
        st->default_streams.assign(static_cast<std::size_t>(st->devices), nullptr);
        return st;
    }();
    return *s;
}

thread_local Context* current = nullptr;

// Records a violation and returns `code`. State::mutex held.
Result violation(Result code, const std::string& what) {
    state().violations.push_back(what + " (thread context: " +
                                 (current ? "device " + std::to_string(current->device) : "none") +
                                 ")");
    return code;
}

void run_stream(FakeStream* s) {
    State& st = state();
    std::unique_lock<std::mutex> lock(st.mutex);
    for (;;) {
        st.changed.wait(lock, [&] { return !s->ops.empty(); });
        std::function<void()> op = std::move(s->ops.front());
        s->ops.pop_front();
        lock.unlock();
        op();
        lock.lock();
        --s->pending;
        st.changed.notify_all();
    }
}

FakeStream* new_stream(Context* ctx) {
    auto* s = new FakeStream;
    s->ctx = ctx;
    state().streams.insert(s);
    std::thread(run_stream, s).detach();
    return s;
}

// The stream a handle names for a call on the current context, or nullptr with *r set.
// State::mutex held.
FakeStream* resolve(void* handle, const char* call, Result* r) {
    State& st = state();
    *r = kSuccess;
    if (current == nullptr) {
        *r = violation(kInvalidContext, std::string(call) + " with no current context");
        return nullptr;
    }
    const auto raw = reinterpret_cast<std::uintptr_t>(handle);
    if (raw == 0 || raw == 1 || raw == 2) {  // 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
        const auto d = static_cast<std::size_t>(current->device);
        if (st.default_streams[d] == nullptr) {
            st.default_streams[d] = new_stream(current);
        }
        ++st.default_stream_uses[d];
        return st.default_streams[d];
    }
    auto* s = static_cast<FakeStream*>(handle);
    if (st.streams.count(s) == 0) {
        *r = violation(kInvalidHandle, std::string(call) + " on an unknown stream");
        return nullptr;
    }
    if (s->destroyed) {
        *r = violation(kInvalidHandle, std::string(call) + " on a destroyed stream (device " +
                                           std::to_string(s->ctx->device) + ")");
        return nullptr;
    }
    if (s->ctx != current) {
        *r = violation(kInvalidContext, std::string(call) + " on a stream of device " +
                                            std::to_string(s->ctx->device) +
                                            " with another context current");
        return nullptr;
    }
    return s;
}

// The event a handle names, or nullptr with *r set; `any_context` for cuStreamWaitEvent.
// State::mutex held.
FakeEvent* resolve_event(void* handle, const char* call, bool any_context, Result* r) {
    State& st = state();
    *r = kSuccess;
    auto* e = static_cast<FakeEvent*>(handle);
    if (st.events.count(e) == 0) {
        *r = violation(kInvalidHandle, std::string(call) + " on an unknown event");
        return nullptr;
    }
    if (e->destroyed) {
        *r = violation(kInvalidHandle, std::string(call) + " on a destroyed event");
        return nullptr;
    }
    if (current == nullptr) {
        *r = violation(kInvalidContext, std::string(call) + " with no current context");
        return nullptr;
    }
    if (!any_context && e->ctx != current) {
        *r = violation(kInvalidContext, std::string(call) + " on an event of device " +
                                            std::to_string(e->ctx->device) +
                                            " with another context current");
        return nullptr;
    }
    return e;
}

// What every entry point does first: a forked child is refused, a call from a host function
// is a violation, an injected error is returned. kSuccess lets the call go on.
Result enter(const char* call) {
    const long owner = owner_pid.load();
    if (owner != 0 && owner != static_cast<long>(getpid())) {
        calls_in_child.fetch_add(1);
        return kNotInitialized;
    }
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    if (in_host_function) {
        return violation(kNotPermitted, std::string(call) + " inside a host function");
    }
    for (const char* key : {call, "*"}) {
        auto it = st.injections.find(key);
        if (it != st.injections.end() && it->second.count != 0) {
            if (it->second.count > 0) {
                --it->second.count;
            }
            return it->second.code;
        }
    }
    return kSuccess;
}

#define FAKE_ENTER(call)                     \
    do {                                     \
        const Result entered = enter(call);  \
        if (entered != kSuccess) {           \
            return entered;                  \
        }                                    \
    } while (false)

// The allocation holding [addr, addr + bytes), or nullptr; *partial when addr lies in one the
// range runs past. State::mutex held.
const Allocation* find_allocation(std::uintptr_t addr, std::size_t bytes, bool* partial) {
    State& st = state();
    *partial = false;
    auto it = st.memory.upper_bound(addr);
    if (it == st.memory.begin()) {
        return nullptr;
    }
    --it;
    if (addr - it->first >= it->second.size) {
        return nullptr;
    }
    if (bytes > it->second.size - (addr - it->first)) {
        *partial = true;
        return nullptr;
    }
    return &it->second;
}

// "device d", "pinned host" or "pageable host" memory, for messages.
std::string kind_name(const Allocation* a) {
    if (a == nullptr) {
        return "pageable host memory";
    }
    return a->device < 0 ? "pinned host memory" : "device " + std::to_string(a->device) + " memory";
}

void enqueue(FakeStream* s, std::function<void()> op) {
    ++s->pending;
    s->ops.push_back(std::move(op));
    state().changed.notify_all();
}

// An allocation of `bytes` for `device` (-1: pinned host), `offset` bytes into a page-aligned
// block. State::mutex held.
Result allocate(void** ptr, std::size_t bytes, int device, std::size_t offset) {
    const std::size_t rounded = (bytes + offset + 4095) / 4096 * 4096;
    void* base = std::aligned_alloc(4096, rounded);
    if (base == nullptr) {
        return 2;  // CUDA_ERROR_OUT_OF_MEMORY
    }
    *ptr = static_cast<char*>(base) + offset;
    state().memory[reinterpret_cast<std::uintptr_t>(*ptr)] = Allocation{bytes, device, base};
    return kSuccess;
}

// Frees an allocation of `device` (-1: pinned host) that starts at ptr. State::mutex held.
Result release(void* ptr, int device, const char* call) {
    State& st = state();
    auto it = st.memory.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == st.memory.end() || (it->second.device < 0) != (device < 0)) {
        return violation(kInvalidValue, std::string(call) + " of memory its allocator did not return");
    }
    std::free(it->second.base);
    st.memory.erase(it);
    return kSuccess;
}

}  // namespace

extern "C" {

// ---- driver entry points ------------------------------------------------------------------

Result cuInit(unsigned flags) {
    if (flags != 0) {
        return kInvalidValue;
    }
    long none = 0;
    owner_pid.compare_exchange_strong(none, static_cast<long>(getpid()));
    FAKE_ENTER("cuInit");
    std::lock_guard<std::mutex> lock(state().mutex);
    state().initialised = true;
    return kSuccess;
}

Result cuDriverGetVersion(int* version) {
    FAKE_ENTER("cuDriverGetVersion");
    *version = 13000;
    return kSuccess;
}

Result cuDeviceGetCount(int* count) {
    FAKE_ENTER("cuDeviceGetCount");
    *count = state().devices;
    return state().initialised ? kSuccess : kNotInitialized;
}

Result cuDeviceGet(int* device, int ordinal) {
    FAKE_ENTER("cuDeviceGet");
    if (ordinal < 0 || ordinal >= state().devices) {
        return kInvalidDevice;
    }
    *device = ordinal;
    return kSuccess;
}

Result cuDevicePrimaryCtxRetain(void** ctx, int device) {
    FAKE_ENTER("cuDevicePrimaryCtxRetain");
    State& st = state();
    if (device < 0 || device >= st.devices) {
        return kInvalidDevice;
    }
    std::lock_guard<std::mutex> lock(st.mutex);
    ++st.retains[static_cast<std::size_t>(device)];
    *ctx = st.contexts[static_cast<std::size_t>(device)];
    return kSuccess;
}

Result cuCtxGetCurrent(void** ctx) {
    FAKE_ENTER("cuCtxGetCurrent");
    *ctx = current;
    return kSuccess;
}

Result cuCtxSetCurrent(void* ctx) {
    FAKE_ENTER("cuCtxSetCurrent");
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    if (ctx == nullptr) {
        current = nullptr;
        return kSuccess;
    }
    auto* c = static_cast<Context*>(ctx);
    bool known = false;
    for (Context* k : st.contexts) {
        known |= k == c;
    }
    if (!known) {
        return violation(kInvalidContext, "cuCtxSetCurrent of an unknown context");
    }
    if (st.retains[static_cast<std::size_t>(c->device)] == 0) {
        return violation(kInvalidContext, "cuCtxSetCurrent of device " +
                                              std::to_string(c->device) +
                                              "'s primary context, never retained");
    }
    st.ever_current[static_cast<std::size_t>(c->device)] = 1;
    current = c;
    return kSuccess;
}

Result cuCtxGetDevice(int* device) {
    FAKE_ENTER("cuCtxGetDevice");
    if (current == nullptr) {
        std::lock_guard<std::mutex> lock(state().mutex);
        return violation(kInvalidContext, "cuCtxGetDevice with no current context");
    }
    *device = current->device;
    return kSuccess;
}

Result cuMemHostAlloc(void** ptr, std::size_t bytes, unsigned /*flags*/) {
    FAKE_ENTER("cuMemHostAlloc");
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuMemHostAlloc with no current context");
    }
    std::size_t offset = 0;
    if (state().misaligned_left > 0) {
        --state().misaligned_left;
        offset = 64;  // off the 256-byte alignment the arena needs
    }
    return allocate(ptr, bytes, -1, offset);
}

Result cuMemFreeHost(void* ptr) {
    FAKE_ENTER("cuMemFreeHost");
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuMemFreeHost with no current context");
    }
    return release(ptr, -1, "cuMemFreeHost");
}

Result cuMemAlloc_v2(unsigned long long* dptr, std::size_t bytes) {
    FAKE_ENTER("cuMemAlloc");
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuMemAlloc with no current context");
    }
    void* ptr = nullptr;
    const Result r = allocate(&ptr, bytes, current->device, 0);
    *dptr = reinterpret_cast<std::uintptr_t>(ptr);
    return r;
}

Result cuMemFree_v2(unsigned long long dptr) {
    FAKE_ENTER("cuMemFree");
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuMemFree with no current context");
    }
    return release(reinterpret_cast<void*>(dptr), current->device, "cuMemFree");
}

Result cuDevicePrimaryCtxGetState(int device, unsigned* flags, int* active) {
    FAKE_ENTER("cuDevicePrimaryCtxGetState");
    State& st = state();
    if (device < 0 || device >= st.devices) {
        return kInvalidDevice;
    }
    std::lock_guard<std::mutex> lock(st.mutex);
    *flags = 0;
    *active = st.retains[static_cast<std::size_t>(device)] > 0 ? 1 : 0;
    return kSuccess;
}

Result cuStreamCreate(void** stream, unsigned /*flags*/) {
    FAKE_ENTER("cuStreamCreate");
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuStreamCreate with no current context");
    }
    *stream = new_stream(current);
    ++state().streams_created;
    return kSuccess;
}

Result cuStreamDestroy_v2(void* stream) {
    FAKE_ENTER("cuStreamDestroy");
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuStreamDestroy", &r);
    if (s == nullptr || stream == nullptr) {
        return s == nullptr ? r : kInvalidHandle;
    }
    s->destroyed = true;  // pending work still runs, as in CUDA
    ++state().streams_destroyed;
    return kSuccess;
}

// The plain names a real libcuda exports beside the versioned ones: <cuda.h> maps the names to
// the versioned ones, so a call here means the loader took the wrong symbol.
Result plain(const char* call) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return violation(kSuccess, std::string(call) + ": the plain entry point (<cuda.h> maps the "
                                                   "name to its _v2): the loader took the wrong "
                                                   "symbol");
}

Result cuStreamDestroy(void* stream) {
    plain("cuStreamDestroy");
    return cuStreamDestroy_v2(stream);
}

Result cuStreamSynchronize(void* stream) {
    FAKE_ENTER("cuStreamSynchronize");
    State& st = state();
    std::unique_lock<std::mutex> lock(st.mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuStreamSynchronize", &r);
    if (s == nullptr) {
        return r;
    }
    st.changed.wait(lock, [&] { return s->pending == 0; });
    return kSuccess;
}

Result cuStreamWaitEvent(void* stream, void* event, unsigned /*flags*/) {
    FAKE_ENTER("cuStreamWaitEvent");
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuStreamWaitEvent", &r);
    if (s == nullptr) {
        return r;
    }
    FakeEvent* e = resolve_event(event, "cuStreamWaitEvent", true, &r);
    if (e == nullptr) {
        return r;
    }
    std::shared_ptr<Record> target = e->latest;
    if (target != nullptr) {
        enqueue(s, [target] {
            State& st2 = state();
            std::unique_lock<std::mutex> l(st2.mutex);
            st2.changed.wait(l, [&] { return target->done; });
        });
    }
    return kSuccess;
}

Result cuStreamGetCtx(void* stream, void** ctx) {
    FAKE_ENTER("cuStreamGetCtx");
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    if (stream == nullptr) {
        if (current == nullptr) {
            return violation(kInvalidContext, "cuStreamGetCtx(0) with no current context");
        }
        *ctx = current;
        return kSuccess;
    }
    auto* s = static_cast<FakeStream*>(stream);
    if (st.streams.count(s) == 0) {
        return kInvalidHandle;  // a handle the driver never made: an error, not a violation
    }
    if (s->destroyed) {
        return violation(kInvalidHandle, "cuStreamGetCtx on a destroyed stream");
    }
    *ctx = s->ctx;
    return kSuccess;
}

Result cuEventCreate(void** event, unsigned flags) {
    FAKE_ENTER("cuEventCreate");
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuEventCreate with no current context");
    }
    auto* e = new FakeEvent;
    e->ctx = current;
    e->timing = (flags & 2u) == 0;
    state().events.insert(e);
    ++state().events_created;
    *event = e;
    return kSuccess;
}

Result cuEventDestroy_v2(void* event) {
    FAKE_ENTER("cuEventDestroy");
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeEvent* e = resolve_event(event, "cuEventDestroy", false, &r);
    if (e == nullptr) {
        return r;
    }
    e->destroyed = true;
    ++state().events_destroyed;
    return kSuccess;
}

Result cuEventDestroy(void* event) {
    plain("cuEventDestroy");
    return cuEventDestroy_v2(event);
}

Result cuEventRecord(void* event, void* stream) {
    FAKE_ENTER("cuEventRecord");
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    Result r = kSuccess;
    FakeEvent* e = resolve_event(event, "cuEventRecord", false, &r);
    if (e == nullptr) {
        return r;
    }
    FakeStream* s = resolve(stream, "cuEventRecord", &r);
    if (s == nullptr) {
        return r;
    }
    auto record = std::make_shared<Record>();
    e->latest = record;
    enqueue(s, [record] {
        std::lock_guard<std::mutex> l(state().mutex);
        record->when = std::chrono::steady_clock::now();
        record->done = true;
    });
    return kSuccess;
}

Result cuEventQuery(void* event) {
    FAKE_ENTER("cuEventQuery");
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeEvent* e = resolve_event(event, "cuEventQuery", false, &r);
    if (e == nullptr) {
        return r;
    }
    return e->latest == nullptr || e->latest->done ? kSuccess : kNotReady;
}

Result cuEventSynchronize(void* event) {
    FAKE_ENTER("cuEventSynchronize");
    State& st = state();
    std::unique_lock<std::mutex> lock(st.mutex);
    Result r = kSuccess;
    FakeEvent* e = resolve_event(event, "cuEventSynchronize", false, &r);
    if (e == nullptr) {
        return r;
    }
    std::shared_ptr<Record> target = e->latest;
    if (target != nullptr) {
        st.changed.wait(lock, [&] { return target->done; });
    }
    return kSuccess;
}

Result cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    FAKE_ENTER("cuEventElapsedTime");
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeEvent* a = resolve_event(start, "cuEventElapsedTime", false, &r);
    FakeEvent* b = a == nullptr ? nullptr : resolve_event(end, "cuEventElapsedTime", false, &r);
    if (b == nullptr) {
        return r;
    }
    if (!a->timing || !b->timing || !a->latest || !b->latest) {
        return kInvalidHandle;
    }
    if (!a->latest->done || !b->latest->done) {
        return kNotReady;
    }
    *ms = std::chrono::duration<float, std::milli>(b->latest->when - a->latest->when).count();
    return kSuccess;
}

Result cuEventElapsedTime(float* ms, void* start, void* end) {
    plain("cuEventElapsedTime");
    return cuEventElapsedTime_v2(ms, start, end);
}

Result cuMemcpyAsync(unsigned long long dst, unsigned long long src, std::size_t bytes,
                     void* stream) {
    FAKE_ENTER("cuMemcpyAsync");
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuMemcpyAsync", &r);
    if (s == nullptr) {
        return r;
    }
    // The memory kinds must match an async copy on a stream of this device (design note).
    const int device = s->ctx->device;
    bool partial_dst = false;
    bool partial_src = false;
    const Allocation* to = find_allocation(dst, bytes, &partial_dst);
    const Allocation* from = find_allocation(src, bytes, &partial_src);
    const std::string what = "cuMemcpyAsync of " + std::to_string(bytes) + " bytes on a stream of device " +
                             std::to_string(device) + " from " + kind_name(from) + " to " +
                             kind_name(to);
    if (partial_dst || partial_src) {
        return violation(kInvalidValue, what + ": a range runs past its allocation");
    }
    const auto on_device = [device](const Allocation* a) { return a != nullptr && a->device == device; };
    const auto other_device = [device](const Allocation* a) {
        return a != nullptr && a->device >= 0 && a->device != device;
    };
    if (other_device(to) || other_device(from)) {
        return violation(kInvalidValue, what + ": another device's memory");
    }
    if (to == nullptr || from == nullptr) {
        return violation(kInvalidValue, what + ": pageable memory in an async copy");
    }
    if (!on_device(to) && !on_device(from)) {
        return violation(kInvalidValue, what + ": a host-to-host copy on a device stream");
    }
    enqueue(s, [dst, src, bytes] {
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
    });
    return kSuccess;
}

Result cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
    FAKE_ENTER("cuLaunchHostFunc");
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuLaunchHostFunc", &r);
    if (s == nullptr) {
        return r;
    }
    enqueue(s, [fn, data] {
        in_host_function = true;  // CUDA forbids driver calls in here
        fn(data);
        in_host_function = false;
    });
    return kSuccess;
}

Result cuGetErrorName(Result error, const char** text) {
    switch (error) {
        case kSuccess: *text = "CUDA_SUCCESS"; return kSuccess;
        case kInvalidValue: *text = "CUDA_ERROR_INVALID_VALUE"; return kSuccess;
        case kInvalidDevice: *text = "CUDA_ERROR_INVALID_DEVICE"; return kSuccess;
        case kInvalidContext: *text = "CUDA_ERROR_INVALID_CONTEXT"; return kSuccess;
        case kInvalidHandle: *text = "CUDA_ERROR_INVALID_HANDLE"; return kSuccess;
        case kNotReady: *text = "CUDA_ERROR_NOT_READY"; return kSuccess;
        case kNotInitialized: *text = "CUDA_ERROR_NOT_INITIALIZED"; return kSuccess;
        case kDeinitialized: *text = "CUDA_ERROR_DEINITIALIZED"; return kSuccess;
        case kNotPermitted: *text = "CUDA_ERROR_NOT_PERMITTED"; return kSuccess;
        case kIllegalAddress: *text = "CUDA_ERROR_ILLEGAL_ADDRESS"; return kSuccess;
        default: return kInvalidValue;
    }
}

Result cuGetErrorString(Result error, const char** text) {
    const Result r = cuGetErrorName(error, text);
    if (r == kSuccess) {
        *text = "reported by the test stand-in driver (tests/fake_driver)";
    }
    return r;
}

// ---- test queries ---------------------------------------------------------------------------

/// Primary-context retains of `device` so far.
int fake_cuda_retains(int device) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return state().retains.at(static_cast<std::size_t>(device));
}

/// Whether `device`'s context was ever current on any thread.
int fake_cuda_ever_current(int device) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return state().ever_current.at(static_cast<std::size_t>(device));
}

/// Operations that named stream 0 (the current context's default stream) on `device`.
int fake_cuda_default_stream_uses(int device) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return state().default_stream_uses.at(static_cast<std::size_t>(device));
}

/// The calling thread's current device, -1 for none.
int fake_cuda_current_device() { return current == nullptr ? -1 : current->device; }

/// 1 if `stream` was destroyed, 0 if it is alive, -1 if the driver never made it.
int fake_cuda_stream_destroyed(void* stream) {
    std::lock_guard<std::mutex> lock(state().mutex);
    auto* s = static_cast<FakeStream*>(stream);
    if (state().streams.count(s) == 0) {
        return -1;
    }
    return s->destroyed ? 1 : 0;
}

/// Device of a stream the driver made, -1 otherwise.
int fake_cuda_stream_device(void* stream) {
    std::lock_guard<std::mutex> lock(state().mutex);
    auto* s = static_cast<FakeStream*>(stream);
    return state().streams.count(s) == 0 ? -1 : s->ctx->device;
}

/// Violations so far, "\n"-separated, copied into buf (truncated to len - 1); returns the count.
int fake_cuda_violations(char* buf, int len) {
    std::lock_guard<std::mutex> lock(state().mutex);
    std::string all;
    for (const std::string& v : state().violations) {
        all += v + "\n";
    }
    if (len > 0) {
        const auto n = std::min(all.size(), static_cast<std::size_t>(len - 1));
        std::memcpy(buf, all.data(), n);
        buf[n] = '\0';
    }
    return static_cast<int>(state().violations.size());
}

/// Live objects of a kind: "contexts" (retained primary contexts), "streams" (created, not
/// destroyed, default streams apart), "events", "host" (pinned allocations), "device"; -1 for
/// another name. With `device` >= 0, "streams" counts that device's only.
long fake_cuda_live(const char* what, int device) {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    const std::string kind = what;
    long n = 0;
    if (kind == "contexts") {
        for (int r : st.retains) {
            n += r > 0 ? 1 : 0;
        }
        return n;
    }
    if (kind == "streams") {
        for (FakeStream* s : st.streams) {
            const bool is_default = std::find(st.default_streams.begin(), st.default_streams.end(), s) !=
                                    st.default_streams.end();
            n += !s->destroyed && !is_default && (device < 0 || s->ctx->device == device) ? 1 : 0;
        }
        return n;
    }
    if (kind == "events") {
        return st.events_created - st.events_destroyed;
    }
    if (kind == "host" || kind == "device") {
        for (const auto& entry : st.memory) {
            n += (entry.second.device < 0) == (kind == "host") ? 1 : 0;
        }
        return n;
    }
    return -1;
}

/// Objects of a kind ever created: "streams", "events"; -1 for another name.
long fake_cuda_created(const char* what) {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    const std::string kind = what;
    return kind == "streams" ? st.streams_created : kind == "events" ? st.events_created : -1;
}

/// The next `count` calls (-1: every call until cleared with count 0) of entry point `call`
/// (its name without _v2, or "*" for every entry point) return `code`. "*" with count 0
/// clears every injection.
void fake_cuda_fail(const char* call, int code, long count) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (std::string(call) == "*" && count == 0) {
        state().injections.clear();
        return;
    }
    state().injections[call] = Injection{code, count};
}

/// The next `count` cuMemHostAlloc return memory 64 bytes past a page boundary.
void fake_cuda_misalign_host_allocs(int count) {
    std::lock_guard<std::mutex> lock(state().mutex);
    state().misaligned_left = count;
}

/// Device memory of `device` for a test to fill and read (host addresses), no context needed;
/// 0 when out of memory.
unsigned long long fake_cuda_device_alloc(int device, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(state().mutex);
    void* ptr = nullptr;
    return allocate(&ptr, bytes, device, 0) == kSuccess ? reinterpret_cast<std::uintptr_t>(ptr) : 0;
}

/// Frees what fake_cuda_device_alloc returned.
int fake_cuda_device_free(unsigned long long ptr) {
    std::lock_guard<std::mutex> lock(state().mutex);
    auto it = state().memory.find(ptr);
    return it == state().memory.end() ? kInvalidValue
                                      : release(reinterpret_cast<void*>(ptr), it->second.device,
                                                "fake_cuda_device_free");
}

/// Driver calls this process made after being forked from the one that initialised it.
long fake_cuda_calls_in_child() { return calls_in_child.load(); }

/// Make device `device`'s primary context current on the calling thread (retaining it), as a
/// torch thread that chose that device would have it; -1 makes none current.
int fake_cuda_bind(int device) {
    if (device < 0) {
        return cuCtxSetCurrent(nullptr);
    }
    void* ctx = nullptr;
    const Result r = cuDevicePrimaryCtxRetain(&ctx, device);
    return r != kSuccess ? r : cuCtxSetCurrent(ctx);
}

}  // extern "C"
