// The DeviceApi table of the HIP runtime (libamdhip64), loaded at first use.
//
// HIP's runtime API has cudart's semantics (a current device per thread, streams and events
// bound to it), so the adapters are one-line renames. bind() switches the thread's device only
// when it differs and returns the one it found; restore() switches back only then, so a
// thread's device changes for the span of a DeviceGuard and no longer. HIP has no "none": it
// reports device 0 on a thread that never chose one, so restoring that selects device 0 again,
// as HIP had it (unlike the CUDA driver, HIP selects a device without creating a context for
// it; not yet checked on a device). The library is looked for first among
// those already in the process (a ROCm build of torch loads its own copy, and a second HIP
// runtime in one process would not share its streams), then by the usual names, then under
// $ROCM_PATH and /opt/rocm (ROCm does not always register itself with the loader).
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/device_api.h"
#include "gpu/hip_abi.h"

namespace bagualu2::gpu {
namespace {

using namespace hip_abi;

// The runtime's entry points, resolved once by load().
struct Entries {
    InitFn init = nullptr;
    DriverGetVersionFn driver_get_version = nullptr;
    RuntimeGetVersionFn runtime_get_version = nullptr;
    GetDeviceCountFn get_device_count = nullptr;
    GetDeviceFn get_device = nullptr;
    SetDeviceFn set_device = nullptr;
    HostMallocFn host_malloc = nullptr;
    HostFreeFn host_free = nullptr;
    StreamCreateWithFlagsFn stream_create_with_flags = nullptr;
    StreamDestroyFn stream_destroy = nullptr;
    StreamSynchronizeFn stream_synchronize = nullptr;
    StreamWaitEventFn stream_wait_event = nullptr;
    EventCreateWithFlagsFn event_create_with_flags = nullptr;
    EventDestroyFn event_destroy = nullptr;
    EventRecordFn event_record = nullptr;
    EventQueryFn event_query = nullptr;
    EventSynchronizeFn event_synchronize = nullptr;
    EventElapsedTimeFn event_elapsed_time = nullptr;
    MemcpyAsyncFn memcpy_async = nullptr;
    StreamAddCallbackFn stream_add_callback = nullptr;
    StreamGetDeviceFn stream_get_device = nullptr;  // optional (ROCm 6)
    GetErrorNameFn get_error_name = nullptr;
    GetErrorStringFn get_error_string = nullptr;
};

Entries hip;

std::string describe(int status) {
    std::ostringstream out;
    out << (hip.get_error_name != nullptr ? hip.get_error_name(status) : "hip error") << " ("
        << status << "): "
        << (hip.get_error_string != nullptr ? hip.get_error_string(status) : "unknown");
    return out.str();
}

void callback(Stream /*stream*/, Error /*status*/, void* arg) { run_host_callback(arg); }

bool work_failed(int status) {
    for (const Error failure : kWorkFailures) {
        if (status == failure) {
            return true;
        }
    }
    return false;
}

DeviceApi table() {
    DeviceApi api;
    api.name = "hip";
    api.not_ready = kErrorNotReady;
    api.work_failed = work_failed;
    api.device_count = [](int* count) { return hip.get_device_count(count); };
    api.get_device = [](int* device) { return hip.get_device(device); };
    api.bind = [](int device, std::uintptr_t* previous) {
        int current = 0;
        const Error r = hip.get_device(&current);
        if (r != kSuccess) {
            return r;
        }
        *previous = static_cast<std::uintptr_t>(current);
        return current == device ? kSuccess : hip.set_device(device);
    };
    api.restore = [](std::uintptr_t previous) {
        int current = 0;
        const Error r = hip.get_device(&current);
        const int wanted = static_cast<int>(previous);
        return r != kSuccess || current == wanted ? r : hip.set_device(wanted);
    };
    api.host_alloc = [](void** ptr, std::size_t bytes) {
        return hip.host_malloc(ptr, bytes, kHostMallocPortable);
    };
    api.host_free = [](void* ptr) { return hip.host_free(ptr); };
    api.stream_create = [](void** stream) {
        return hip.stream_create_with_flags(stream, kStreamNonBlocking);
    };
    api.stream_destroy = [](void* stream) { return hip.stream_destroy(stream); };
    api.stream_synchronize = [](void* stream) { return hip.stream_synchronize(stream); };
    api.stream_wait_event = [](void* stream, void* event) {
        return hip.stream_wait_event(stream, event, 0);
    };
    if (hip.stream_get_device != nullptr) {
        api.stream_device = [](void* stream, int* device) {
            return hip.stream_get_device(stream, device);
        };
    }
    api.event_create = [](void** event, bool timing) {
        return hip.event_create_with_flags(event, timing ? kEventDefault : kEventDisableTiming);
    };
    api.event_destroy = [](void* event) { return hip.event_destroy(event); };
    api.event_record = [](void* event, void* stream) { return hip.event_record(event, stream); };
    api.event_query = [](void* event) { return hip.event_query(event); };
    api.event_synchronize = [](void* event) { return hip.event_synchronize(event); };
    api.event_elapsed_ms = [](float* ms, void* start, void* end) {
        return hip.event_elapsed_time(ms, start, end);
    };
    api.memcpy_async = [](void* dst, const void* src, std::size_t bytes, void* stream) {
        return hip.memcpy_async(dst, src, bytes, kMemcpyDefault, stream);
    };
    api.launch_host_callback = [](void* stream, void* arg) {
        return hip.stream_add_callback(stream, callback, arg, 0);
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
    std::vector<std::string> names{"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6",
                                   "libamdhip64.so.5"};
    if (const char* rocm = std::getenv("ROCM_PATH"); rocm != nullptr && *rocm != '\0') {
        names.push_back(std::string(rocm) + "/lib/libamdhip64.so");
    }
    names.emplace_back("/opt/rocm/lib/libamdhip64.so");
    names.emplace_back("/opt/dtk/lib/libamdhip64.so");  // Hygon DTK
    if (const char* env = std::getenv("BAGUALU2_HIP_LIBRARY"); env != nullptr && *env != '\0') {
        names = {env};
    }
    std::string tried;
    if (!lib.open(names, &tried)) {
        out.why = "the HIP runtime library (libamdhip64.so, from ROCm or Hygon's DTK) could not "
                  "be loaded: " + tried +
                  ". Install ROCm's HIP runtime (e.g. apt install rocm-hip-runtime, or Debian's "
                  "libamdhip64-5) or the DTK, let the dynamic loader find it (ldconfig, "
                  "LD_LIBRARY_PATH or ROCM_PATH), or name the file in BAGUALU2_HIP_LIBRARY";
        return out;
    }
    std::string missing;
    bool all = true;
    all &= lib.symbol({"hipInit"}, &hip.init, &missing);
    all &= lib.symbol({"hipDriverGetVersion"}, &hip.driver_get_version, &missing);
    all &= lib.symbol({"hipRuntimeGetVersion"}, &hip.runtime_get_version, &missing);
    all &= lib.symbol({"hipGetDeviceCount"}, &hip.get_device_count, &missing);
    all &= lib.symbol({"hipGetDevice"}, &hip.get_device, &missing);
    all &= lib.symbol({"hipSetDevice"}, &hip.set_device, &missing);
    all &= lib.symbol({"hipHostMalloc"}, &hip.host_malloc, &missing);
    all &= lib.symbol({"hipHostFree"}, &hip.host_free, &missing);
    all &= lib.symbol({"hipStreamCreateWithFlags"}, &hip.stream_create_with_flags, &missing);
    all &= lib.symbol({"hipStreamDestroy"}, &hip.stream_destroy, &missing);
    all &= lib.symbol({"hipStreamSynchronize"}, &hip.stream_synchronize, &missing);
    all &= lib.symbol({"hipStreamWaitEvent"}, &hip.stream_wait_event, &missing);
    all &= lib.symbol({"hipEventCreateWithFlags"}, &hip.event_create_with_flags, &missing);
    all &= lib.symbol({"hipEventDestroy"}, &hip.event_destroy, &missing);
    all &= lib.symbol({"hipEventRecord"}, &hip.event_record, &missing);
    all &= lib.symbol({"hipEventQuery"}, &hip.event_query, &missing);
    all &= lib.symbol({"hipEventSynchronize"}, &hip.event_synchronize, &missing);
    all &= lib.symbol({"hipEventElapsedTime"}, &hip.event_elapsed_time, &missing);
    all &= lib.symbol({"hipMemcpyAsync"}, &hip.memcpy_async, &missing);
    all &= lib.symbol({"hipStreamAddCallback"}, &hip.stream_add_callback, &missing);
    all &= lib.symbol({"hipGetErrorName"}, &hip.get_error_name, &missing);
    all &= lib.symbol({"hipGetErrorString"}, &hip.get_error_string, &missing);
    std::string optional;
    lib.symbol({"hipStreamGetDevice"}, &hip.stream_get_device, &optional);  // absent before ROCm 6
    if (!all) {
        out.why = lib.path() + " lacks " + missing + ": the HIP runtime is older than 5.0; update it";
        return out;
    }
    const Error r = hip.init(0);
    if (r != kSuccess) {
        const char* visible = std::getenv("HIP_VISIBLE_DEVICES");
        out.why = lib.path() + " loaded, but hipInit failed: " + describe(r) +
                  (visible != nullptr ? std::string(" (HIP_VISIBLE_DEVICES='") + visible + "')" : "");
        return out;
    }
    out.api = table();
    int driver = 0;
    int runtime = 0;
    hip.driver_get_version(&driver);
    hip.runtime_get_version(&runtime);
    out.api.library = lib.path();
    out.api.versions = "HIP runtime " + std::to_string(runtime) + ", driver " + std::to_string(driver);
    out.ok = true;
    return out;
}

}  // namespace

const DeviceApi* load_hip_api(std::string* why) {
    static const Loaded loaded = load();
    if (!loaded.ok && why != nullptr) {
        *why = loaded.why;
    }
    return loaded.ok ? &loaded.api : nullptr;
}

}  // namespace bagualu2::gpu
