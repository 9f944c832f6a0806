// bagualu2._saves: the residency ledger and the kept-save record, the part of the save path
// that runs once per saved tensor (torch-linked; the rest of the C++ core is torch-free).
//
// The ledger counts the device bytes the activation runtime holds, once per storage: a
// storage's bytes are in `resident` while at least one holder holds it. Two kinds of holder:
//
//   * a Kept record: what autograd holds in a kept saved tensor's place (the tensor, as its
//     tensor data when it is an op's output, and its version at the save). It is its own
//     count: made by `Ledger.keep`, which checks the budget and counts in the same call, and
//     given back by its destructor or `drop()`. A step keeps one per saved tensor, so this is
//     the path written for its cost: no Python bytecode runs between autograd's call of the
//     pack hook and the record it gets back, other than the hook's own few checks.
//   * a pin: any other Python object (bagualu2.runtime.ledger.Pin) that holds a storage for its
//     life. Its death is noticed by a weak reference whose callback is a C method (list.append);
//     the count is given back at the ledger's next read.
//
// The three objects made or called once per save (Kept, CalmPack, KeptUnpack) are Python types
// of their own written against the C API, not pybind11 classes: a pybind11 call dispatches
// through its overload machinery and a pybind11 instance is registered in a global map as it
// is made and unregistered as it dies, which together cost more than the rest of a calm save.
// The hooks are called through vectorcall (no argument tuple). The Ledger, called only on the
// full way, stays a pybind11 class.
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
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/headeronly/version.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <unordered_map>
#include <utility>

#include "common/check.h"

namespace py = pybind11;

namespace bagualu2 {
namespace {

PyObject* g_error = nullptr;  // bagualu2._saves.Error, what Error raises in Python (set at import)

// Runs the body of a C API entry point: a C++ exception becomes the Python exception pybind11
// would raise for it, and `failed` is returned.
template <typename R, typename F>
R guarded(R failed, F&& body) {
    try {
        return body();
    } catch (py::error_already_set& e) {
        e.restore();
    } catch (const Error& e) {
        PyErr_SetString(g_error, e.what());
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return failed;
}

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
    std::optional<bool> add(const c10::Storage& storage, std::optional<int64_t> target) {
        const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
        auto it = held.find(key);
        if (it != held.end()) {
            ++it->second.count;
            return true;
        }
        const auto nbytes = static_cast<int64_t>(storage.nbytes());
        if (target && resident + nbytes > *target) {
            return std::nullopt;
        }
        held.emplace(key, Entry{1, nbytes, c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl())});
        resident += nbytes;
        if (resident > peak) {
            peak = resident;
        }
        return false;
    }

    void sub(const c10::StorageImpl* key) {
        auto it = held.find(key);
        BAGUALU2_CHECK(it != held.end(), "bagualu2 ledger: a count given back for a storage it does not hold");
        if (--it->second.count == 0) {
            resident -= it->second.nbytes;
            held.erase(it);
        }
    }

    // Gives back the counts of the pins that died (L3), last queued first; a pin released and
    // then dead is queued twice and counted back once.
    void collect() {
        while (PyList_GET_SIZE(dead.ptr()) > 0) {
            const Py_ssize_t end = PyList_GET_SIZE(dead.ptr()) - 1;
            PyObject* ref = PyList_GET_ITEM(dead.ptr(), end);
            PyObject* cdata = PyDict_GetItemWithError(pins.ptr(), ref);  // borrowed
            if (cdata != nullptr) {
                const auto* key = static_cast<const c10::StorageImpl*>(PyLong_AsVoidPtr(cdata));
                if (PyDict_DelItem(pins.ptr(), ref) != 0) {
                    throw py::error_already_set();
                }
                sub(key);
            } else if (PyErr_Occurred()) {
                throw py::error_already_set();
            }
            if (PyList_SetSlice(dead.ptr(), end, end + 1, nullptr) != 0) {
                throw py::error_already_set();
            }
        }
    }

