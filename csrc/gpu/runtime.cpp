// Backend registry of the neutral gpu:: API: selection by name and the device guard.
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
                   "compiled backends: ", known.str(),
                   " (rebuild with BAGUALU2_BACKEND=cuda or hip to add a GPU backend)");
    return cpu_runtime();  // unreachable
}

DeviceGuard::DeviceGuard(Runtime& rt, int device) : rt_(rt) {
    if (device < 0 || rt.is_host()) {
        return;
    }
    const int current = rt.get_device();
    if (current != device) {
        rt.set_device(device);
        previous_ = current;
    }
}

DeviceGuard::~DeviceGuard() {
    if (previous_ >= 0) {
        try {
            rt_.set_device(previous_);
        } catch (...) {
            // A destructor must not throw; the device stays as the guarded one.
        }
    }
}

}  // namespace bagualu2::gpu
