// The one error-checking header of bagualu2's C++ core.
//
// Every failed precondition or runtime call throws bagualu2::Error carrying the file and line
// of the check and a message that names the offending values. pybind11 translates Error into a
// Python exception (see csrc/bindings/module.cpp), so misuse never crashes the interpreter.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace bagualu2 {

// Raised for invalid arguments and misuse; surfaces in Python as ValueError.
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Raised when a GPU runtime call fails; surfaces in Python as RuntimeError.
class RuntimeError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// The one RuntimeError that says asynchronous work ended: a completion query (event_query,
// event_synchronize) reporting that the work before the event failed on the device. Every
// other runtime failure (a bind that failed, a deinitialised driver, an invalid context or
// handle) says nothing about whether that work still runs. Surfaces as RuntimeError.
class WorkFailed : public RuntimeError {
public:
    using RuntimeError::RuntimeError;
};

namespace detail {
template <typename... Args>
std::string format_message(const char* file, int line, const Args&... args) {
    std::ostringstream out;
    (out << ... << args);
    out << " [" << file << ":" << line << "]";
    return out.str();
}
}  // namespace detail

}  // namespace bagualu2

// BAGUALU2_CHECK(cond, "message parts", value, ...): throws bagualu2::Error when cond is false.
#define BAGUALU2_CHECK(cond, ...)                                                              \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            throw ::bagualu2::Error(                                                           \
                ::bagualu2::detail::format_message(__FILE__, __LINE__, __VA_ARGS__));          \
        }                                                                                      \
    } while (false)

// BAGUALU2_RUNTIME_CHECK(ok, "what failed", detail...): throws bagualu2::RuntimeError.
#define BAGUALU2_RUNTIME_CHECK(ok, ...)                                                        \
    do {                                                                                       \
        if (!(ok)) {                                                                           \
            throw ::bagualu2::RuntimeError(                                                    \
                ::bagualu2::detail::format_message(__FILE__, __LINE__, __VA_ARGS__));          \
        }                                                                                      \
    } while (false)

// BAGUALU2_WORK_CHECK(ok, "what failed", detail...): throws bagualu2::WorkFailed.
#define BAGUALU2_WORK_CHECK(ok, ...)                                                           \
    do {                                                                                       \
        if (!(ok)) {                                                                           \
            throw ::bagualu2::WorkFailed(                                                      \
                ::bagualu2::detail::format_message(__FILE__, __LINE__, __VA_ARGS__));          \
        }                                                                                      \
    } while (false)
