// hip backend of the neutral gpu:: API: thin wrappers over the HIP runtime (hip_runtime_api.h) (host code, no kernels).
#include <hip/hip_runtime_api.h>

#include <functional>
#include <memory>

#include "common/check.h"
#include "gpu/gpu.h"

#ifndef HIPRT_CB
#define HIPRT_CB  // older hip_runtime_api.h (Debian 5.2) has no calling-convention macro
#endif

#define BAGUALU2_HIP_CHECK(expr)                                                              \
    do {                                                                                       \
        const hipError_t status_ = (expr);                                                    \
        BAGUALU2_RUNTIME_CHECK(status_ == hipSuccess, #expr, " failed: ",                     \
                               hipGetErrorString(status_));                                   \
    } while (false)

namespace bagualu2::gpu {
namespace {

hipStream_t as_stream(Stream s) { return static_cast<hipStream_t>(s); }
hipEvent_t as_event(Event e) { return static_cast<hipEvent_t>(e); }

// hipStreamAddCallback rather than hipLaunchHostFunc: the latter is missing from older HIP
// runtimes (Debian's libamdhip64 5.2), the former exists everywhere.
void HIPRT_CB run_host_func(hipStream_t /*stream*/, hipError_t /*status*/, void* arg) {
    std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
    (*fn)();
}

class HipRuntime final : public Runtime {
public:
    const char* name() const override { return "hip"; }
    bool is_host() const override { return false; }

    int device_count() override {
        int count = 0;
        if (hipGetDeviceCount(&count) != hipSuccess) {
            (void)hipGetLastError();  // no driver / no device: report zero, clear the error
            return 0;
        }
        return count;
    }

    int get_device() override {
        int device = 0;
        BAGUALU2_HIP_CHECK(hipGetDevice(&device));
        return device;
    }

    void set_device(int device) override { BAGUALU2_HIP_CHECK(hipSetDevice(device)); }

    void* host_alloc(std::size_t bytes) override {
        void* ptr = nullptr;
        BAGUALU2_HIP_CHECK(hipHostMalloc(&ptr, bytes, hipHostMallocPortable));
        return ptr;
    }

    void host_free(void* ptr) override { BAGUALU2_HIP_CHECK(hipHostFree(ptr)); }

    Stream stream_create() override {
        hipStream_t stream = nullptr;
        BAGUALU2_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
        return stream;
    }

    void stream_destroy(Stream stream) override {
        BAGUALU2_HIP_CHECK(hipStreamDestroy(as_stream(stream)));
    }

    void stream_synchronize(Stream stream) override {
        BAGUALU2_HIP_CHECK(hipStreamSynchronize(as_stream(stream)));
    }

    void stream_wait_event(Stream stream, Event event) override {
        BAGUALU2_HIP_CHECK(hipStreamWaitEvent(as_stream(stream), as_event(event), 0));
    }

    void check_stream(Stream /*stream*/) override {}

    Event event_create(bool timing) override {
        hipEvent_t event = nullptr;
        BAGUALU2_HIP_CHECK(
            hipEventCreateWithFlags(&event, timing ? hipEventDefault : hipEventDisableTiming));
        return event;
    }

    void event_destroy(Event event) override { BAGUALU2_HIP_CHECK(hipEventDestroy(as_event(event))); }

    void event_record(Event event, Stream stream) override {
        BAGUALU2_HIP_CHECK(hipEventRecord(as_event(event), as_stream(stream)));
    }

    bool event_query(Event event) override {
        const hipError_t status = hipEventQuery(as_event(event));
        if (status == hipErrorNotReady) {
            (void)hipGetLastError();
            return false;
        }
        BAGUALU2_HIP_CHECK(status);
        return true;
    }

    void event_synchronize(Event event) override {
        BAGUALU2_HIP_CHECK(hipEventSynchronize(as_event(event)));
    }

    double event_elapsed_ms(Event start, Event end) override {
        float ms = 0.0f;
        BAGUALU2_HIP_CHECK(hipEventElapsedTime(&ms, as_event(start), as_event(end)));
        return static_cast<double>(ms);
    }

    void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream stream) override {
        if (bytes == 0) {
            return;
        }
        BAGUALU2_HIP_CHECK(hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, as_stream(stream)));
    }

    void launch_host_func(Stream stream, std::function<void()> fn) override {
        auto* boxed = new std::function<void()>(std::move(fn));
        const hipError_t status = hipStreamAddCallback(as_stream(stream), run_host_func, boxed, 0);
        if (status != hipSuccess) {
            delete boxed;
        }
        BAGUALU2_HIP_CHECK(status);
    }
};

}  // namespace

Runtime& hip_runtime() {
    static HipRuntime* rt = new HipRuntime();
    return *rt;
}

}  // namespace bagualu2::gpu
