// The GPU backend of the neutral gpu:: API, one implementation for CUDA and HIP.
//
// DeviceRuntime implements gpu::Runtime over a DeviceApi table (gpu/device_api.h): every
// status is checked here, the one place that turns a vendor status into
// bagualu2::RuntimeError (through BAGUALU2_RUNTIME_CHECK, common/check.h), naming the call and
// the runtime's own description. A backend is usable when its library loaded, initialised,
// and sees at least one device; runtime("cuda") / runtime("hip") of an unusable one throws
// with the reason, and backend_status() reports it without throwing.
//
// event_query / event_synchronize throw bagualu2::WorkFailed for the statuses the table calls
// a failure of the work (DeviceApi::work_failed), a plain RuntimeError for any other. In a
// child forked after the runtime was created, every call refuses before reaching the library
// (gpu.h, "Fork").
//
// The test-only copy fault switch (gpu/copy_faults.h) is honoured as the cpu backend honours
// it, in host bookkeeping: a copy failed at submission throws from memcpy_async without
// calling the runtime; one failed at execution is not enqueued, its stream is marked, and the
// next event recorded on that stream is marked failed, so event_query (once the event is
// complete) and event_synchronize throw. The marks are consulted only once a fault was
// injected in this process (one atomic load otherwise).
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/check.h"
#include "gpu/copy_faults.h"
#include "gpu/device_api.h"
#include "gpu/gpu.h"

namespace bagualu2::gpu {

void run_host_callback(void* arg) {
    std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
    (*fn)();
}

bool Library::open(const std::vector<std::string>& names, std::string* why) {
    // A copy already in the process first (RTLD_NOLOAD only finds, never loads).
    for (const std::string& name : names) {
        handle_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
        if (handle_ != nullptr) {
            path_ = name;
            return true;
        }
    }
    std::string tried;
    for (const std::string& name : names) {
        handle_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle_ != nullptr) {
            path_ = name;
            return true;
        }
        const char* error = dlerror();
        tried += (tried.empty() ? "" : "; ") + std::string(error != nullptr ? error : name.c_str());
    }
    *why = tried;
    return false;
}

void* Library::lookup(const char* name) const { return dlsym(handle_, name); }

namespace {

class DeviceRuntime final : public Runtime {
public:
    explicit DeviceRuntime(const DeviceApi& api) : api_(api) {}

    const char* name() const override { return api_.name; }
    bool is_host() const override { return false; }

    int device_count() override {
        check_not_forked(born_, api_.name);
        int count = 0;
        return api_.device_count(&count) == 0 ? count : 0;  // no device: zero, not an error
    }

    int get_device() override {
        check_not_forked(born_, api_.name);
        int device = -1;
        check(api_.get_device(&device), "get_device");
        return device;
    }

    std::uintptr_t bind(int device) override {
        check_not_forked(born_, api_.name);
        std::uintptr_t previous = 0;
        check(api_.bind(device, &previous), "bind of device ", device);
        return previous;
    }

    void restore(std::uintptr_t previous) override {
        check_not_forked(born_, api_.name);
        check(api_.restore(previous), "restore");
    }

    void* host_alloc(std::size_t bytes) override {
        check_not_forked(born_, api_.name);
        void* ptr = nullptr;
        check(api_.host_alloc(&ptr, bytes), "pinned host_alloc");
        return ptr;
    }

    void host_free(void* ptr) override {
        check_not_forked(born_, api_.name);
        check(api_.host_free(ptr), "host_free");
    }

    Stream stream_create() override {
        check_not_forked(born_, api_.name);
        void* stream = nullptr;
        check(api_.stream_create(&stream), "stream_create");
        return stream;
    }

    void stream_destroy(Stream stream) override {
        check_not_forked(born_, api_.name);
        check(api_.stream_destroy(stream), "stream_destroy");
        forget(stream, nullptr);
    }

    void stream_synchronize(Stream stream) override {
        check_not_forked(born_, api_.name);
        check(api_.stream_synchronize(stream), "stream_synchronize");
    }

    void stream_wait_event(Stream stream, Event event) override {
        check_not_forked(born_, api_.name);
        check(api_.stream_wait_event(stream, event), "stream_wait_event");
    }

