// The test-only copy fault switch: makes the next copies of any backend fail, on purpose.
//
// Design note
// -----------
// A copy can fail in two places, and the library must survive both: at submission (the
// backend's memcpy_async throws bagualu2::RuntimeError, as a CUDA/HIP call returning an error
// does) and at execution (the call returned, the copy never happened, and the failure shows
// when its completion is queried: event_query / event_synchronize of the next event recorded
// on that stream throw bagualu2::RuntimeError, as they return the error of a failed
// asynchronous operation on a device). memcpy cannot fail, so the cpu backend has no such path
// of its own; this switch injects one. It lives in _C (cpu_backend.cpp keeps its state), every
// backend honours it (cpu_backend.cpp, device_backend.cpp) and only tests set it:
//
//   * It is not reachable from bagualu2's Python API. _C exports two C functions with default
//     visibility (everything else in _C is hidden) and binds neither; the test module
//     tests/test_hooks.cpp finds them with dlsym on the _C already loaded into the process
//     (dlopen(bagualu2._C.__file__, RTLD_NOLOAD | RTLD_NOW) only finds it, never loads a
//     second copy) and wraps them as bagualu2_test_hooks.set_copy_faults / copy_faults_left.
//   * Disarmed (the only state outside tests) it costs each memcpy_async one atomic load.
//   * Armed, it is process wide: it lets the next `after` copies (memcpy_async calls with
//     bytes > 0, on any stream of any backend: the copy engine makes one per chunk) through
//     and fails the `count` after them, then disarms itself. Copies are counted in submission
//     order, under one mutex, so the copies a test means are the ones that fail.
//   * kExecute on the calling host thread (stream 0) fails at the call: there, execution is
//     the call.
#pragma once

#include <cstdint>

#define BAGUALU2_TEST_EXPORT __attribute__((visibility("default")))

namespace bagualu2::gpu {

enum class CopyFault : int {
    kNone = 0,     // copy normally
    kSubmit = 1,   // memcpy_async throws bagualu2::RuntimeError; nothing is enqueued
    kExecute = 2,  // memcpy_async returns; the copy is skipped and the next event recorded on
                   // its stream completes failed (its queries throw bagualu2::RuntimeError)
};

/// The fault the memcpy_async being submitted now must simulate, consuming it (kNone when the
/// switch is disarmed). Called by every backend's memcpy_async for a copy of > 0 bytes.
CopyFault claim_copy_fault();

}  // namespace bagualu2::gpu

extern "C" {
/// Arm the switch (replacing an earlier setting): let `after` copies through, then fail
/// `count` copies with `mode` (1: at submission, 2: at execution); mode 0 or count 0 disarms.
/// \return 0, or -1 (and nothing changes) for a mode other than 0, 1, 2 or a negative count.
BAGUALU2_TEST_EXPORT int bagualu2_test_set_copy_faults(int mode, long long count, long long after);
/// Faults armed and not injected yet.
BAGUALU2_TEST_EXPORT long long bagualu2_test_copy_faults_left();
}
