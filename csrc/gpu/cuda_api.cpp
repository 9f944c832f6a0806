// The DeviceApi table of the CUDA driver API (libcuda.so.1), loaded at first use.
//
// Why the driver API: libcuda.so.1 ships with the NVIDIA driver, so one build works beside any
// torch CUDA build (cudart 11, 12 or 13) and needs no toolkit. Its handles are the runtime's
// (torch's cudaStream_t is a CUstream). What differs from cudart is the current context: the
// driver binds work to the calling thread's context. bagualu2 and torch (cudart) share one
// context per device, the device's primary context, and bagualu2 never opens one the process
// did not ask for:
//   * bind(d) makes device d's primary context current and returns the raw context it found
//     (null included); restore() sets exactly that back, so a thread that had no context has
//     none afterwards. d's primary context is retained once per process, on the first bind of
//     d, and never released (runtimes live as long as the process).
//   * No other entry binds anything. There is no "device 0 by default": a call on a thread
//     with no current context fails as the driver makes it fail. Callers bind the device of
//     the object they act on (gpu::DeviceGuard), so finalizers that run on the garbage
//     collector's thread, and torch's autograd threads, touch only the devices their objects
//     live on. (cudart's implicit initialisation binds device 0's primary context: under
//     torchrun every rank would hold a context on GPU 0.)
//   * get_device() is the current context's device, or -1 when the thread has none.
//   * stream_device() maps a stream's context (cuStreamGetCtx) to the device whose primary
//     context it is; a handle of a context bagualu2 never bound reports -1.
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
#define BAGUALU2_CUDA_FIELD(api, Fn, field, ...) Fn field = nullptr;
    BAGUALU2_CUDA_ENTRY_POINTS(BAGUALU2_CUDA_FIELD)
#undef BAGUALU2_CUDA_FIELD
};

Driver cu;

// Primary contexts retained so far, by device ordinal; guarded by contexts_mutex.
std::mutex contexts_mutex;
std::vector<Context> contexts;

// Device `device`'s primary context, retained on first use.
Result primary(int device, Context* ctx) {
    std::lock_guard<std::mutex> lock(contexts_mutex);
    const auto index = static_cast<std::size_t>(device);
    if (device >= 0 && index < contexts.size() && contexts[index] != nullptr) {
        *ctx = contexts[index];
        return kSuccess;
    }
    Device dev = 0;
    Result r = cu.device_get(&dev, device);
    if (r != kSuccess) {
        return r;
    }
    r = cu.primary_ctx_retain(ctx, dev);
    if (r != kSuccess) {
        return r;
    }
    if (contexts.size() <= index) {
        contexts.resize(index + 1, nullptr);
    }
    contexts[index] = *ctx;
    return kSuccess;
}

Result bind(int device, std::uintptr_t* previous) {
    Context current = nullptr;
    Result r = cu.ctx_get_current(&current);
    if (r != kSuccess) {
        return r;
    }
    *previous = reinterpret_cast<std::uintptr_t>(current);
    Context target = nullptr;
    r = primary(device, &target);
    if (r != kSuccess || target == current) {
        return r;
    }
    return cu.ctx_set_current(target);
}

Result restore(std::uintptr_t previous) {
    Context current = nullptr;
    const Result r = cu.ctx_get_current(&current);
    if (r != kSuccess) {
        return r;
    }
    const auto wanted = reinterpret_cast<Context>(previous);
    return current == wanted ? kSuccess : cu.ctx_set_current(wanted);
}

Result get_device(int* device) {
    Context ctx = nullptr;
    const Result r = cu.ctx_get_current(&ctx);
    if (r != kSuccess) {
        return r;
    }
    if (ctx == nullptr) {
        *device = -1;
        return kSuccess;
    }
    return cu.ctx_get_device(device);
}

Result stream_device(void* stream, int* device) {
    Context ctx = nullptr;
    const Result r = cu.stream_get_ctx(stream, &ctx);
    if (r != kSuccess) {
        return r;
    }
    std::lock_guard<std::mutex> lock(contexts_mutex);
    *device = -1;
    for (std::size_t i = 0; i < contexts.size(); ++i) {
        if (contexts[i] != nullptr && contexts[i] == ctx) {
            *device = static_cast<int>(i);
        }
    }
    return kSuccess;
}

bool work_failed(int status) {
    for (const Result failure : kWorkFailures) {
        if (status == failure) {
            return true;
        }
    }
    return false;
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

DeviceApi table() {
    DeviceApi api;
    api.name = "cuda";
    api.not_ready = kErrorNotReady;
    api.work_failed = work_failed;
    api.device_count = [](int* count) { return cu.device_get_count(count); };
    api.get_device = get_device;
    api.bind = bind;
    api.restore = restore;
    api.host_alloc = [](void** ptr, std::size_t bytes) {
        return cu.mem_host_alloc(ptr, bytes, kMemHostAllocPortable);
    };
    api.host_free = [](void* ptr) { return cu.mem_free_host(ptr); };
    api.stream_create = [](void** stream) { return cu.stream_create(stream, kStreamNonBlocking); };
    api.stream_destroy = [](void* stream) { return cu.stream_destroy(stream); };
    api.stream_synchronize = [](void* stream) { return cu.stream_synchronize(stream); };
    api.stream_wait_event = [](void* stream, void* event) {
        return cu.stream_wait_event(stream, event, 0);
    };
    api.stream_device = stream_device;
    api.event_create = [](void** event, bool timing) {
        return cu.event_create(event, timing ? kEventDefault : kEventDisableTiming);
    };
    api.event_destroy = [](void* event) { return cu.event_destroy(event); };
    api.event_record = [](void* event, void* stream) { return cu.event_record(event, stream); };
    api.event_query = [](void* event) { return cu.event_query(event); };
    api.event_synchronize = [](void* event) { return cu.event_synchronize(event); };
    api.event_elapsed_ms = [](float* ms, void* start, void* end) {
        return cu.event_elapsed_time(ms, start, end);
    };
    api.memcpy_async = [](void* dst, const void* src, std::size_t bytes, void* stream) {
        return cu.memcpy_async(address(dst), address(src), bytes, stream);
    };
    api.launch_host_callback = [](void* stream, void* arg) {
        return cu.launch_host_func(stream, run_host_callback, arg);
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
        out.why = std::string("the CUDA driver API library (libcuda.so.1, installed with the "
                              "NVIDIA driver) could not be loaded: ") + tried +
                  ". Install the NVIDIA driver (" + kMinimumDriver + " or newer), let the "
                  "dynamic loader find it (ldconfig or LD_LIBRARY_PATH), start containers with "
                  "the NVIDIA Container Toolkit (--gpus), or name the file in "
                  "BAGUALU2_CUDA_LIBRARY";
        return out;
    }
    std::string missing;
    bool all = true;
#define BAGUALU2_CUDA_RESOLVE(api, Fn, field, ...) \
    all &= lib.symbol({__VA_ARGS__}, &cu.field, &missing);
    BAGUALU2_CUDA_ENTRY_POINTS(BAGUALU2_CUDA_RESOLVE)
#undef BAGUALU2_CUDA_RESOLVE
    if (!all) {
        out.why = lib.path() + " lacks " + missing + ": the NVIDIA driver is older than " +
                  kMinimumDriver + ", which added the newest of them; update it";
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
