// The residency ledger and the kept-save record (bagualu2._saves; torch-linked, where the rest
// of the C++ core is torch-free).
//
// The ledger counts the device bytes the activation runtime holds, once per storage: a
// storage's bytes are in `resident` while at least one holder holds it. Two kinds of holder:
//
//   * a Kept record: what autograd holds in a kept saved tensor's place (the tensor, as its
//     tensor data when it is an op's output, and its version at the save). It is its own
//     count: made by `keep_record` (Ledger.keep), which checks the budget and counts in the
//     same call, and given back by its destructor or `drop()`. A step keeps one per saved
//     tensor, so this is the path written for its cost: a Python type of its own written
//     against the C API (no pybind11 instance, registered in pybind11's global map as it is
//     made and unregistered as it dies), allocated with its C++ fields in place.
//   * a pin: any other Python object (bagualu2.runtime.ledger.Pin) that holds a storage for its
//     life. Its death is noticed by a weak reference whose callback is a C method (list.append);
//     the count is given back at the ledger's next read.
//
// Invariants (tests/test_save_path.py, tests/test_interrupts.py):
//   L1 resident == the sum of the bytes of the storages with a positive count; peak is its
//      high-water mark since the last reset_peak().
//   L2 a count and the registration of its holder change inside one call, with no Python code
//      between them: an interrupt (a KeyboardInterrupt raised between bytecodes) sees both or
//      neither, and nothing of it is lost.
//   L3 a holder's count is given back exactly once: a Kept record at drop() or in its
//      destructor (C++: no bytecode, so no interrupt cuts it short), a pin when released or at
//      the first read after its death.
//   L4 a storage's address is its key; the entry holds a weak reference to the storage, so the
//      address is not reused by another storage while it is a key.
//   L5 a checked count (`target`) refuses a storage not yet held whose bytes would take
//      resident over the target, and then counts nothing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <unordered_map>
#include <utility>

#include "common/check.h"

namespace bagualu2::saves {

namespace py = pybind11;

extern PyObject* g_error;  // bagualu2._saves.Error, what Error raises in Python (set at import)

// Runs the body of a C API entry point: bagualu2::Error becomes bagualu2._saves.Error, and any
// other exception what torch's bindings make of it (a Python error thrown through torch's C++
// code, python_error, is restored as it was: a KeyboardInterrupt raised in a dispatch mode
// reached from here stays a KeyboardInterrupt); `failed` is returned.
template <typename R, typename F>
R guarded(R failed, F&& body) {
    try {
        return body();
    } catch (const Error& e) {
        PyErr_SetString(g_error, e.what());
    } catch (...) {
        torch::translate_exception_to_python(std::current_exception());
    }
    return failed;
}

// A static type's header as PyVarObject_HEAD_INIT makes it (one reference: its own), with its
// name, doc, size and flags; the rest is set by its maker before add_type.
void init_type(PyTypeObject& type, const char* name, const char* doc, Py_ssize_t size, unsigned long flags);
void add_type(py::module_& m, const char* name, PyTypeObject& type);

struct Kept;

struct Entry {
    int64_t count;
    int64_t nbytes;
    c10::weak_intrusive_ptr<c10::StorageImpl> weak;  // L4
};

// What the ledger and its Kept records share: a record may outlive the Python ledger object.
struct LedgerState {
    std::unordered_map<const c10::StorageImpl*, Entry> held;
    int64_t resident = 0;
    int64_t peak = 0;
    py::dict pins;  // a live pin's weak reference -> its storage's address (int)
    py::list dead;  // weak references of pins that died, not yet collected
    py::object on_death = dead.attr("append");
    Kept* first = nullptr;  // the counted Kept records, in the order they were kept
    Kept* last = nullptr;
    int64_t kept = 0;

