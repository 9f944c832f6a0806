// The table of runtime functions the shared GPU backend (device_backend.cpp) runs on.
//
// Design note
// -----------
// CUDA and HIP differ, for everything bagualu2 needs, in a handful of names and two semantics
// (the CUDA driver API binds work to a current context, HIP's runtime API to a current
// device). One DeviceRuntime implements gpu::Runtime once over this table; each vendor file
// (cuda_api.cpp, hip_api.cpp) only dlopens its library, resolves the symbols it names and
// adapts them to these signatures. Invariants:
//   * No entry binds anything by itself: only `bind` changes what is current on the calling
//     thread, and only to the device it is given; `restore` puts back exactly what `bind`
//     found (CUDA: the raw context, null included). Every other entry runs on whatever the
//     caller bound (gpu::DeviceGuard, with the object's own device).
//   * Every entry returns the vendor status (0 = success; `not_ready` from event_query means
//     "pending", not an error) and takes the handles Python passes around (torch's
//     cudaStream_t / hipStream_t are the driver's CUstream / hipStream_t).
//   * Loading happens once per process; a table is either complete (every symbol resolved,
//     init succeeded) or absent, with a reason that names the library looked for and how to
//     get it.
//   * The vendor files include no vendor header: prototypes are declared locally
//     (cuda_abi.h, hip_abi.h) and checked against the real headers by check_abi.cpp when a
//     toolkit is present (CI), so any machine builds every backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace bagualu2::gpu {

struct DeviceApi {
    // Identity: backend name, the library that was loaded, versions for backend_status().
    const char* name = "";
    std::string library;
    std::string versions;

    // Status values: success is 0 in both runtimes.
    int not_ready = 0;
    // Whether a status from event_query / event_synchronize says the work before the event
    // failed on the device (the context aborted it, so it ended): the statuses of a failed
    // asynchronous operation. Anything else (deinitialised, invalid context or handle) says
    // nothing about the work.
    bool (*work_failed)(int status) = nullptr;

    // Devices.
    int (*device_count)(int* count) = nullptr;
    // The calling thread's device, -1 when it has none (CUDA: no current context).
    int (*get_device)(int* device) = nullptr;
    // Make `device` current on the calling thread; *previous receives what was current (an
    // opaque token for restore, the raw context on CUDA: null when there was none).
    int (*bind)(int device, std::uintptr_t* previous) = nullptr;
    int (*restore)(std::uintptr_t previous) = nullptr;
    // Pinned host memory, portable across devices.
    int (*host_alloc)(void** ptr, std::size_t bytes) = nullptr;
    int (*host_free)(void* ptr) = nullptr;
    // Streams (created non-blocking: no implicit sync with the legacy default stream).
    int (*stream_create)(void** stream) = nullptr;
    int (*stream_destroy)(void* stream) = nullptr;
    int (*stream_synchronize)(void* stream) = nullptr;
    int (*stream_wait_event)(void* stream, void* event) = nullptr;
    // The device a (non-null) stream handle belongs to; -1 for a device whose context this
    // process never bound through `bind` (CUDA). nullptr where the runtime cannot tell (a HIP
    // runtime without hipStreamGetDevice).
    int (*stream_device)(void* stream, int* device) = nullptr;
    // Events.
    int (*event_create)(void** event, bool timing) = nullptr;
    int (*event_destroy)(void* event) = nullptr;
    int (*event_record)(void* event, void* stream) = nullptr;
    int (*event_query)(void* event) = nullptr;
    int (*event_synchronize)(void* event) = nullptr;
    int (*event_elapsed_ms)(float* ms, void* start, void* end) = nullptr;
    // Work: an async copy with the direction inferred from the pointers (unified addressing),
    // and a host callback that runs run_host_callback(arg) when the stream reaches it.
    int (*memcpy_async)(void* dst, const void* src, std::size_t bytes, void* stream) = nullptr;
    int (*launch_host_callback)(void* stream, void* arg) = nullptr;
    // "NAME (code): description" of a status.
    std::string (*describe)(int status) = nullptr;
};

/// What a host callback enqueued through launch_host_callback runs (device_backend.cpp).
void run_host_callback(void* arg);

// A dlopen'ed library and its symbols (device_backend.cpp). Libraries stay loaded for the
// life of the process: runtimes are process-wide singletons.
class Library {
public:
    /// Opens the first loadable name, preferring one already loaded into the process (torch's
    /// own copy) over loading another.
    /// \param[in] names  file names or paths, in order of preference.
    /// \param[out] why   on failure, what every name gave.
    /// \return whether a library was opened.
    bool open(const std::vector<std::string>& names, std::string* why);

    /// Resolves the first of `names` that the library exports into *fn.
    /// \return false, and `missing` extended by the first name, when none is exported.
    template <typename Fn>
    bool symbol(std::initializer_list<const char*> names, Fn* fn, std::string* missing) {
        static_assert(sizeof(Fn) == sizeof(void*), "function pointers must fit a void*");
        for (const char* name : names) {
            void* address = lookup(name);
            if (address != nullptr) {
                // dlsym's object pointer to a function pointer (POSIX guarantees this works).
                *fn = reinterpret_cast<Fn>(reinterpret_cast<std::size_t>(address));
                return true;
            }
        }
        *missing += (missing->empty() ? "" : ", ") + std::string(*names.begin());
        return false;
    }

    const std::string& path() const { return path_; }

private:
    void* lookup(const char* name) const;

    // The handle from dlopen and the name it was opened by.
    void* handle_ = nullptr;
    std::string path_;
};

/// Load the CUDA driver API / the HIP runtime into a table, once per process.
/// \param[out] why  on failure: which library was looked for, what went wrong, how to get it.
/// \return the table, or nullptr.
const DeviceApi* load_cuda_api(std::string* why);
const DeviceApi* load_hip_api(std::string* why);

}  // namespace bagualu2::gpu
