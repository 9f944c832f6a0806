// The DeviceApi table of the CUDA driver API (libcuda.so.1), loaded at first use.
//
// Why the driver API: libcuda.so.1 ships with the NVIDIA driver, so one build works beside any
// torch CUDA build (cudart 11, 12 or 13) and needs no toolkit. Its handles are the runtime's
// (torch's cudaStream_t is a CUstream). What differs from cudart is the current context:
// the driver binds work to the calling thread's context, where cudart binds it to a current
// device whose primary context it creates on first use. The adapters below keep cudart's
// semantics, so bagualu2 and torch (cudart) share one context per device:
//   * set_device(d) makes device d's primary context current (retained once per process, as
//     cudart does, and never released: runtimes live as long as the process);
//   * get_device() is the current context's device, or 0 when the thread has none yet;
//   * every other call first binds device 0's primary context when the thread has none, as
//     cudart's implicit initialisation would.
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/cuda_abi.h"
#include "gpu/device_api.h"

namespace bagualu2::gpu {
namespace {

using namespace cuda_abi;

// The driver's entry points, resolved once by load().
struct Driver {
    InitFn init = nullptr;
    DriverGetVersionFn driver_get_version = nullptr;
    DeviceGetCountFn device_get_count = nullptr;
    DeviceGetFn device_get = nullptr;
    PrimaryCtxRetainFn primary_ctx_retain = nullptr;
    CtxGetCurrentFn ctx_get_current = nullptr;
    CtxSetCurrentFn ctx_set_current = nullptr;
    CtxGetDeviceFn ctx_get_device = nullptr;
    MemHostAllocFn mem_host_alloc = nullptr;
    MemFreeHostFn mem_free_host = nullptr;
    StreamCreateFn stream_create = nullptr;
    StreamDestroyFn stream_destroy = nullptr;
    StreamSynchronizeFn stream_synchronize = nullptr;
    StreamWaitEventFn stream_wait_event = nullptr;
    EventCreateFn event_create = nullptr;
    EventDestroyFn event_destroy = nullptr;
    EventRecordFn event_record = nullptr;
    EventQueryFn event_query = nullptr;
    EventSynchronizeFn event_synchronize = nullptr;
    EventElapsedTimeFn event_elapsed_time = nullptr;
    MemcpyAsyncFn memcpy_async = nullptr;
    LaunchHostFuncFn launch_host_func = nullptr;
    GetErrorStringFn get_error_string = nullptr;
    GetErrorNameFn get_error_name = nullptr;
};

Driver cu;

// Primary contexts retained so far, by device ordinal; guarded by contexts_mutex.
std::mutex contexts_mutex;
std::vector<Context> contexts;

Result set_device(int device) {
    Context ctx = nullptr;
    {
        std::lock_guard<std::mutex> lock(contexts_mutex);
        if (device >= 0 && static_cast<std::size_t>(device) < contexts.size()) {
            ctx = contexts[static_cast<std::size_t>(device)];
        }
        if (ctx == nullptr) {
            Device dev = 0;
            Result r = cu.device_get(&dev, device);
            if (r != kSuccess) {
                return r;
            }
            r = cu.primary_ctx_retain(&ctx, dev);
            if (r != kSuccess) {
                return r;
            }
            if (contexts.size() <= static_cast<std::size_t>(device)) {
                contexts.resize(static_cast<std::size_t>(device) + 1, nullptr);
            }
            contexts[static_cast<std::size_t>(device)] = ctx;
        }
    }
    return cu.ctx_set_current(ctx);
}

// Binds device 0's primary context when the calling thread has no current context.
Result bind() {
    Context ctx = nullptr;
    const Result r = cu.ctx_get_current(&ctx);
    if (r != kSuccess || ctx != nullptr) {
        return r;
    }
    return set_device(0);
}

Result get_device(int* device) {
    Context ctx = nullptr;
    const Result r = cu.ctx_get_current(&ctx);
    if (r != kSuccess) {
        return r;
    }
    if (ctx == nullptr) {
        *device = 0;
        return kSuccess;
    }
    return cu.ctx_get_device(device);
}

DevicePtr address(const void* ptr) {
    return static_cast<DevicePtr>(reinterpret_cast<std::uintptr_t>(ptr));
}

std::string describe(int status) {
    const char* name = nullptr;
    const char* text = nullptr;
    if (cu.get_error_name == nullptr || cu.get_error_name(status, &name) != kSuccess) {
        name = "CUDA error";
    }
    if (cu.get_error_string == nullptr || cu.get_error_string(status, &text) != kSuccess) {
        text = "unknown";
    }
    std::ostringstream out;
    out << name << " (" << status << "): " << text;
    return out.str();
}

// Runs `call` once a context is bound; a failed binding is the call's status.
template <typename Call>
Result bound(Call call) {
    const Result r = bind();
    return r != kSuccess ? r : call();
}

DeviceApi table() {
    DeviceApi api;
    api.name = "cuda";
    api.not_ready = kErrorNotReady;
    api.device_count = [](int* count) { return cu.device_get_count(count); };
    api.get_device = get_device;
    api.set_device = set_device;
    api.host_alloc = [](void** ptr, std::size_t bytes) {
        return bound([&] { return cu.mem_host_alloc(ptr, bytes, kMemHostAllocPortable); });
    };
    api.host_free = [](void* ptr) { return bound([&] { return cu.mem_free_host(ptr); }); };
    api.stream_create = [](void** stream) {
        return bound([&] { return cu.stream_create(stream, kStreamNonBlocking); });
    };
    api.stream_destroy = [](void* stream) {
        return bound([&] { return cu.stream_destroy(stream); });
    };
    api.stream_synchronize = [](void* stream) {
        return bound([&] { return cu.stream_synchronize(stream); });
    };
    api.stream_wait_event = [](void* stream, void* event) {
        return bound([&] { return cu.stream_wait_event(stream, event, 0); });
    };
    api.event_create = [](void** event, bool timing) {
        const unsigned flags = timing ? kEventDefault : kEventDisableTiming;
        return bound([&] { return cu.event_create(event, flags); });
    };
    api.event_destroy = [](void* event) { return bound([&] { return cu.event_destroy(event); }); };
    api.event_record = [](void* event, void* stream) {
        return bound([&] { return cu.event_record(event, stream); });
    };
    api.event_query = [](void* event) { return bound([&] { return cu.event_query(event); }); };
    api.event_synchronize = [](void* event) {
        return bound([&] { return cu.event_synchronize(event); });
    };
    api.event_elapsed_ms = [](float* ms, void* start, void* end) {
        return bound([&] { return cu.event_elapsed_time(ms, start, end); });
    };
    api.memcpy_async = [](void* dst, const void* src, std::size_t bytes, void* stream) {
        return bound([&] { return cu.memcpy_async(address(dst), address(src), bytes, stream); });
    };
    api.launch_host_callback = [](void* stream, void* arg) {
        return bound([&] { return cu.launch_host_func(stream, run_host_callback, arg); });
    };
    api.describe = describe;
    return api;
}

// The table, or why there is none; built once.
struct Loaded {
    DeviceApi api;
    bool ok = false;
    std::string why;
};

Loaded load() {
    Loaded out;
    static Library lib;
    std::vector<std::string> names{"libcuda.so.1", "libcuda.so"};
    if (const char* env = std::getenv("BAGUALU2_CUDA_LIBRARY"); env != nullptr && *env != '\0') {
        names = {env};
    }
    std::string tried;
    if (!lib.open(names, &tried)) {
        out.why = "the CUDA driver API library (libcuda.so.1, installed with the NVIDIA driver) "
                  "could not be loaded: " + tried +
                  ". Install the NVIDIA driver (R450 or newer), let the dynamic loader find it "
                  "(ldconfig or LD_LIBRARY_PATH), start containers with the NVIDIA Container "
                  "Toolkit (--gpus), or name the file in BAGUALU2_CUDA_LIBRARY";
        return out;
    }
    std::string missing;
    bool all = true;
    all &= lib.symbol({"cuInit"}, &cu.init, &missing);
    all &= lib.symbol({"cuDriverGetVersion"}, &cu.driver_get_version, &missing);
    all &= lib.symbol({"cuDeviceGetCount"}, &cu.device_get_count, &missing);
    all &= lib.symbol({"cuDeviceGet"}, &cu.device_get, &missing);
    all &= lib.symbol({"cuDevicePrimaryCtxRetain"}, &cu.primary_ctx_retain, &missing);
    all &= lib.symbol({"cuCtxGetCurrent"}, &cu.ctx_get_current, &missing);
    all &= lib.symbol({"cuCtxSetCurrent"}, &cu.ctx_set_current, &missing);
    all &= lib.symbol({"cuCtxGetDevice"}, &cu.ctx_get_device, &missing);
    all &= lib.symbol({"cuMemHostAlloc"}, &cu.mem_host_alloc, &missing);
    all &= lib.symbol({"cuMemFreeHost"}, &cu.mem_free_host, &missing);
    all &= lib.symbol({"cuStreamCreate"}, &cu.stream_create, &missing);
    all &= lib.symbol({"cuStreamDestroy_v2"}, &cu.stream_destroy, &missing);
    all &= lib.symbol({"cuStreamSynchronize"}, &cu.stream_synchronize, &missing);
    all &= lib.symbol({"cuStreamWaitEvent"}, &cu.stream_wait_event, &missing);
    all &= lib.symbol({"cuEventCreate"}, &cu.event_create, &missing);
    all &= lib.symbol({"cuEventDestroy_v2"}, &cu.event_destroy, &missing);
    all &= lib.symbol({"cuEventRecord"}, &cu.event_record, &missing);
    all &= lib.symbol({"cuEventQuery"}, &cu.event_query, &missing);
    all &= lib.symbol({"cuEventSynchronize"}, &cu.event_synchronize, &missing);
    // The unversioned name is in every driver; _v2 (same prototype) where a future one drops it.
    all &= lib.symbol({"cuEventElapsedTime", "cuEventElapsedTime_v2"}, &cu.event_elapsed_time,
                      &missing);
    all &= lib.symbol({"cuMemcpyAsync"}, &cu.memcpy_async, &missing);
    all &= lib.symbol({"cuLaunchHostFunc"}, &cu.launch_host_func, &missing);
    all &= lib.symbol({"cuGetErrorString"}, &cu.get_error_string, &missing);
    all &= lib.symbol({"cuGetErrorName"}, &cu.get_error_name, &missing);
    if (!all) {
        out.why = lib.path() + " lacks " + missing +
                  ": the NVIDIA driver is too old (CUDA 10.0, R410, added the newest of them); "
                  "update it";
        return out;
    }
    const Result r = cu.init(0);
    if (r != kSuccess) {
        const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
        out.why = lib.path() + " loaded, but cuInit failed: " + describe(r) +
                  (visible != nullptr ? std::string(" (CUDA_VISIBLE_DEVICES='") + visible + "')" : "");
        return out;
    }
    out.api = table();
    int version = 0;
    cu.driver_get_version(&version);
    out.api.library = lib.path();
    out.api.versions = "CUDA driver API " + std::to_string(version / 1000) + "." +
                       std::to_string(version % 1000 / 10);
    out.ok = true;
    return out;
}

}  // namespace

const DeviceApi* load_cuda_api(std::string* why) {
    static const Loaded loaded = load();
    if (!loaded.ok && why != nullptr) {
        *why = loaded.why;
    }
    return loaded.ok ? &loaded.api : nullptr;
}

}  // namespace bagualu2::gpu
