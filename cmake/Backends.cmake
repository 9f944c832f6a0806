# Backend selection: BAGUALU2_BACKEND=auto|cpu|cuda|hip.
#
# Every backend is plain host C++ behind the neutral gpu:: API (csrc/gpu/gpu.h). The GPU
# backends share one implementation (device_backend.cpp) and load their runtime library with
# dlopen at first use (cuda: libcuda.so.1 of the NVIDIA driver; hip: libamdhip64.so), with
# locally declared prototypes: building them needs no toolkit and links no GPU library, so
# `auto` always builds cpu + cuda + hip and one wheel runs on CPU-only, NVIDIA and AMD/DCU
# machines. `cpu` builds the cpu backend only; `cuda` / `hip` add just that one.
#
# BAGUALU2_CHECK_ABI=ON additionally compiles csrc/gpu/check_abi.cpp against the vendor headers
# it finds (CUDA toolkit, hip/hip_runtime_api.h), checking the local prototypes against them;
# a requested header that is missing is an error.
find_package(Threads REQUIRED)

set(BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/runtime.cpp"
                             "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/cpu_backend.cpp")
set(BAGUALU2_BACKEND_DEFINITIONS "")
set(BAGUALU2_BACKEND_LIBRARIES ${CMAKE_DL_LIBS})
set(BAGUALU2_BACKENDS_BUILT cpu)

if(NOT BAGUALU2_BACKEND MATCHES "^(auto|cpu|cuda|hip)$")
  message(FATAL_ERROR "BAGUALU2_BACKEND='${BAGUALU2_BACKEND}' is not one of auto, cpu, cuda, hip")
endif()

# device_backend.cpp is compiled whenever a GPU backend is (it also answers backend_status()
# for the ones that are not), so cpu-only builds carry it too.
list(APPEND BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/device_backend.cpp")
if(BAGUALU2_BACKEND STREQUAL "cuda" OR BAGUALU2_BACKEND STREQUAL "auto")
  list(APPEND BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/cuda_api.cpp")
  list(APPEND BAGUALU2_BACKEND_DEFINITIONS BAGUALU2_WITH_CUDA=1)
  list(APPEND BAGUALU2_BACKENDS_BUILT cuda)
endif()
if(BAGUALU2_BACKEND STREQUAL "hip" OR BAGUALU2_BACKEND STREQUAL "auto")
  list(APPEND BAGUALU2_BACKEND_SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/hip_api.cpp")
  list(APPEND BAGUALU2_BACKEND_DEFINITIONS BAGUALU2_WITH_HIP=1)
  list(APPEND BAGUALU2_BACKENDS_BUILT hip)
endif()

message(STATUS "bagualu2 backends: ${BAGUALU2_BACKENDS_BUILT} (GPU runtimes loaded at first use)")

# bagualu2_check_abi(): the prototype check, an object library nothing links.
function(bagualu2_check_abi)
  if(NOT BAGUALU2_CHECK_ABI)
    return()
  endif()
  set(defs "")
  set(dirs "")
  if("cuda" IN_LIST BAGUALU2_BACKENDS_BUILT)
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND)
      message(FATAL_ERROR "BAGUALU2_CHECK_ABI=ON but no CUDA toolkit was found (set CUDAToolkit_ROOT)")
    endif()
    list(APPEND defs BAGUALU2_CHECK_CUDA_ABI=1)
    list(APPEND dirs ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  if("hip" IN_LIST BAGUALU2_BACKENDS_BUILT)
    find_path(HIP_RUNTIME_INCLUDE_DIR hip/hip_runtime_api.h
              HINTS "$ENV{ROCM_PATH}" /opt/rocm /usr PATH_SUFFIXES include)
    if(NOT HIP_RUNTIME_INCLUDE_DIR)
      message(FATAL_ERROR "BAGUALU2_CHECK_ABI=ON but hip/hip_runtime_api.h was not found "
                          "(install libamdhip64-dev or set ROCM_PATH)")
    endif()
    list(APPEND defs BAGUALU2_CHECK_HIP_ABI=1 __HIP_PLATFORM_AMD__=1)
    list(APPEND dirs ${HIP_RUNTIME_INCLUDE_DIR})
  endif()
  add_library(bagualu2_check_abi OBJECT "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/check_abi.cpp")
  target_include_directories(bagualu2_check_abi PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/csrc")
  target_include_directories(bagualu2_check_abi SYSTEM PRIVATE ${dirs})
  target_compile_definitions(bagualu2_check_abi PRIVATE ${defs})
  bagualu2_strict_warnings(bagualu2_check_abi)
  message(STATUS "bagualu2: checking local runtime prototypes against ${dirs}")
endfunction()
