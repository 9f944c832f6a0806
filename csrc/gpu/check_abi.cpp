// Compile-time check that the locally declared runtime prototypes (cuda_abi.h, hip_abi.h) match
// the vendor headers. Built only where a toolkit is present (BAGUALU2_CHECK_ABI, on in CI); the
// object is never linked: compiling it is the test.
//
// CUDA entries come from the one table the loader uses (cuda_abi.h), and each is checked twice:
// its prototype, and that the symbol <cuda.h> maps its name to is the first one the loader
// looks up (cuStreamDestroy and cuStreamDestroy_v2 share a prototype, so only the name tells
// them apart, and a real libcuda exports both: the loader takes the first it finds, so the
// mapped name anywhere else in the list would load the other one).
// HIP entries get their prototypes checked; hipStreamGetDevice, optional at run time, where
// the headers declare it (ROCm 6).
//
// Two prototypes match when they agree after erasing what the C ABI does not see: opaque
// handle pointers (CUstream, hipEvent_t, ...) become void*, pointers to them void**, enums
// their signed underlying integer. Arithmetic types and pointers to them must match exactly.
#include <initializer_list>
#include <iterator>
#include <type_traits>

#if defined(BAGUALU2_CHECK_CUDA_ABI)
#include <cuda.h>

#include "gpu/cuda_abi.h"
#endif
#if defined(BAGUALU2_CHECK_HIP_ABI)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <hip/hip_runtime_api.h>

#include "gpu/hip_abi.h"
#endif

namespace {

template <typename T, typename = void>
struct Erase {
    using type = T;
};
template <typename T>
using erase_t = typename Erase<T>::type;

template <typename T>
struct Erase<T, std::enable_if_t<std::is_enum_v<T>>> {
    using type = std::make_signed_t<std::underlying_type_t<T>>;
};
template <typename T>
struct Erase<T*, std::enable_if_t<std::is_arithmetic_v<std::remove_cv_t<T>>>> {
    using type = T*;
};
template <typename T>
struct Erase<T*, std::enable_if_t<std::is_pointer_v<T>>> {
    using type = void**;
};
template <typename T>
struct Erase<T*, std::enable_if_t<!std::is_arithmetic_v<std::remove_cv_t<T>> &&
                                  !std::is_pointer_v<T> && !std::is_function_v<T>>> {
    using type = void*;
};
template <typename R, typename... A>
struct Erase<R (*)(A...), void> {
    using type = erase_t<R> (*)(erase_t<A>...);
};

template <typename Vendor, typename Ours>
constexpr bool same_abi = std::is_same_v<erase_t<Vendor>, erase_t<Ours>>;

}  // namespace

