// The CUDA driver API as bagualu2 uses it, declared locally so no CUDA toolkit is needed to build.
//
// Each alias is the prototype of the driver entry point named in its comment, with opaque
// handles as void* and enums as int (same size and calling convention on every platform CUDA
// supports). BAGUALU2_CUDA_ENTRY_POINTS is the one list of what the backend loads: the name as
// code calling <cuda.h> writes it, the local prototype, the table field, and the exported
// symbols looked up (preferred first). <cuda.h> maps some names to versioned symbols
// (`#define cuStreamDestroy cuStreamDestroy_v2`); two versions often share one prototype, so a
// prototype check alone cannot catch a wrong symbol. check_abi.cpp therefore checks, per entry,
// both the prototype and that the symbol <cuda.h> maps the name to is among the names looked up
// (the older names after it serve drivers that predate the mapping).
// The newest entry point is cuLaunchHostFunc (CUDA 10.0), so any driver from kMinimumDriver on
// loads.
#pragma once

#include <cstddef>

namespace bagualu2::gpu::cuda_abi {

/// The oldest driver that exports every entry point below (load errors quote it).
constexpr const char* kMinimumDriver = "R410 (CUDA 10.0)";

using Result = int;  // CUresult
using Device = int;  // CUdevice
using Context = void*;  // CUcontext
using Stream = void*;   // CUstream
using Event = void*;    // CUevent
using DevicePtr = unsigned long long;  // CUdeviceptr
using HostFn = void (*)(void* user_data);  // CUhostFn

constexpr Result kSuccess = 0;              // CUDA_SUCCESS
constexpr Result kErrorInvalidHandle = 400; // CUDA_ERROR_INVALID_HANDLE
constexpr Result kErrorNotReady = 600;      // CUDA_ERROR_NOT_READY
// The statuses of a failed asynchronous operation: the context aborted the work (sticky).
constexpr Result kWorkFailures[] = {
    214,  // CUDA_ERROR_ECC_UNCORRECTABLE
    700,  // CUDA_ERROR_ILLEGAL_ADDRESS
    702,  // CUDA_ERROR_LAUNCH_TIMEOUT
    710,  // CUDA_ERROR_ASSERT
    714,  // CUDA_ERROR_HARDWARE_STACK_ERROR
    715,  // CUDA_ERROR_ILLEGAL_INSTRUCTION
    716,  // CUDA_ERROR_MISALIGNED_ADDRESS
    717,  // CUDA_ERROR_INVALID_ADDRESS_SPACE
    718,  // CUDA_ERROR_INVALID_PC
    719,  // CUDA_ERROR_LAUNCH_FAILED
};
constexpr unsigned kStreamNonBlocking = 1;  // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDefault = 0;       // CU_EVENT_DEFAULT
constexpr unsigned kEventDisableTiming = 2; // CU_EVENT_DISABLE_TIMING
constexpr unsigned kMemHostAllocPortable = 1;  // CU_MEMHOSTALLOC_PORTABLE

using InitFn = Result (*)(unsigned flags);                                   // cuInit
using DriverGetVersionFn = Result (*)(int* version);                        // cuDriverGetVersion
using DeviceGetCountFn = Result (*)(int* count);                            // cuDeviceGetCount
using DeviceGetFn = Result (*)(Device* device, int ordinal);                // cuDeviceGet
using PrimaryCtxRetainFn = Result (*)(Context* ctx, Device device);         // cuDevicePrimaryCtxRetain
using CtxGetCurrentFn = Result (*)(Context* ctx);                           // cuCtxGetCurrent
using CtxSetCurrentFn = Result (*)(Context ctx);                            // cuCtxSetCurrent
using CtxGetDeviceFn = Result (*)(Device* device);                          // cuCtxGetDevice
using MemHostAllocFn = Result (*)(void** ptr, std::size_t bytes, unsigned flags);  // cuMemHostAlloc
using MemFreeHostFn = Result (*)(void* ptr);                                // cuMemFreeHost
using StreamCreateFn = Result (*)(Stream* stream, unsigned flags);          // cuStreamCreate
using StreamDestroyFn = Result (*)(Stream stream);                          // cuStreamDestroy
using StreamSynchronizeFn = Result (*)(Stream stream);                      // cuStreamSynchronize
using StreamWaitEventFn = Result (*)(Stream stream, Event event, unsigned flags);  // cuStreamWaitEvent
using StreamGetCtxFn = Result (*)(Stream stream, Context* ctx);             // cuStreamGetCtx
using EventCreateFn = Result (*)(Event* event, unsigned flags);             // cuEventCreate
using EventDestroyFn = Result (*)(Event event);                             // cuEventDestroy
using EventRecordFn = Result (*)(Event event, Stream stream);               // cuEventRecord
using EventQueryFn = Result (*)(Event event);                               // cuEventQuery
using EventSynchronizeFn = Result (*)(Event event);                         // cuEventSynchronize
using EventElapsedTimeFn = Result (*)(float* ms, Event start, Event end);   // cuEventElapsedTime
using MemcpyAsyncFn = Result (*)(DevicePtr dst, DevicePtr src, std::size_t bytes, Stream stream);  // cuMemcpyAsync
using LaunchHostFuncFn = Result (*)(Stream stream, HostFn fn, void* user_data);  // cuLaunchHostFunc
using GetErrorStringFn = Result (*)(Result error, const char** text);      // cuGetErrorString
using GetErrorNameFn = Result (*)(Result error, const char** text);        // cuGetErrorName

// X(name as <cuda.h> code writes it, prototype, table field, symbols looked up...).
// cuEventElapsedTime: CUDA 13's <cuda.h> maps it to _v2 (same prototype); drivers before the
// _v2 export only the plain name.
#define BAGUALU2_CUDA_ENTRY_POINTS(X)                                                       \
    X(cuInit, InitFn, init, "cuInit")                                                       \
    X(cuDriverGetVersion, DriverGetVersionFn, driver_get_version, "cuDriverGetVersion")     \
    X(cuDeviceGetCount, DeviceGetCountFn, device_get_count, "cuDeviceGetCount")             \
    X(cuDeviceGet, DeviceGetFn, device_get, "cuDeviceGet")                                  \
    X(cuDevicePrimaryCtxRetain, PrimaryCtxRetainFn, primary_ctx_retain,                     \
      "cuDevicePrimaryCtxRetain")                                                           \
    X(cuCtxGetCurrent, CtxGetCurrentFn, ctx_get_current, "cuCtxGetCurrent")                 \
    X(cuCtxSetCurrent, CtxSetCurrentFn, ctx_set_current, "cuCtxSetCurrent")                 \
    X(cuCtxGetDevice, CtxGetDeviceFn, ctx_get_device, "cuCtxGetDevice")                     \
    X(cuMemHostAlloc, MemHostAllocFn, mem_host_alloc, "cuMemHostAlloc")                     \
    X(cuMemFreeHost, MemFreeHostFn, mem_free_host, "cuMemFreeHost")                         \
    X(cuStreamCreate, StreamCreateFn, stream_create, "cuStreamCreate")                      \
    X(cuStreamDestroy, StreamDestroyFn, stream_destroy, "cuStreamDestroy_v2")               \
    X(cuStreamSynchronize, StreamSynchronizeFn, stream_synchronize, "cuStreamSynchronize")  \
    X(cuStreamWaitEvent, StreamWaitEventFn, stream_wait_event, "cuStreamWaitEvent")         \
    X(cuStreamGetCtx, StreamGetCtxFn, stream_get_ctx, "cuStreamGetCtx")                     \
    X(cuEventCreate, EventCreateFn, event_create, "cuEventCreate")                          \
    X(cuEventDestroy, EventDestroyFn, event_destroy, "cuEventDestroy_v2")                   \
    X(cuEventRecord, EventRecordFn, event_record, "cuEventRecord")                          \
    X(cuEventQuery, EventQueryFn, event_query, "cuEventQuery")                              \
    X(cuEventSynchronize, EventSynchronizeFn, event_synchronize, "cuEventSynchronize")      \
    X(cuEventElapsedTime, EventElapsedTimeFn, event_elapsed_time, "cuEventElapsedTime_v2",  \
      "cuEventElapsedTime")                                                                 \
    X(cuMemcpyAsync, MemcpyAsyncFn, memcpy_async, "cuMemcpyAsync")                          \
    X(cuLaunchHostFunc, LaunchHostFuncFn, launch_host_func, "cuLaunchHostFunc")             \
    X(cuGetErrorString, GetErrorStringFn, get_error_string, "cuGetErrorString")             \
    X(cuGetErrorName, GetErrorNameFn, get_error_name, "cuGetErrorName")

}  // namespace bagualu2::gpu::cuda_abi
