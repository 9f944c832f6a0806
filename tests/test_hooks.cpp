// bagualu2_test_hooks: test-only types, built beside the tests that use them and never shipped.
//
// Built by CMake when BAGUALU2_TEST_HOOKS=ON (editable installs turn it on and put the module in
// tests/; CI builds it next to each _C it tests). It reaches the runtimes of the loaded
// bagualu2._C through the `_runtime_api` capsule, so a Stream made here is one _C knows (the cpu
// backend checks every handle against its registry of live streams).
//
//   Stream(backend="cpu", device=-1)  a runtime stream owned by Python: .handle, .copy(dst, src,
//                                     n), .wait_fence(fence), .synchronize()
//   HostFence()                       a bagualu2._C.Fence completed by .signal(); holds a block
//                                     or a stream "in flight" for as long as a test wants
//   set_copy_faults(mode, count=1, after=0), copy_faults_left()
//                                     the copy fault switch of gpu/copy_faults.h: let `after`
//                                     copies through, then fail `count` of them at "submit" or
//                                     "execute" ("off" disarms). _C binds no access to it: this
//                                     module finds the two C functions _C exports for it with
//                                     dlsym on the _C already loaded (dlopen of its __file__ with
//                                     RTLD_NOLOAD, which finds and never loads), at import.
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "gpu/copy_faults.h"
#include "gpu/gpu.h"
#include "offload/fence.h"

namespace py = pybind11;

namespace {

bagualu2::gpu::RuntimeLookup lookup = nullptr;

bagualu2::gpu::Runtime& runtime(const std::string& name) {
    std::string error;
    bagualu2::gpu::Runtime* rt = lookup(name.c_str(), &error);
    if (rt == nullptr) {
        throw py::value_error(error);
    }
    return *rt;
}

// The copy fault switch inside the loaded _C (nullptr, with why_no_switch, when not found).
decltype(&bagualu2_test_set_copy_faults) set_faults = nullptr;
decltype(&bagualu2_test_copy_faults_left) faults_left = nullptr;
std::string why_no_switch;

template <typename Fn>
void resolve(void* handle, const char* name, Fn* fn) {
    void* address = dlsym(handle, name);
    if (address == nullptr) {
        why_no_switch = std::string(name) + " is not exported by it (a _C built without the switch)";
        return;
    }
    // dlsym's object pointer to a function pointer (POSIX guarantees this works).
    *fn = reinterpret_cast<Fn>(reinterpret_cast<std::size_t>(address));
}

// Finds the switch in the _C at `path`, already loaded by the import of bagualu2._C.
void find_fault_switch(const std::string& path) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) {
        const char* error = dlerror();
        why_no_switch = "dlopen(" + path + ", RTLD_NOLOAD) found no loaded _C: " +
                        (error != nullptr ? error : "?");
        return;
    }
    resolve(handle, "bagualu2_test_set_copy_faults", &set_faults);
    resolve(handle, "bagualu2_test_copy_faults_left", &faults_left);
    dlclose(handle);  // drops the reference RTLD_NOLOAD took; Python's import keeps _C loaded
    if (set_faults == nullptr || faults_left == nullptr) {
        set_faults = nullptr;
        faults_left = nullptr;
        why_no_switch = "the copy fault switch of " + path + ": " + why_no_switch;
    }
}

void check_switch() {
    if (set_faults == nullptr) {
        throw std::runtime_error(why_no_switch);
    }
}

void set_copy_faults(const std::string& mode, long long count, long long after) {
    check_switch();
    int code = -1;
    if (mode == "off") {
        code = 0;
    } else if (mode == "submit") {
        code = static_cast<int>(bagualu2::gpu::CopyFault::kSubmit);
    } else if (mode == "execute") {
        code = static_cast<int>(bagualu2::gpu::CopyFault::kExecute);
    } else {
        throw py::value_error("set_copy_faults: mode must be 'off', 'submit' or 'execute', got '" +
                              mode + "'");
    }
    if (set_faults(code, count, after) != 0) {
        throw py::value_error("set_copy_faults: count and after must be >= 0, got count=" +
                              std::to_string(count) + ", after=" + std::to_string(after));
    }
}