    void link(Kept* k);
    void unlink(Kept* k);
};

PyTypeObject KeptType{};  // filled in at import (ready_type)

// The kept-save record, a Python object of type Kept with its C++ fields in place. Made by
// make_kept, freed by kept_dealloc: no pybind11 instance, nothing registered anywhere.
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
    explicit Kept(const at::Tensor& t) : tensor(t.grad_fn() ? t.tensor_data() : t), version(t._version()) {}
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

void LedgerState::link(Kept* k) {
    k->prev = last;
    k->next = nullptr;
    (last != nullptr ? last->next : first) = k;
    last = k;
    ++kept;
}

void LedgerState::unlink(Kept* k) {
    (k->prev != nullptr ? k->prev->next : first) = k->next;
    (k->next != nullptr ? k->next->prev : last) = k->prev;
    k->prev = k->next = nullptr;
    --kept;
}

// A record as Python holds it (a new reference) and as C++ reads it; `kept` null (and `obj`
// None): none made.
struct Record {
    py::object obj = py::none();
    Kept* kept = nullptr;
};

// A new record of `t`, charged to nothing until the ledger counts it.
Record make_kept(const at::Tensor& t) {
    void* memory = PyObject_Malloc(sizeof(Kept));
    if (memory == nullptr) {
        throw std::bad_alloc();
    }
    Kept* k = nullptr;
    try {
        k = new (memory) Kept(t);
    } catch (...) {
        PyObject_Free(memory);
        throw;
    }
    PyObject_Init(k->self(), &KeptType);
    return {py::reinterpret_steal<py::object>(k->self()), k};
}

void kept_dealloc(PyObject* self) {
    reinterpret_cast<Kept*>(self)->~Kept();  // gives its count back (L3)
    PyObject_Free(self);
}

Kept& as_kept(PyObject* self) { return *reinterpret_cast<Kept*>(self); }

const at::Tensor& tensor_of(PyObject* obj, const char* what) {
    BAGUALU2_CHECK(THPVariable_Check(obj), what, " must be a torch.Tensor, not ", Py_TYPE(obj)->tp_name);
    return THPVariable_Unpack(obj);
}

PyObject* kept_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"tensor", nullptr};
    PyObject* tensor = nullptr;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Kept", const_cast<char**>(keywords), &tensor)) {
        return nullptr;
    }
    return guarded<PyObject*>(nullptr, [&] { return make_kept(tensor_of(tensor, "the kept tensor")).obj.release().ptr(); });
}

PyObject* new_ref(const py::object& obj) { return py::object(obj).release().ptr(); }

// A settable object field (node, moved): deleting it is refused.
int set_object(py::object& field, PyObject* value, const char* name) {
    if (value == nullptr) {
        PyErr_Format(PyExc_AttributeError, "Kept.%s cannot be deleted", name);
        return -1;
    }
    field = py::reinterpret_borrow<py::object>(value);
    return 0;
}