    void check_stream(Stream stream, int device) override {
        check_not_forked(born_, api_.name);
        if (stream == nullptr || api_.stream_device == nullptr) {
            return;  // 0: the bound device's default stream; a HIP before 6 cannot tell
        }
        int owner = -1;
        const int status = api_.stream_device(stream, &owner);
        const auto handle = reinterpret_cast<std::uintptr_t>(stream);
        BAGUALU2_CHECK(status == 0, "stream 0x", std::hex, handle, std::dec, " is not a live ",
                       api_.name, " stream: ", api_.describe(status));
        BAGUALU2_CHECK(owner == device, "stream 0x", std::hex, handle, std::dec, " belongs to ",
                       owner < 0 ? std::string("a context bagualu2 never used")
                                 : "device " + std::to_string(owner),
                       ", but the work is on device ", device, ": pass a stream of device ",
                       device, " (torch.cuda.current_stream(", device,
                       ")), or use the engine of the tensor's device");
    }

    Event event_create(bool timing) override {
        check_not_forked(born_, api_.name);
        void* event = nullptr;
        check(api_.event_create(&event, timing), "event_create");
        return event;
    }

    void event_destroy(Event event) override {
        check_not_forked(born_, api_.name);
        check(api_.event_destroy(event), "event_destroy");
        forget(nullptr, event);
    }

    void event_record(Event event, Stream stream) override {
        check_not_forked(born_, api_.name);
        check(api_.event_record(event, stream), "event_record");
        if (faults_seen_.load(std::memory_order_acquire)) {
            // The record takes the failure of a copy injected before it on the stream.
            std::lock_guard<std::mutex> lock(faults_mutex_);
            auto it = failed_streams_.find(stream);
            if (it != failed_streams_.end()) {
                failed_events_[event] = std::move(it->second);
                failed_streams_.erase(it);
            } else {
                failed_events_.erase(event);
            }
        }
    }

    bool event_query(Event event) override {
        check_not_forked(born_, api_.name);
        const int status = api_.event_query(event);
        if (status == api_.not_ready) {
            return false;
        }
        check_completion(status, "event_query");
        check_injected(event);
        return true;
    }

    void event_synchronize(Event event) override {
        check_not_forked(born_, api_.name);
        check_completion(api_.event_synchronize(event), "event_synchronize");
        check_injected(event);
    }

    double event_elapsed_ms(Event start, Event end) override {
        check_not_forked(born_, api_.name);
        float ms = 0.0f;
        check(api_.event_elapsed_ms(&ms, start, end), "event_elapsed_ms");
        return static_cast<double>(ms);
    }

    void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream stream) override {
        check_not_forked(born_, api_.name);
        if (bytes == 0) {
            return;
        }
        const CopyFault fault = claim_copy_fault();  // test-only: kNone unless a test armed it
        BAGUALU2_RUNTIME_CHECK(fault != CopyFault::kSubmit, api_.name, " memcpy_async of ", bytes,
                               " bytes failed at submission: injected fault (test switch)");
        if (fault == CopyFault::kExecute) {
            std::lock_guard<std::mutex> lock(faults_mutex_);
            std::string& why = failed_streams_[stream];
            if (why.empty()) {
                why = std::string(api_.name) + " copy of " + std::to_string(bytes) +
                      " bytes failed at execution: injected fault (test switch)";
            }
            faults_seen_.store(true, std::memory_order_release);
            return;  // not enqueued
        }
        check(api_.memcpy_async(dst, src, bytes, stream), "memcpy_async of ", bytes, " bytes");
    }

    void launch_host_func(Stream stream, std::function<void()> fn) override {
        check_not_forked(born_, api_.name);
        auto boxed = std::make_unique<std::function<void()>>(std::move(fn));
        check(api_.launch_host_callback(stream, boxed.get()), "launch_host_func");
        boxed.release();  // run_host_callback owns it now
    }

private:
    template <typename... What>
    void check(int status, const What&... what) const {
        BAGUALU2_RUNTIME_CHECK(status == 0, api_.name, " ", what..., " failed: ",
                               api_.describe(status), " (", api_.library, ")");
    }

    // A completion query's status: WorkFailed when it reports the work failed (it ended),
    // else as check().
    void check_completion(int status, const char* what) const {
        BAGUALU2_WORK_CHECK(status == 0 || !api_.work_failed(status), api_.name, " ", what,
                            ": the work before the event failed: ", api_.describe(status), " (",
                            api_.library, ")");
        check(status, what);
    }

