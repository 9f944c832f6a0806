# Backend selection: BAGUALU2_BACKEND=auto|cpu|cuda|hip.
# cpu is always built; auto adds CUDA and/or HIP when their runtimes are found.
# Every backend is plain host C++ behind the neutral gpu:: API (csrc/gpu/gpu.h).
find_package(Threads REQUIRED)

set(BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/runtime.cpp"
                             "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/cpu_backend.cpp")
set(BAGUALU2_BACKEND_DEFINITIONS "")
set(BAGUALU2_BACKEND_LIBRARIES "")
set(BAGUALU2_BACKENDS_BUILT cpu)

if(NOT BAGUALU2_BACKEND MATCHES "^(auto|cpu|cuda|hip)$")
  message(FATAL_ERROR "BAGUALU2_BACKEND='${BAGUALU2_BACKEND}' is not one of auto, cpu, cuda, hip")
endif()

set(_want_cuda OFF)
set(_want_hip OFF)
if(BAGUALU2_BACKEND STREQUAL "cuda" OR BAGUALU2_BACKEND STREQUAL "auto")
  set(_want_cuda ON)
endif()
if(BAGUALU2_BACKEND STREQUAL "hip" OR BAGUALU2_BACKEND STREQUAL "auto")
  set(_want_hip ON)
endif()

if(_want_cuda)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    list(APPEND BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/cuda_backend.cpp")
    list(APPEND BAGUALU2_BACKEND_DEFINITIONS BAGUALU2_WITH_CUDA=1)
    list(APPEND BAGUALU2_BACKEND_LIBRARIES CUDA::cudart)
    list(APPEND BAGUALU2_BACKENDS_BUILT cuda)
  elseif(BAGUALU2_BACKEND STREQUAL "cuda")
    message(FATAL_ERROR "BAGUALU2_BACKEND=cuda but no CUDA toolkit was found; set CUDAToolkit_ROOT")
  endif()
endif()

if(_want_hip)
  set(_hip_hints "$ENV{ROCM_PATH}" /opt/rocm /usr)
  find_path(HIP_RUNTIME_INCLUDE_DIR hip/hip_runtime_api.h HINTS ${_hip_hints} PATH_SUFFIXES include)
  find_library(HIP_RUNTIME_LIBRARY amdhip64 HINTS ${_hip_hints} PATH_SUFFIXES lib lib64)
  if(HIP_RUNTIME_INCLUDE_DIR AND HIP_RUNTIME_LIBRARY)
    list(APPEND BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/hip_backend.cpp")
    list(APPEND BAGUALU2_BACKEND_DEFINITIONS BAGUALU2_WITH_HIP=1 __HIP_PLATFORM_AMD__=1)
    list(APPEND BAGUALU2_BACKEND_LIBRARIES "${HIP_RUNTIME_LIBRARY}")
    include_directories(SYSTEM "${HIP_RUNTIME_INCLUDE_DIR}")
    list(APPEND BAGUALU2_BACKENDS_BUILT hip)
  elseif(BAGUALU2_BACKEND STREQUAL "hip")
    message(FATAL_ERROR "BAGUALU2_BACKEND=hip but hip/hip_runtime_api.h or libamdhip64 was not found; "
                        "install libamdhip64-dev or set ROCM_PATH")
  endif()
endif()

message(STATUS "bagualu2 backends: ${BAGUALU2_BACKENDS_BUILT}")