PyGetSetDef kept_fields[] = {
    {"tensor",
     [](PyObject* self, void*) -> PyObject* {
         const at::Tensor& t = as_kept(self).tensor;
         return t.defined() ? THPVariable_Wrap(t) : Py_NewRef(Py_None);
     },
     [](PyObject* self, PyObject* value, void*) -> int {
         if (value != Py_None) {
             PyErr_SetString(g_error, "Kept.tensor can only be cleared (set to None)");
             return -1;
         }
         as_kept(self).tensor = at::Tensor();
         return 0;
     },
     "The saved tensor, None once it moved (offloaded to make room).", nullptr},
    {"version", [](PyObject* self, void*) { return PyLong_FromLongLong(as_kept(self).version); }, nullptr,
     "Its version counter at the save.", nullptr},
    {"node", [](PyObject* self, void*) { return new_ref(as_kept(self).node); },
     [](PyObject* self, PyObject* value, void*) { return set_object(as_kept(self).node, value, "node"); },
     "The traced storage it holds, or None.", nullptr},
    {"state", [](PyObject* self, void*) { return PyLong_FromLongLong(as_kept(self).state); }, nullptr,
     "That storage's state at the save.", nullptr},
    {"moved", [](PyObject* self, void*) { return new_ref(as_kept(self).moved); },
     [](PyObject* self, PyObject* value, void*) { return set_object(as_kept(self).moved, value, "moved"); },
     "Where it went when offloaded later to make room, or None.", nullptr},
    {"frame", [](PyObject* self, void*) { return PyLong_FromLongLong(as_kept(self).frame); }, nullptr,
     "The index of the frame that saved it (-1: none).", nullptr},
    {"shared", [](PyObject* self, void*) { return PyBool_FromLong(as_kept(self).shared); }, nullptr,
     "Whether its storage was held already when it was kept.", nullptr},
    {"nbytes", [](PyObject* self, void*) { return PyLong_FromLongLong(as_kept(self).nbytes); }, nullptr,
     "Its storage's bytes (0 when uncounted).", nullptr},
    {"pin", [](PyObject* self, void*) { return Py_NewRef(as_kept(self).key != nullptr ? self : Py_None); }, nullptr,
     "Itself while it holds a count; None when uncounted or dropped.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMethodDef kept_methods[] = {
    {"drop",
     [](PyObject* self, PyObject*) -> PyObject* {
         return guarded<PyObject*>(nullptr, [&] {
             as_kept(self).drop();
             return Py_NewRef(Py_None);
         });
     },
     METH_NOARGS, "Give the count back now."},
    {nullptr, nullptr, 0, nullptr},
};

// A static type's header as PyVarObject_HEAD_INIT makes it (one reference: its own), with its
// name, doc, size and flags; the rest is set by its maker before PyType_Ready.
void init_type(PyTypeObject& type, const char* name, const char* doc, Py_ssize_t size, unsigned long flags) {
    Py_SET_REFCNT(reinterpret_cast<PyObject*>(&type), 1);
    type.tp_name = name;
    type.tp_doc = doc;
    type.tp_basicsize = size;
    type.tp_flags = flags;
}

void ready_kept() {
    init_type(KeptType, "bagualu2._saves.Kept",
              "Kept(tensor): a saved tensor held as it is (see the module's design note); made so, an uncounted "
              "record, held and charged to nothing (a parameter, a view of one).",
              sizeof(Kept), Py_TPFLAGS_DEFAULT);  // final (no Py_TPFLAGS_BASETYPE): the hooks check the exact type
    KeptType.tp_new = kept_new;
    KeptType.tp_dealloc = kept_dealloc;
    KeptType.tp_getset = kept_fields;
    KeptType.tp_methods = kept_methods;
}

const c10::Storage& storage_of(py::handle obj) {
    BAGUALU2_CHECK(THPStorage_Check(obj.ptr()), "storage must be a torch.UntypedStorage, not ",
                   Py_TYPE(obj.ptr())->tp_name);
    return THPStorage_Unpack(obj.ptr());
}

py::object wrap(const at::Tensor& t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); }

// A record of `t` counted (L2): none made, and nothing counted, where its storage is not held
// yet and its bytes would take resident over `target` (L5).
Record keep_record(const std::shared_ptr<LedgerState>& s, const at::Tensor& t, py::handle node, int64_t state,
                   int64_t frame, std::optional<int64_t> target) {
    s->collect();
    Record kept = make_kept(t);
    std::optional<bool> held = s->add(t.storage(), target);
    if (!held) {
        return {};  // the record dies uncounted
    }
    // From here nothing can fail before the record owns its count.
    Kept* k = kept.kept;
    k->node = py::reinterpret_borrow<py::object>(node);
    k->state = state;
    k->frame = frame;
    k->shared = *held;
    k->nbytes = static_cast<int64_t>(t.storage().nbytes());
    k->ledger = s;
    k->key = t.storage().unsafeGetStorageImpl();
    s->link(k);
    return kept;
}

// The calm pack hook's common case, in one call: a plain tensor (torch.Tensor or a Parameter,
// dense and strided, no dispatch mode on the stack) is held uncounted when it is a parameter
// (its storage in `param_storages`, the addresses of the model's parameter storages, or a
// Parameter itself) and kept, counted against `target`, otherwise. None where the caller's full
// way must decide: anything else, a view of a tensor subclass, a save that would cross the target.
Record keep_plain_record(const std::shared_ptr<LedgerState>& s, PyObject* obj, PyObject* param_storages,
                         int64_t frame, std::optional<int64_t> target) {
    // torch.Tensor or a Parameter exactly (THPVariable_CheckExact admits both).
    const bool plain = reinterpret_cast<PyObject*>(Py_TYPE(obj)) == THPVariableClass;
    const bool parameter = reinterpret_cast<PyObject*>(Py_TYPE(obj)) == ParameterClass;
    if ((!plain && !parameter) || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
        return {};
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.layout() != c10::kStrided || t.is_nested()) {
        return {};
    }
    py::object cdata = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(t.storage().unsafeGetStorageImpl()));
    const int in_params = PySet_Contains(param_storages, cdata.ptr());
    if (in_params < 0) {
        throw py::error_already_set();
    }
    if (in_params || parameter) {
        return make_kept(t);
    }
    if (t.is_view()) {  // a view of a subclass (a Parameter the model did not hold): the full way
        py::object base = wrap(at::Tensor(t._base()));
        if (reinterpret_cast<PyObject*>(Py_TYPE(base.ptr())) != THPVariableClass) {
            return {};
        }
    }
    return keep_record(s, t, py::none(), 0, frame, target);
}