    // Throws the injected failure an event's record took (test switch only).
    void check_injected(Event event) {
        if (!faults_seen_.load(std::memory_order_acquire)) {
            return;
        }
        std::string why;
        {
            std::lock_guard<std::mutex> lock(faults_mutex_);
            auto it = failed_events_.find(event);
            if (it != failed_events_.end()) {
                why = it->second;
            }
        }
        BAGUALU2_WORK_CHECK(why.empty(), why);
    }

    // Drops the marks of a destroyed stream or event (its handle may be reused).
    void forget(Stream stream, Event event) {
        if (!faults_seen_.load(std::memory_order_acquire)) {
            return;
        }
        std::lock_guard<std::mutex> lock(faults_mutex_);
        if (stream != nullptr) {
            failed_streams_.erase(stream);
        }
        if (event != nullptr) {
            failed_events_.erase(event);
        }
    }

    // The loaded library's table (static storage of its loader), and the fork generation it
    // was loaded in (gpu.h, "Fork").
    const DeviceApi& api_;
    const std::uint64_t born_ = fork_generation();
    // Injected execution failures (gpu/copy_faults.h), consulted once faults_seen_: streams
    // whose next record fails, and the records that did.
    std::atomic<bool> faults_seen_{false};
    std::mutex faults_mutex_;
    std::unordered_map<Stream, std::string> failed_streams_;
    std::unordered_map<Event, std::string> failed_events_;
};

#if defined(BAGUALU2_WITH_CUDA) || defined(BAGUALU2_WITH_HIP)
// A loaded runtime, or why it is not usable; built once per backend.
struct Usable {
    std::unique_ptr<DeviceRuntime> runtime;
    std::string reason;   // why not usable
    std::string library;  // what was loaded, when usable
};

Usable make(const char* name, const DeviceApi* (*load)(std::string*)) {
    Usable out;
    std::string why;
    const DeviceApi* api = load(&why);
    if (api == nullptr) {
        out.reason = why;
        return out;
    }
    auto rt = std::make_unique<DeviceRuntime>(*api);
    if (rt->device_count() == 0) {
        out.reason = api->library + " (" + api->versions + ") loaded, but it sees no " + name +
                     " device";
        return out;
    }
    out.runtime = std::move(rt);
    out.library = api->library + " (" + api->versions + ")";
    return out;
}

#ifdef BAGUALU2_WITH_CUDA
const Usable& cuda_usable() {
    static const Usable usable = make("cuda", load_cuda_api);
    return usable;
}
#endif
#ifdef BAGUALU2_WITH_HIP
const Usable& hip_usable() {
    static const Usable usable = make("hip", load_hip_api);
    return usable;
}
#endif

Runtime& usable_or_throw(const char* name, const Usable& u) {
    BAGUALU2_RUNTIME_CHECK(u.runtime != nullptr, "backend '", name,
                           "' is compiled in but not usable: ", u.reason);
    return *u.runtime;
}
#endif

}  // namespace

#ifdef BAGUALU2_WITH_CUDA
Runtime& cuda_runtime() { return usable_or_throw("cuda", cuda_usable()); }
#endif
#ifdef BAGUALU2_WITH_HIP
Runtime& hip_runtime() { return usable_or_throw("hip", hip_usable()); }
#endif

BackendStatus device_backend_status(const std::string& name) {
    BackendStatus status;
    status.name = name;
#if defined(BAGUALU2_WITH_CUDA) || defined(BAGUALU2_WITH_HIP)
    const Usable* u = nullptr;
#ifdef BAGUALU2_WITH_CUDA
    if (name == "cuda") {
        u = &cuda_usable();
    }
#endif
#ifdef BAGUALU2_WITH_HIP
    if (name == "hip") {
        u = &hip_usable();
    }
#endif
    if (u != nullptr) {
        status.compiled = true;
        status.usable = u->runtime != nullptr;
        status.reason = u->reason;
        status.library = u->library;
        return status;
    }
#endif
    status.reason = "not compiled into this build of bagualu2 (rebuild with "
                    "BAGUALU2_BACKEND=auto or " + name + ")";
    return status;
}

}  // namespace bagualu2::gpu
