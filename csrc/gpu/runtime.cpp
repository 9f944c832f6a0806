// Backend registry of the neutral gpu:: API: selection by name, status, the extension entry,
// object devices, the process-wide copy streams (gpu.h says why they are never destroyed) and
// the fork count.
#include <pthread.h>

#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "common/check.h"
#include "gpu/gpu.h"

namespace bagualu2::gpu {

std::vector<std::string> compiled_backends() {
    std::vector<std::string> names{"cpu"};
#ifdef BAGUALU2_WITH_CUDA
    names.emplace_back("cuda");
#endif
#ifdef BAGUALU2_WITH_HIP
    names.emplace_back("hip");
#endif
    return names;
}

Runtime& runtime(const std::string& name) {
    if (name == "cpu") {
        return cpu_runtime();
    }
#ifdef BAGUALU2_WITH_CUDA
    if (name == "cuda") {
        return cuda_runtime();
    }
#endif
#ifdef BAGUALU2_WITH_HIP
    if (name == "hip") {
        return hip_runtime();
    }
#endif
    std::ostringstream known;
    const auto names = compiled_backends();
    for (std::size_t i = 0; i < names.size(); ++i) {
        known << (i ? ", " : "") << "'" << names[i] << "'";
    }
    BAGUALU2_CHECK(false, "backend '", name, "' is not compiled into this build of bagualu2; ",
                   "compiled backends: [", known.str(), "]",
                   " (rebuild with BAGUALU2_BACKEND=auto, cuda or hip to add a GPU backend)");
    return cpu_runtime();  // unreachable
}

std::vector<BackendStatus> backend_status() {
    BackendStatus cpu;
    cpu.name = "cpu";
    cpu.compiled = true;
    cpu.usable = true;
    return {cpu, device_backend_status("cuda"), device_backend_status("hip")};
}

int resolve_device(Runtime& rt, int device, const char* what) {
    if (rt.is_host()) {
        return 0;
    }
    const int count = rt.device_count();
    BAGUALU2_CHECK(count > 0, "backend '", rt.name(), "' is compiled in but sees no device");
    const int chosen = device < 0 ? rt.get_device() : device;
    BAGUALU2_CHECK(chosen >= 0, what, " on backend '", rt.name(),
                   "' was given no device and the calling thread has none current: pass "
                   "device= (bagualu2 never picks device 0 by default)");
    BAGUALU2_CHECK(chosen < count, what, ": device ", chosen, " out of range [0, ", count, ")");
    return chosen;
}

CopyStream copy_stream(Runtime& rt, int device, int slot) {
    BAGUALU2_CHECK(!rt.is_host(), "copy_stream is for GPU backends");
    // Never destroyed: torch may record on these streams until the process ends; their locks
    // live as long (an engine may be destroyed at exit after this map's storage would be).
    static std::mutex* mutex = new std::mutex;
    static auto* streams = new std::map<std::tuple<const Runtime*, int, int>, CopyStream>;
    std::lock_guard<std::mutex> lock(*mutex);
    CopyStream& entry = (*streams)[std::make_tuple(&rt, device, slot)];
    if (entry.stream == nullptr) {
        DeviceGuard guard(rt, device);
        entry.stream = rt.stream_create();
        entry.submit = new std::mutex;
    }
    return entry;
}

namespace {
std::atomic<std::uint64_t> forks{0};

// Registered when _C loads: only the child's handler, which counts (async-signal-safe).
const int atfork_registered = pthread_atfork(nullptr, nullptr, [] {
    forks.fetch_add(1, std::memory_order_relaxed);
});
}  // namespace

std::uint64_t fork_generation() {
    static_cast<void>(atfork_registered);
    return forks.load(std::memory_order_relaxed);
}

void check_not_forked(std::uint64_t born, const char* backend) {
    BAGUALU2_RUNTIME_CHECK(forks.load(std::memory_order_relaxed) == born, "the ", backend,
                           " runtime was created before this process was forked: its contexts, "
                           "streams and worker threads do not exist in a forked child (use the "
                           "'spawn' or 'forkserver' start method for workers that offload, e.g. "
                           "DataLoader(multiprocessing_context='spawn'))");
}

Runtime* lookup_runtime(const char* name, std::string* error) {
    try {
        return &runtime(name);
    } catch (const std::exception& e) {
        if (error != nullptr) {
            *error = e.what();
        }
        return nullptr;
    }
}

}  // namespace bagualu2::gpu