class Ledger {
public:
    Ledger() : s_(std::make_shared<LedgerState>()) {}

    const std::shared_ptr<LedgerState>& state() const { return s_; }

    int64_t resident() {
        s_->collect();
        return s_->resident;
    }
    int64_t peak() const { return s_->peak; }
    void set_peak(int64_t peak) { s_->peak = peak; }
    void reset_peak() { s_->peak = resident(); }
    int64_t pins() {
        s_->collect();
        return static_cast<int64_t>(PyDict_Size(s_->pins.ptr())) + s_->kept;
    }

    // A pin's count (L2): the weak reference is made first, so nothing after the count can fail
    // but a dictionary insert of a new key.
    std::optional<bool> acquire(py::handle storage, py::handle pin, std::optional<int64_t> target) {
        const c10::Storage& s = storage_of(storage);
        py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(pin.ptr(), s_->on_death.ptr()));
        if (!ref) {
            throw py::error_already_set();
        }
        py::object cdata = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(s.unsafeGetStorageImpl()));
        s_->collect();
        std::optional<bool> held = s_->add(s, target);
        if (!held) {
            return std::nullopt;
        }
        if (PyDict_SetItem(s_->pins.ptr(), ref.ptr(), cdata.ptr()) != 0 || PyObject_SetAttrString(pin.ptr(), "_ref", ref.ptr()) != 0) {
            throw py::error_already_set();
        }
        return held;
    }

    // Gives back the count a pin holds (its weak reference); nothing when it was given back.
    void release(py::handle ref) {
        if (PyList_Append(s_->dead.ptr(), ref.ptr()) != 0) {
            throw py::error_already_set();
        }
        s_->collect();
    }

    void collect() { s_->collect(); }

    bool holds(py::handle storage) {
        const c10::Storage& s = storage_of(storage);
        s_->collect();
        return s_->held.count(s.unsafeGetStorageImpl()) != 0;
    }

    std::optional<std::pair<int64_t, int64_t>> count(uintptr_t cdata) {
        s_->collect();
        auto it = s_->held.find(reinterpret_cast<const c10::StorageImpl*>(cdata));
        if (it == s_->held.end()) {
            return std::nullopt;
        }
        return std::make_pair(it->second.count, it->second.nbytes);
    }

    // The live holders of type `kind` with the storage each holds, in the order they were
    // counted: the Kept records for Kept, else the pins whose type is `kind`.
    py::list live(py::handle kind) {
        s_->collect();
        py::list out;
        if (kind.ptr() == reinterpret_cast<PyObject*>(&KeptType)) {
            for (Kept* k = s_->first; k != nullptr; k = k->next) {
                out.append(py::make_tuple(py::reinterpret_borrow<py::object>(k->self()), reinterpret_cast<uintptr_t>(k->key)));
            }
            return out;
        }
        for (auto item : s_->pins) {
            py::object pin = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(item.first.ptr()));
            if (!pin) {
                throw py::error_already_set();
            }
            if (pin.ptr() != Py_None && Py_TYPE(pin.ptr()) == reinterpret_cast<PyTypeObject*>(kind.ptr())) {
                out.append(py::make_tuple(pin, item.second));
            }
        }
        return out;
    }

    py::object keep(py::handle tensor, py::handle node, int64_t state, int64_t frame, std::optional<int64_t> target) {
        return keep_record(s_, tensor_of(tensor.ptr(), "the kept tensor"), node, state, frame, target).obj;
    }

    py::object keep_plain(py::handle tensor, py::handle param_storages, int64_t frame, std::optional<int64_t> target) {
        BAGUALU2_CHECK(PyAnySet_Check(param_storages.ptr()), "param_storages must be a set, not ",
                       Py_TYPE(param_storages.ptr())->tp_name);
        return keep_plain_record(s_, tensor.ptr(), param_storages.ptr(), frame, target).obj;
    }

private:
    std::shared_ptr<LedgerState> s_;
};

// Interned attribute names, made once: the hooks read them at every save.
PyObject* name(const char* s) {
    PyObject* n = PyUnicode_InternFromString(s);
    if (n == nullptr) {
        throw py::error_already_set();
    }
    return n;  // held for the life of the process
}

