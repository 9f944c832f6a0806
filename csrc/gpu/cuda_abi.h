// The CUDA driver API as bagualu2 uses it, declared locally so no CUDA toolkit is needed to build.
//
// Each alias is the prototype of the driver entry point named in its comment, with opaque
// handles as void* and enums as int (same size and calling convention on every platform CUDA
// supports). check_abi.cpp static_asserts each one, and every constant, against <cuda.h>.
// Entry points exist since CUDA 10.0 (cuLaunchHostFunc is the newest), so any driver from
// 410 on loads; symbols with a _v2 are the ones <cuda.h> maps the plain name to.
#pragma once

#include <cstddef>

namespace bagualu2::gpu::cuda_abi {

using Result = int;  // CUresult
using Device = int;  // CUdevice
using Context = void*;  // CUcontext
using Stream = void*;   // CUstream
using Event = void*;    // CUevent
using DevicePtr = unsigned long long;  // CUdeviceptr
using HostFn = void (*)(void* user_data);  // CUhostFn

constexpr Result kSuccess = 0;              // CUDA_SUCCESS
constexpr Result kErrorNotReady = 600;      // CUDA_ERROR_NOT_READY
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
using StreamDestroyFn = Result (*)(Stream stream);                          // cuStreamDestroy_v2
using StreamSynchronizeFn = Result (*)(Stream stream);                      // cuStreamSynchronize
using StreamWaitEventFn = Result (*)(Stream stream, Event event, unsigned flags);  // cuStreamWaitEvent
using EventCreateFn = Result (*)(Event* event, unsigned flags);             // cuEventCreate
using EventDestroyFn = Result (*)(Event event);                             // cuEventDestroy_v2
using EventRecordFn = Result (*)(Event event, Stream stream);               // cuEventRecord
using EventQueryFn = Result (*)(Event event);                               // cuEventQuery
using EventSynchronizeFn = Result (*)(Event event);                         // cuEventSynchronize
using EventElapsedTimeFn = Result (*)(float* ms, Event start, Event end);   // cuEventElapsedTime
using MemcpyAsyncFn = Result (*)(DevicePtr dst, DevicePtr src, std::size_t bytes, Stream stream);  // cuMemcpyAsync
using LaunchHostFuncFn = Result (*)(Stream stream, HostFn fn, void* user_data);  // cuLaunchHostFunc
using GetErrorStringFn = Result (*)(Result error, const char** text);      // cuGetErrorString
using GetErrorNameFn = Result (*)(Result error, const char** text);        // cuGetErrorName

}  // namespace bagualu2::gpu::cuda_abi