long long copy_faults_left() {
    check_switch();
    return faults_left();
}

// A fence completed by host code calling signal().
class HostFence final : public bagualu2::Fence {
public:
    bool ready() override { return signalled_.load(std::memory_order_acquire); }

    void wait() override {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return signalled_.load(std::memory_order_acquire); });
    }

    void signal() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            signalled_.store(true, std::memory_order_release);
        }
        cv_.notify_all();
    }

private:
    // The flag and the wake-up machinery for wait().
    std::atomic<bool> signalled_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
};

// A runtime stream owned by Python, for producers and consumers torch does not know about.
class Stream {
public:
    Stream(const std::string& backend, int device)
        : rt_(runtime(backend)), device_(device < 0 ? rt_.get_device() : device),
          stream_(rt_, device_) {
        BAGUALU2_CHECK(device_ >= 0, "Stream: no device given and none current: pass device=");
    }

    std::uintptr_t handle() const { return reinterpret_cast<std::uintptr_t>(stream_.get()); }

    void synchronize() {
        bagualu2::gpu::DeviceGuard guard(rt_, device_);
        rt_.stream_synchronize(stream_.get());
    }

    void copy(std::uintptr_t dst, std::uintptr_t src, std::int64_t nbytes) {
        BAGUALU2_CHECK(nbytes >= 0, "Stream.copy: nbytes must be >= 0, got ", nbytes);
        BAGUALU2_CHECK(nbytes == 0 || (dst != 0 && src != 0), "Stream.copy: null pointer");
        bagualu2::gpu::DeviceGuard guard(rt_, device_);
        rt_.memcpy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                         static_cast<std::size_t>(nbytes), stream_.get());
    }

    void wait_fence(const std::shared_ptr<HostFence>& fence) {
        BAGUALU2_CHECK(fence != nullptr, "Stream.wait_fence(None)");
        bagualu2::gpu::DeviceGuard guard(rt_, device_);
        rt_.launch_host_func(stream_.get(), [fence] { fence->wait(); });
    }

private:
    // Runtime, device and the stream (drained and destroyed with this object).
    bagualu2::gpu::Runtime& rt_;
    int device_;
    bagualu2::gpu::UniqueStream stream_;
};

}  // namespace

PYBIND11_MODULE(bagualu2_test_hooks, m) {
    m.doc() = "Test-only hooks of bagualu2 (tests/test_hooks.cpp); never shipped.";
    py::module_ core = py::module_::import("bagualu2._C");  // registers Fence and the errors
    auto capsule = core.attr("_runtime_api").cast<py::capsule>();
    lookup = reinterpret_cast<bagualu2::gpu::RuntimeLookup>(capsule.get_pointer());
    find_fault_switch(core.attr("__file__").cast<std::string>());

    m.def("set_copy_faults", &set_copy_faults, py::arg("mode"), py::arg("count") = 1,
          py::arg("after") = 0,
          "Test-only copy faults (gpu/copy_faults.h), process wide, every backend: let `after` "
          "copies (memcpy calls, one per chunk) through, then fail `count` at 'submit' (the "
          "call raises) or 'execute' (the copy is skipped, its completion fails); 'off' "
          "disarms. Replaces an earlier setting.");
    m.def("copy_faults_left", &copy_faults_left, "Faults armed and not injected yet.");

    py::class_<HostFence, bagualu2::Fence, std::shared_ptr<HostFence>>(
        m, "HostFence", "A fence completed by calling signal() from host code.")
        .def(py::init<>())
        .def("signal", &HostFence::signal, "Mark complete and wake waiters.");

    py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream", "A runtime stream owned by Python.")
        .def(py::init<const std::string&, int>(), py::arg("backend") = "cpu",
             py::arg("device") = -1)
        .def_property_readonly("handle", &Stream::handle)
        .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>())
        .def("copy", &Stream::copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
             "Enqueue memcpy(dst, src, nbytes) on this stream.")
        .def("wait_fence", &Stream::wait_fence, py::arg("fence"),
             "Hold the stream until `fence` is signalled (host function on the stream).");
}