py::object get(PyObject* obj, PyObject* attr) {
    PyObject* out = PyObject_GetAttr(obj, attr);
    if (out == nullptr) {
        throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(out);
}

bool truthy(const py::object& obj) {
    const int out = PyObject_IsTrue(obj.ptr());
    if (out < 0) {
        throw py::error_already_set();
    }
    return out != 0;
}

// The one argument of a hook's vectorcall, or null with a TypeError set.
PyObject* one_argument(const char* hook, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "%s takes one positional argument (the saved tensor or its record)", hook);
        return nullptr;
    }
    return args[0];
}

// The pack hook of an untraced frame (bagualu2.runtime.ActivationRuntime), made for that
// frame. Its common case, a plain tensor that fits the budget, is counted and kept here
// (keep_plain_record), and so is a parameter (held, never counted); anything else takes the
// full way, `fallback`: the frame no longer running, offloads in flight or made by this frame,
// a subclass, another dispatch mode on the stack, a save that would cross the budget. It reads
// the runtime's state where the runtime keeps it, at each call (the residency's running frame,
// in-flight offloads, parameter storages and budget; the frame's budget and untraced offloads):
// nothing is mirrored that could fall out of step. What it kept it counts here (`packed`,
// `kept_bytes`, `shared_bytes`: bytes of storages held already), for the runtime to add to the
// frame's stats when the frame's hooks come off.
struct CalmPackState {
    std::shared_ptr<LedgerState> ledger;
    py::object residency;
    py::object frame;
    py::object fallback;
    py::object run;  // the frame's runtime_state: made with the frame, never replaced
    int64_t index;
    int64_t packed = 0;
    int64_t kept_bytes = 0;
    int64_t shared_bytes = 0;

    PyObject* pack(PyObject* t) {
        static PyObject* const frame_name = name("frame");
        static PyObject* const inflight_name = name("inflight");
        static PyObject* const untraced_name = name("untraced_offloads");
        static PyObject* const budget_name = name("budget");
        static PyObject* const target_name = name("save_target");
        static PyObject* const budget_bytes_name = name("budget_bytes");
        static PyObject* const params_name = name("param_storages");

        PyObject* res = residency.ptr();
        if (get(res, frame_name).ptr() != frame.ptr() || truthy(get(res, inflight_name)) ||
            truthy(get(run.ptr(), untraced_name))) {
            return PyObject_CallOneArg(fallback.ptr(), t);
        }
        py::object budget = get(frame.ptr(), budget_name);
        py::object target = budget.is_none() ? get(res, budget_bytes_name) : get(budget.ptr(), target_name);
        Record kept = keep_plain_record(ledger, t, get(res, params_name).ptr(), index,
                                        target.is_none() ? std::nullopt : std::optional<int64_t>(target.cast<int64_t>()));
        if (kept.kept == nullptr) {
            return PyObject_CallOneArg(fallback.ptr(), t);
        }
        if (kept.kept->key != nullptr) {  // counted (a parameter is not)
            ++packed;
            (kept.kept->shared ? shared_bytes : kept_bytes) += kept.kept->nbytes;
        }
        return kept.obj.release().ptr();
    }
};

struct CalmPack {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    CalmPackState* s;
};

// The unpack hook: a Kept record, unmoved and unchanged, inside the backward pass that unpacked
// last, is served here; anything else goes to `fallback` (the runtime's unpack, which counts
// backward passes, follows moved records and raises for changed ones).
struct KeptUnpack {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject* fallback;
    int last_task;  // -2, no task yet: the first call always reaches the fallback
};

PyTypeObject CalmPackType{};
PyTypeObject KeptUnpackType{};

PyObject* calm_pack_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    PyObject* t = one_argument("CalmPack", args, nargsf, kwnames);
    CalmPackState* s = reinterpret_cast<CalmPack*>(self)->s;
    if (t == nullptr) {
        return nullptr;
    }
    if (s == nullptr) {
        PyErr_SetString(g_error, "this CalmPack was cleared");
        return nullptr;
    }
    return guarded<PyObject*>(nullptr, [&] { return s->pack(t); });
}