#define BAGUALU2_SAME_ABI(vendor, ours) \
    static_assert(same_abi<decltype(&vendor), ours>, #vendor " differs from " #ours)
// For a C entry point the C++ header also overloads (hipHostMalloc has a template for T**):
// the cast picks the C one by its vendor-typed signature, which must exist.
#define BAGUALU2_SAME_ABI_C(vendor, vendor_type, ours)                                        \
    static_assert(same_abi<decltype(static_cast<vendor_type>(&vendor)), ours>,               \
                  #vendor " differs from " #ours)

#if defined(BAGUALU2_CHECK_CUDA_ABI)
namespace cu = bagualu2::gpu::cuda_abi;
static_assert(CUDA_SUCCESS == cu::kSuccess && CUDA_ERROR_NOT_READY == cu::kErrorNotReady);
static_assert(CUDA_ERROR_INVALID_HANDLE == cu::kErrorInvalidHandle);
static_assert(CU_STREAM_NON_BLOCKING == cu::kStreamNonBlocking);
static_assert(CU_EVENT_DEFAULT == cu::kEventDefault && CU_EVENT_DISABLE_TIMING == cu::kEventDisableTiming);
static_assert(CU_MEMHOSTALLOC_PORTABLE == cu::kMemHostAllocPortable);
static_assert(std::is_same_v<CUdeviceptr, cu::DevicePtr> && std::is_same_v<CUdevice, cu::Device>);
static_assert(sizeof(CUresult) == sizeof(cu::Result));

namespace {
constexpr bool same_name(const char* a, const char* b) {
    while (*a != '\0' && *a == *b) {
        ++a;
        ++b;
    }
    return *a == *b;
}
// Whether `mapped` (the symbol <cuda.h> makes of a name) is the first name looked up.
constexpr bool looked_up_first(const char* mapped, std::initializer_list<const char*> names) {
    return names.size() > 0 && same_name(mapped, *names.begin());
}
constexpr bool is_work_failure(int status) {
    for (const int failure : cu::kWorkFailures) {
        if (status == failure) {
            return true;
        }
    }
    return false;
}
}  // namespace
static_assert(is_work_failure(CUDA_ERROR_ECC_UNCORRECTABLE) && is_work_failure(CUDA_ERROR_ILLEGAL_ADDRESS) &&
              is_work_failure(CUDA_ERROR_LAUNCH_TIMEOUT) && is_work_failure(CUDA_ERROR_ASSERT) &&
              is_work_failure(CUDA_ERROR_HARDWARE_STACK_ERROR) &&
              is_work_failure(CUDA_ERROR_ILLEGAL_INSTRUCTION) &&
              is_work_failure(CUDA_ERROR_MISALIGNED_ADDRESS) &&
              is_work_failure(CUDA_ERROR_INVALID_ADDRESS_SPACE) &&
              is_work_failure(CUDA_ERROR_INVALID_PC) && is_work_failure(CUDA_ERROR_LAUNCH_FAILED));
static_assert(std::size(cu::kWorkFailures) == 10 && !is_work_failure(CUDA_ERROR_DEINITIALIZED));

// `api` arrives macro-expanded: the symbol <cuda.h> maps the name to (cuStreamDestroy ->
// cuStreamDestroy_v2); its prototype and its name are both checked.
#define BAGUALU2_STRINGIFY(x) #x
#define BAGUALU2_EXPANDED_NAME(x) BAGUALU2_STRINGIFY(x)
#define BAGUALU2_CHECK_CUDA_ENTRY(api, Fn, field, ...)                                         \
    BAGUALU2_SAME_ABI(::api, cu::Fn);                                                          \
    static_assert(looked_up_first(BAGUALU2_EXPANDED_NAME(api), {__VA_ARGS__}),                 \
                  "cuda.h maps an entry point to " BAGUALU2_EXPANDED_NAME(api)                 \
                  ", which is not the first symbol cuda_api.cpp looks up (cuda_abi.h: " #field \
                  ")");
BAGUALU2_CUDA_ENTRY_POINTS(BAGUALU2_CHECK_CUDA_ENTRY)
#endif

#if defined(BAGUALU2_CHECK_HIP_ABI)
namespace hp = bagualu2::gpu::hip_abi;
static_assert(hipSuccess == hp::kSuccess && hipErrorNotReady == hp::kErrorNotReady);
static_assert(hipMemcpyDefault == hp::kMemcpyDefault);
static_assert(hipStreamNonBlocking == hp::kStreamNonBlocking);
static_assert(hipEventDefault == hp::kEventDefault && hipEventDisableTiming == hp::kEventDisableTiming);
static_assert(hipHostMallocPortable == hp::kHostMallocPortable);
static_assert(sizeof(hipError_t) == sizeof(hp::Error));
BAGUALU2_SAME_ABI(::hipInit, hp::InitFn);
BAGUALU2_SAME_ABI(::hipDriverGetVersion, hp::DriverGetVersionFn);
BAGUALU2_SAME_ABI(::hipRuntimeGetVersion, hp::RuntimeGetVersionFn);
BAGUALU2_SAME_ABI(::hipGetDeviceCount, hp::GetDeviceCountFn);
BAGUALU2_SAME_ABI(::hipGetDevice, hp::GetDeviceFn);
BAGUALU2_SAME_ABI(::hipSetDevice, hp::SetDeviceFn);
BAGUALU2_SAME_ABI_C(::hipHostMalloc, hipError_t (*)(void**, size_t, unsigned int), hp::HostMallocFn);
BAGUALU2_SAME_ABI(::hipHostFree, hp::HostFreeFn);
BAGUALU2_SAME_ABI(::hipStreamCreateWithFlags, hp::StreamCreateWithFlagsFn);
BAGUALU2_SAME_ABI(::hipStreamDestroy, hp::StreamDestroyFn);
BAGUALU2_SAME_ABI(::hipStreamSynchronize, hp::StreamSynchronizeFn);
BAGUALU2_SAME_ABI(::hipStreamWaitEvent, hp::StreamWaitEventFn);
BAGUALU2_SAME_ABI(::hipEventCreateWithFlags, hp::EventCreateWithFlagsFn);
BAGUALU2_SAME_ABI(::hipEventDestroy, hp::EventDestroyFn);
BAGUALU2_SAME_ABI(::hipEventRecord, hp::EventRecordFn);
BAGUALU2_SAME_ABI(::hipEventQuery, hp::EventQueryFn);
BAGUALU2_SAME_ABI(::hipEventSynchronize, hp::EventSynchronizeFn);
BAGUALU2_SAME_ABI(::hipEventElapsedTime, hp::EventElapsedTimeFn);
BAGUALU2_SAME_ABI(::hipMemcpyAsync, hp::MemcpyAsyncFn);
BAGUALU2_SAME_ABI(::hipStreamAddCallback, hp::StreamAddCallbackFn);
static_assert(std::size(hp::kWorkFailures) == 5);
static_assert(hp::kWorkFailures[0] == hipErrorECCNotCorrectable &&
              hp::kWorkFailures[1] == hipErrorIllegalAddress &&
              hp::kWorkFailures[2] == hipErrorLaunchTimeOut && hp::kWorkFailures[3] == hipErrorAssert &&
              hp::kWorkFailures[4] == hipErrorLaunchFailure);
#if HIP_VERSION_MAJOR >= 6
BAGUALU2_SAME_ABI(::hipStreamGetDevice, hp::StreamGetDeviceFn);
#endif
BAGUALU2_SAME_ABI(::hipGetErrorName, hp::GetErrorNameFn);
BAGUALU2_SAME_ABI(::hipGetErrorString, hp::GetErrorStringFn);
#pragma GCC diagnostic pop
#endif
