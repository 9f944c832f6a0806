// The HIP runtime API as bagualu2 uses it, declared locally so no ROCm/DTK is needed to build.
//
// Each alias is the prototype of the entry point named in its comment, with opaque handles as
// void* and enums as int. check_abi.cpp static_asserts each one, and every constant, against
// <hip/hip_runtime_api.h>. Every entry point exists in HIP 5.0 and later (Debian's 5.2 too).
// hipStreamAddCallback is used for host callbacks because hipLaunchHostFunc is declared but
// missing from older runtimes (Debian's libamdhip64 5.2). hipStreamGetDevice (ROCm 6) is
// optional: where the runtime has it, a stream handle's device is checked as on CUDA.
#pragma once

#include <cstddef>

namespace bagualu2::gpu::hip_abi {

using Error = int;    // hipError_t
using Stream = void*;  // hipStream_t
using Event = void*;   // hipEvent_t
using StreamCallback = void (*)(Stream stream, Error status, void* user_data);  // hipStreamCallback_t

constexpr Error kSuccess = 0;                // hipSuccess
constexpr Error kErrorNotReady = 600;        // hipErrorNotReady
// The statuses of a failed asynchronous operation: the device aborted the work.
constexpr Error kWorkFailures[] = {
    214,  // hipErrorECCNotCorrectable
    700,  // hipErrorIllegalAddress
    702,  // hipErrorLaunchTimeOut
    710,  // hipErrorAssert
    719,  // hipErrorLaunchFailure
};
constexpr int kMemcpyDefault = 4;            // hipMemcpyDefault
constexpr unsigned kStreamNonBlocking = 1;   // hipStreamNonBlocking
constexpr unsigned kEventDefault = 0;        // hipEventDefault
constexpr unsigned kEventDisableTiming = 2;  // hipEventDisableTiming
constexpr unsigned kHostMallocPortable = 1;  // hipHostMallocPortable

using InitFn = Error (*)(unsigned flags);                                   // hipInit
using DriverGetVersionFn = Error (*)(int* version);                        // hipDriverGetVersion
using RuntimeGetVersionFn = Error (*)(int* version);                       // hipRuntimeGetVersion
using GetDeviceCountFn = Error (*)(int* count);                            // hipGetDeviceCount
using GetDeviceFn = Error (*)(int* device);                                // hipGetDevice
using SetDeviceFn = Error (*)(int device);                                 // hipSetDevice
using HostMallocFn = Error (*)(void** ptr, std::size_t bytes, unsigned flags);  // hipHostMalloc
using HostFreeFn = Error (*)(void* ptr);                                   // hipHostFree
using StreamCreateWithFlagsFn = Error (*)(Stream* stream, unsigned flags); // hipStreamCreateWithFlags
using StreamDestroyFn = Error (*)(Stream stream);                          // hipStreamDestroy
using StreamSynchronizeFn = Error (*)(Stream stream);                      // hipStreamSynchronize
using StreamWaitEventFn = Error (*)(Stream stream, Event event, unsigned flags);  // hipStreamWaitEvent
using EventCreateWithFlagsFn = Error (*)(Event* event, unsigned flags);    // hipEventCreateWithFlags
using EventDestroyFn = Error (*)(Event event);                             // hipEventDestroy
using EventRecordFn = Error (*)(Event event, Stream stream);               // hipEventRecord
using EventQueryFn = Error (*)(Event event);                               // hipEventQuery
using EventSynchronizeFn = Error (*)(Event event);                         // hipEventSynchronize
using EventElapsedTimeFn = Error (*)(float* ms, Event start, Event stop);  // hipEventElapsedTime
using MemcpyAsyncFn = Error (*)(void* dst, const void* src, std::size_t bytes, int kind,
                                Stream stream);                            // hipMemcpyAsync
using StreamAddCallbackFn = Error (*)(Stream stream, StreamCallback callback, void* user_data,
                                      unsigned flags);                     // hipStreamAddCallback
using StreamGetDeviceFn = Error (*)(Stream stream, int* device);           // hipStreamGetDevice
using GetErrorNameFn = const char* (*)(Error error);                       // hipGetErrorName
using GetErrorStringFn = const char* (*)(Error error);                     // hipGetErrorString

}  // namespace bagualu2::gpu::hip_abi