PyObject* calm_pack_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"ledger", "residency", "frame", "fallback", nullptr};
    PyObject *ledger = nullptr, *residency = nullptr, *frame = nullptr, *fallback = nullptr;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:CalmPack", const_cast<char**>(keywords), &ledger, &residency,
                                     &frame, &fallback)) {
        return nullptr;
    }
    return guarded<PyObject*>(nullptr, [&]() -> PyObject* {
        BAGUALU2_CHECK(py::isinstance<Ledger>(ledger), "CalmPack: ledger must be a bagualu2._saves.Ledger, not ",
                       Py_TYPE(ledger)->tp_name);
        BAGUALU2_CHECK(PyCallable_Check(fallback), "CalmPack: fallback must be callable, not ", Py_TYPE(fallback)->tp_name);
        static PyObject* const run_name = name("runtime_state");
        static PyObject* const index_name = name("index");
        auto state = std::make_unique<CalmPackState>(CalmPackState{
            py::cast<Ledger&>(ledger).state(), py::reinterpret_borrow<py::object>(residency),
            py::reinterpret_borrow<py::object>(frame), py::reinterpret_borrow<py::object>(fallback),
            get(frame, run_name), get(frame, index_name).cast<int64_t>()});
        CalmPack* out = PyObject_GC_New(CalmPack, &CalmPackType);
        if (out == nullptr) {
            throw py::error_already_set();
        }
        out->vectorcall = calm_pack_call;
        out->s = state.release();
        PyObject_GC_Track(out);
        return reinterpret_cast<PyObject*>(out);
    });
}

int calm_pack_traverse(PyObject* self, visitproc visit, void* arg) {
    if (const CalmPackState* s = reinterpret_cast<CalmPack*>(self)->s) {
        for (const py::object* field : {&s->residency, &s->frame, &s->fallback, &s->run}) {
            Py_VISIT(field->ptr());
        }
    }
    return 0;
}

int calm_pack_clear(PyObject* self) {
    delete std::exchange(reinterpret_cast<CalmPack*>(self)->s, nullptr);
    return 0;
}

void calm_pack_dealloc(PyObject* self) {
    PyObject_GC_UnTrack(self);
    calm_pack_clear(self);
    PyObject_GC_Del(self);
}

// A CalmPack's counter (closure: its offset in CalmPackState); 0 once cleared.
template <int64_t CalmPackState::*field>
PyObject* calm_pack_count(PyObject* self, void*) {
    const CalmPackState* s = reinterpret_cast<CalmPack*>(self)->s;
    return PyLong_FromLongLong(s != nullptr ? s->*field : 0);
}

PyGetSetDef calm_pack_fields[] = {
    {"fallback",
     [](PyObject* self, void*) -> PyObject* {
         const CalmPackState* s = reinterpret_cast<CalmPack*>(self)->s;
         return s != nullptr ? new_ref(s->fallback) : Py_NewRef(Py_None);
     },
     nullptr, "What takes the saves it does not keep.", nullptr},
    {"packed", calm_pack_count<&CalmPackState::packed>, nullptr, "Saves it kept, counted.", nullptr},
    {"kept_bytes", calm_pack_count<&CalmPackState::kept_bytes>, nullptr, "Bytes of the storages it counted first.", nullptr},
    {"shared_bytes", calm_pack_count<&CalmPackState::shared_bytes>, nullptr, "Bytes of storages held already when kept.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyObject* kept_unpack_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    PyObject* packed = one_argument("KeptUnpack", args, nargsf, kwnames);
    if (packed == nullptr) {
        return nullptr;
    }
    KeptUnpack* u = reinterpret_cast<KeptUnpack*>(self);
    const int task = torch::autograd::get_current_graph_task_id();
    if (task == u->last_task && Py_TYPE(packed) == &KeptType) {
        const Kept& k = as_kept(packed);
        if (k.moved.is_none() && k.tensor.defined() && k.tensor._version() == k.version) {
            return THPVariable_Wrap(k.tensor);
        }
    }
    u->last_task = task;
    if (u->fallback == nullptr) {
        PyErr_SetString(g_error, "this KeptUnpack was cleared");
        return nullptr;
    }
    return PyObject_CallOneArg(u->fallback, packed);
}

PyObject* kept_unpack_new(PyTypeObject*, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {"fallback", nullptr};
    PyObject* fallback = nullptr;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:KeptUnpack", const_cast<char**>(keywords), &fallback)) {
        return nullptr;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_Format(g_error, "KeptUnpack: fallback must be callable, not %s", Py_TYPE(fallback)->tp_name);
        return nullptr;
    }
    KeptUnpack* out = PyObject_GC_New(KeptUnpack, &KeptUnpackType);
    if (out == nullptr) {
        return nullptr;
    }
    out->vectorcall = kept_unpack_call;
    out->fallback = Py_NewRef(fallback);
    out->last_task = -2;
    PyObject_GC_Track(out);
    return reinterpret_cast<PyObject*>(out);
}

