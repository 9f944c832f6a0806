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
//     context retains and whether its context was ever current on any thread.
//   * Every call that acts on a stream, an event or pinned memory needs a current context, and
//     the context of the stream / event it acts on (cuStreamWaitEvent's event excepted, as in
//     CUDA); anything else is a violation.
//   * Streams are worker threads that run their operations in FIFO order; stream handle 0 is
//     the current context's default stream (counted per device). A destroyed stream or event is
//     kept (never freed) so that any later use is caught as a violation, not a crash.
//   * Events: each record is a fresh completion flag; a wait captures the record current at
//     the call (CUDA semantics); an event never recorded is complete.
//   * "Device" pointers are host pointers: cuMemcpyAsync is memcpy on the stream's thread.
// Violations are returned as errors (CUDA_ERROR_INVALID_CONTEXT / _HANDLE) and also listed, so
// a test sees them even where the backend swallows the error (destructors).
//
// Test queries (extern "C", prefixed fake_cuda_) read the records; all state is allocated once
// and never freed, so worker threads still running at process exit touch nothing destroyed.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using Result = int;
constexpr Result kSuccess = 0;
constexpr Result kInvalidValue = 1;
constexpr Result kNotInitialized = 3;
constexpr Result kInvalidDevice = 101;
constexpr Result kInvalidContext = 201;
constexpr Result kInvalidHandle = 400;
constexpr Result kNotReady = 600;

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
    std::set<void*> host_blocks;
    std::vector<std::string> violations;
};

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

void enqueue(FakeStream* s, std::function<void()> op) {
    ++s->pending;
    s->ops.push_back(std::move(op));
    state().changed.notify_all();
}

}  // namespace

extern "C" {

// ---- driver entry points ------------------------------------------------------------------

Result cuInit(unsigned flags) {
    if (flags != 0) {
        return kInvalidValue;
    }
    std::lock_guard<std::mutex> lock(state().mutex);
    state().initialised = true;
    return kSuccess;
}

Result cuDriverGetVersion(int* version) {
    *version = 13000;
    return kSuccess;
}

Result cuDeviceGetCount(int* count) {
    *count = state().devices;
    return state().initialised ? kSuccess : kNotInitialized;
}

Result cuDeviceGet(int* device, int ordinal) {
    if (ordinal < 0 || ordinal >= state().devices) {
        return kInvalidDevice;
    }
    *device = ordinal;
    return kSuccess;
}

Result cuDevicePrimaryCtxRetain(void** ctx, int device) {
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
    *ctx = current;
    return kSuccess;
}

Result cuCtxSetCurrent(void* ctx) {
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
    if (current == nullptr) {
        std::lock_guard<std::mutex> lock(state().mutex);
        return violation(kInvalidContext, "cuCtxGetDevice with no current context");
    }
    *device = current->device;
    return kSuccess;
}

Result cuMemHostAlloc(void** ptr, std::size_t bytes, unsigned /*flags*/) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuMemHostAlloc with no current context");
    }
    const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
    *ptr = std::aligned_alloc(4096, rounded);
    if (*ptr == nullptr) {
        return 2;  // CUDA_ERROR_OUT_OF_MEMORY
    }
    state().host_blocks.insert(*ptr);
    return kSuccess;
}

Result cuMemFreeHost(void* ptr) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuMemFreeHost with no current context");
    }
    if (state().host_blocks.erase(ptr) == 0) {
        return violation(kInvalidValue, "cuMemFreeHost of memory cuMemHostAlloc did not return");
    }
    std::free(ptr);
    return kSuccess;
}

Result cuStreamCreate(void** stream, unsigned /*flags*/) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuStreamCreate with no current context");
    }
    *stream = new_stream(current);
    return kSuccess;
}

Result cuStreamDestroy_v2(void* stream) {
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuStreamDestroy", &r);
    if (s == nullptr || stream == nullptr) {
        return s == nullptr ? r : kInvalidHandle;
    }
    s->destroyed = true;  // pending work still runs, as in CUDA
    return kSuccess;
}

Result cuStreamSynchronize(void* stream) {
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
    std::lock_guard<std::mutex> lock(state().mutex);
    if (current == nullptr) {
        return violation(kInvalidContext, "cuEventCreate with no current context");
    }
    auto* e = new FakeEvent;
    e->ctx = current;
    e->timing = (flags & 2u) == 0;
    state().events.insert(e);
    *event = e;
    return kSuccess;
}

Result cuEventDestroy_v2(void* event) {
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeEvent* e = resolve_event(event, "cuEventDestroy", false, &r);
    if (e == nullptr) {
        return r;
    }
    e->destroyed = true;
    return kSuccess;
}

Result cuEventRecord(void* event, void* stream) {
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
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeEvent* e = resolve_event(event, "cuEventQuery", false, &r);
    if (e == nullptr) {
        return r;
    }
    return e->latest == nullptr || e->latest->done ? kSuccess : kNotReady;
}

Result cuEventSynchronize(void* event) {
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
    return cuEventElapsedTime_v2(ms, start, end);
}

Result cuMemcpyAsync(unsigned long long dst, unsigned long long src, std::size_t bytes,
                     void* stream) {
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuMemcpyAsync", &r);
    if (s == nullptr) {
        return r;
    }
    enqueue(s, [dst, src, bytes] {
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
    });
    return kSuccess;
}

Result cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
    std::lock_guard<std::mutex> lock(state().mutex);
    Result r = kSuccess;
    FakeStream* s = resolve(stream, "cuLaunchHostFunc", &r);
    if (s == nullptr) {
        return r;
    }
    enqueue(s, [fn, data] { fn(data); });
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