    // Counts one more holder of `storage`; whether it was held already, or nullopt (and nothing
    // counted) where a storage not held yet would take resident over `target` (L5).
    std::optional<bool> add(const c10::Storage& storage, std::optional<int64_t> target);
    void sub(const c10::StorageImpl* key);
    // Gives back the counts of the pins that died (L3), last queued first; a pin released and
    // then dead is queued twice and counted back once.
    void collect();
    void link(Kept* k);
    void unlink(Kept* k);
};

extern PyTypeObject KeptType;

// `t`'s tensor data. torch copies a tensor's metadata through the innermost dispatch mode's
// Python `detach` while one is on the stack; for a tensor with no Python behaviour of its own
// (no Python dispatch key: not a subclass) that is a Python call per kept save of a traced
// forward that records nothing, and it runs Python code (an interrupt may land there), so it
// is taken with the Python key excluded, as the runtime's own ops on plain tensors are. A
// subclass keeps its own detach.
inline at::Tensor tensor_data(const at::Tensor& t) {
    if (t.key_set().has(c10::DispatchKey::Python)) {
        return t.tensor_data();
    }
    c10::impl::ExcludeDispatchKeyGuard no_python(c10::DispatchKey::Python);
    return t.tensor_data();
}

// The kept-save record, a Python object of type Kept with its C++ fields in place. Made by
// make_kept, freed by its type's dealloc.
struct Kept {
    PyObject_HEAD
    at::Tensor tensor;  // undefined once moved
    int64_t version = 0;
    py::object node = py::none();  // the traced storage it holds (bagualu2.runtime.tracing)
    int64_t state = 0;             // that storage's state at the save
    py::object moved = py::none();  // where it went when offloaded later to make room
    int64_t frame = -1;             // the index of the frame that saved it
    bool shared = false;            // its storage was held already when it was kept
    int64_t nbytes = 0;             // its storage's bytes
    std::shared_ptr<LedgerState> ledger;  // null: charged to nothing
    const c10::StorageImpl* key = nullptr;
    Kept* prev = nullptr;
    Kept* next = nullptr;

    // An op's saved output is held as its tensor data (the same storage and version counter, no
    // autograd metadata): holding it with its grad_fn would be a reference cycle through the
    // node that holds this record, and a detach() costs a dispatch where this is one copy of
    // the tensor's metadata.
    explicit Kept(const at::Tensor& t) : tensor(t.grad_fn() ? tensor_data(t) : t), version(t._version()) {}
    Kept(const Kept&) = delete;
    Kept& operator=(const Kept&) = delete;
    ~Kept() { drop(); }

    PyObject* self() { return reinterpret_cast<PyObject*>(this); }

    // Gives the count back now (L3); nothing when it holds none.
    void drop() {
        if (key != nullptr) {
            const c10::StorageImpl* k = key;
            key = nullptr;
            ledger->unlink(this);
            ledger->sub(k);
        }
    }
};

inline Kept& as_kept(PyObject* self) { return *reinterpret_cast<Kept*>(self); }

// A new reference to `obj`, for a C API entry point to return.
inline PyObject* new_ref(const py::object& obj) { return py::object(obj).release().ptr(); }

// A record as Python holds it (a new reference) and as C++ reads it; `kept` null (and `obj`
// None): none made.
struct Record {
    py::object obj = py::none();
    Kept* kept = nullptr;
};

// A new record of `t`, charged to nothing (a parameter, a view of one).
Record make_kept(const at::Tensor& t);

// A record of `t` counted (L2): none made, and nothing counted, where its storage is not held
// yet and its bytes would take resident over `target` (L5).
Record keep_record(const std::shared_ptr<LedgerState>& s, const at::Tensor& t, py::handle node, int64_t state,
                   int64_t frame, std::optional<int64_t> target);

// The calm pack hook's common case, in one call: a plain tensor (torch.Tensor or a Parameter,
// dense and strided, no dispatch mode on the stack) is held uncounted when it is a parameter
// (its storage in `param_storages`, a set of the addresses of the model's parameter storages,
// or a Parameter itself) and kept, counted against `target`, otherwise. None where the caller's
// full way must decide: anything else, a view of a tensor subclass, a save that would cross the
// target, a storage among the keys of `traced` (a dict keyed by storage address, or null: the
// storages the running frame traced, whose plan decides their saves wherever they are made).
Record keep_plain_record(const std::shared_ptr<LedgerState>& s, PyObject* obj, PyObject* param_storages,
                         int64_t frame, std::optional<int64_t> target, PyObject* traced = nullptr);

// The ledger as Python holds it (a pybind11 class: called on the full way only).
class Ledger {
public:
    Ledger() : s_(std::make_shared<LedgerState>()) {}

    const std::shared_ptr<LedgerState>& state() const { return s_; }
    int64_t resident();
    int64_t peak() const { return s_->peak; }
    void set_peak(int64_t peak) { s_->peak = peak; }
    void reset_peak() { s_->peak = resident(); }
    int64_t pins();
    std::optional<bool> acquire(py::handle storage, py::handle pin, std::optional<int64_t> target);
    void release(py::handle ref);
    void collect() { s_->collect(); }
    bool holds(py::handle storage);
    std::optional<std::pair<int64_t, int64_t>> count(uintptr_t cdata);
    py::list live(py::handle kind);
    py::object keep(py::handle tensor, py::handle node, int64_t state, int64_t frame, std::optional<int64_t> target);
    py::object keep_plain(py::handle tensor, py::handle param_storages, int64_t frame, std::optional<int64_t> target);

private:
    std::shared_ptr<LedgerState> s_;
};

// Makes Kept a type of `m`.
void add_kept(py::module_& m);

}  // namespace bagualu2::saves