int kept_unpack_traverse(PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(reinterpret_cast<KeptUnpack*>(self)->fallback);
    return 0;
}

int kept_unpack_clear(PyObject* self) {
    Py_CLEAR(reinterpret_cast<KeptUnpack*>(self)->fallback);
    return 0;
}

void kept_unpack_dealloc(PyObject* self) {
    PyObject_GC_UnTrack(self);
    kept_unpack_clear(self);
    PyObject_GC_Del(self);
}

// The hooks' types: called through vectorcall, collected by the garbage collector (a hook holds
// the runtime through its fallback; a cycle through one is collectable).
void ready_hook(PyTypeObject& type, const char* name, const char* doc, Py_ssize_t size, Py_ssize_t vectorcall_offset,
                newfunc make, destructor dealloc, traverseproc traverse, inquiry clear) {
    init_type(type, name, doc, size, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL);
    type.tp_vectorcall_offset = vectorcall_offset;
    type.tp_call = PyVectorcall_Call;
    type.tp_new = make;
    type.tp_dealloc = dealloc;
    type.tp_traverse = traverse;
    type.tp_clear = clear;
}

void add_type(py::module_& m, const char* name, PyTypeObject& type) {
    if (PyType_Ready(&type) != 0) {
        throw py::error_already_set();
    }
    m.add_object(name, py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&type)));
}

}  // namespace
}  // namespace bagualu2

PYBIND11_MODULE(_saves, m) {
    using namespace bagualu2;
    m.doc() = "bagualu2's save path in C++: the residency ledger, the kept-save record and the saved-tensor hooks' fast paths";
    g_error = py::register_exception<Error>(m, "Error", PyExc_ValueError).ptr();
    // torch's C++ ABI holds within a release only: the package checks this against the torch it runs.
    m.attr("torch_release") = py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);

    ready_kept();
    add_type(m, "Kept", KeptType);

    ready_hook(CalmPackType, "bagualu2._saves.CalmPack",
               "CalmPack(ledger, residency, frame, fallback): the pack hook of an untraced frame (see its note in "
               "csrc/saves).",
               sizeof(CalmPack), offsetof(CalmPack, vectorcall), calm_pack_new, calm_pack_dealloc, calm_pack_traverse,
               calm_pack_clear);
    CalmPackType.tp_getset = calm_pack_fields;
    add_type(m, "CalmPack", CalmPackType);

    ready_hook(KeptUnpackType, "bagualu2._saves.KeptUnpack",
               "KeptUnpack(fallback): the unpack hook: Kept records here, the rest through the fallback.",
               sizeof(KeptUnpack), offsetof(KeptUnpack, vectorcall), kept_unpack_new, kept_unpack_dealloc,
               kept_unpack_traverse, kept_unpack_clear);
    add_type(m, "KeptUnpack", KeptUnpackType);

    py::class_<Ledger>(m, "Ledger", "Device bytes held for activations, counted once per storage.")
        .def(py::init<>())
        .def_property_readonly("resident", &Ledger::resident)
        .def_property("peak", &Ledger::peak, &Ledger::set_peak)
        .def_property_readonly("pins", &Ledger::pins, "How many holders (pins and Kept records) hold counts now.")
        .def("acquire", &Ledger::acquire, py::arg("storage"), py::arg("pin"), py::arg("target") = py::none())
        .def("release", &Ledger::release, py::arg("ref"))
        .def("collect", &Ledger::collect)
        .def("holds", &Ledger::holds, py::arg("storage"))
        .def("count", &Ledger::count, py::arg("cdata"))
        .def("reset_peak", &Ledger::reset_peak)
        .def("live", &Ledger::live, py::arg("kind"))
        .def("keep_plain", &Ledger::keep_plain, py::arg("tensor"), py::arg("param_storages"), py::arg("frame"),
             py::arg("target"))
        .def("keep", &Ledger::keep, py::arg("tensor"), py::arg("node"), py::arg("state"), py::arg("frame"),
             py::arg("target"));
}
