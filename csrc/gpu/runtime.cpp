// Backend registry of the neutral gpu:: API: selection by name, status, the extension entry.
#include <sstream>

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
