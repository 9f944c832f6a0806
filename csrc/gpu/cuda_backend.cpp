// cuda backend of the neutral gpu:: API: thin wrappers over cudart (host code, no kernels).
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>

#include "common/check.h"
#include "gpu/gpu.h"

#define BAGUALU2_CUDA_CHECK(expr)                                                              \
    do {                                                                                       \
        const cudaError_t status_ = (expr);                                                    \
        BAGUALU2_RUNTIME_CHECK(status_ == cudaSuccess, #expr, " failed: ",                     \
                               cudaGetErrorString(status_));                                   \
    } while (false)

namespace bagualu2::gpu {
namespace {

cudaStream_t as_stream(Stream s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(Event e) { return static_cast<cudaEvent_t>(e); }

void CUDART_CB run_host_func(void* arg) {
    std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
    (*fn)();
}

class CudaRuntime final : public Runtime {
public:
    const char* name() const override { return "cuda"; }
    bool is_host() const override { return false; }

    int device_count() override {
        int count = 0;
        if (cudaGetDeviceCount(&count) != cudaSuccess) {
            (void)cudaGetLastError();  // no driver / no device: report zero, clear the error
            return 0;
        }
        return count;
    }

    int get_device() override {
        int device = 0;
        BAGUALU2_CUDA_CHECK(cudaGetDevice(&device));
        return device;
    }

    void set_device(int device) override { BAGUALU2_CUDA_CHECK(cudaSetDevice(device)); }

    void* host_alloc(std::size_t bytes) override {
        void* ptr = nullptr;
        BAGUALU2_CUDA_CHECK(cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable));
        return ptr;
    }

    void host_free(void* ptr) override { BAGUALU2_CUDA_CHECK(cudaFreeHost(ptr)); }

    Stream stream_create() override {
        cudaStream_t stream = nullptr;
        BAGUALU2_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        return stream;
    }

    void stream_destroy(Stream stream) override {
        BAGUALU2_CUDA_CHECK(cudaStreamDestroy(as_stream(stream)));
    }

    void stream_synchronize(Stream stream) override {
        BAGUALU2_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
    }

    void stream_wait_event(Stream stream, Event event) override {
        BAGUALU2_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
    }

    void check_stream(Stream /*stream*/) override {}

    Event event_create(bool timing) override {
        cudaEvent_t event = nullptr;
        BAGUALU2_CUDA_CHECK(
            cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming));
        return event;
    }

    void event_destroy(Event event) override { BAGUALU2_CUDA_CHECK(cudaEventDestroy(as_event(event))); }

    void event_record(Event event, Stream stream) override {
        BAGUALU2_CUDA_CHECK(cudaEventRecord(as_event(event), as_stream(stream)));
    }

    bool event_query(Event event) override {
        const cudaError_t status = cudaEventQuery(as_event(event));
        if (status == cudaErrorNotReady) {
            (void)cudaGetLastError();
            return false;
        }
        BAGUALU2_CUDA_CHECK(status);
        return true;
    }

    void event_synchronize(Event event) override {
        BAGUALU2_CUDA_CHECK(cudaEventSynchronize(as_event(event)));
    }

    double event_elapsed_ms(Event start, Event end) override {
        float ms = 0.0f;
        BAGUALU2_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
        return static_cast<double>(ms);
    }

    void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream stream) override {
        if (bytes == 0) {
            return;
        }
        BAGUALU2_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
    }

    void launch_host_func(Stream stream, std::function<void()> fn) override {
        auto* boxed = new std::function<void()>(std::move(fn));
        const cudaError_t status = cudaLaunchHostFunc(as_stream(stream), run_host_func, boxed);
        if (status != cudaSuccess) {
            delete boxed;
        }
        BAGUALU2_CUDA_CHECK(status);
    }
};

}  // namespace

Runtime& cuda_runtime() {
    static CudaRuntime* rt = new CudaRuntime();
    return *rt;
}

}  // namespace bagualu2::gpu
