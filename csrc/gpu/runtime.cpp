// Backend registry of the neutral gpu:: API: selection by name, status, the extension entry,
// object devices and the process-wide copy streams (gpu.h says why they are never destroyed).
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

Stream copy_stream(Runtime& rt, int device, int slot) {
    BAGUALU2_CHECK(!rt.is_host(), "copy_stream is for GPU backends");
    // Never destroyed: torch may record on these streams until the process ends.
    static std::mutex* mutex = new std::mutex;
    static auto* streams = new std::map<std::tuple<const Runtime*, int, int>, Stream>;
    std::lock_guard<std::mutex> lock(*mutex);
    Stream& stream = (*streams)[std::make_tuple(&rt, device, slot)];
    if (stream == nullptr) {
        DeviceGuard guard(rt, device);
        stream = rt.stream_create();
    }
    return stream;
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
