// The residency ledger and the kept-save record: see ledger.h, whose note states the invariants.
#include "saves/ledger.h"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/stl.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

namespace bagualu2::saves {

PyObject* g_error = nullptr;

void init_type(PyTypeObject& type, const char* name, const char* doc, Py_ssize_t size, unsigned long flags) {
    Py_SET_REFCNT(reinterpret_cast<PyObject*>(&type), 1);
    type.tp_name = name;
    type.tp_doc = doc;
    type.tp_basicsize = size;
    type.tp_flags = flags;
}

void add_type(py::module_& m, const char* name, PyTypeObject& type) {
    if (PyType_Ready(&type) != 0) {
        throw py::error_already_set();
    }
    m.add_object(name, py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&type)));
}

std::optional<bool> LedgerState::add(const c10::Storage& storage, std::optional<int64_t> target) {
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

void LedgerState::sub(const c10::StorageImpl* key) {
    auto it = held.find(key);
    BAGUALU2_CHECK(it != held.end(), "bagualu2 ledger: a count given back for a storage it does not hold");
    if (--it->second.count == 0) {
        resident -= it->second.nbytes;
        held.erase(it);
    }
}

void LedgerState::collect() {
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

PyTypeObject KeptType{};  // filled in at import (add_kept)

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

namespace {

const c10::Storage& storage_of(py::handle obj) {
    BAGUALU2_CHECK(THPStorage_Check(obj.ptr()), "storage must be a torch.UntypedStorage, not ",
                   Py_TYPE(obj.ptr())->tp_name);
    return THPStorage_Unpack(obj.ptr());
}

py::object wrap(const at::Tensor& t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); }

void kept_dealloc(PyObject* self) {
    reinterpret_cast<Kept*>(self)->~Kept();  // gives its count back (L3)
    PyObject_Free(self);
}

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

}  // namespace

void add_kept(py::module_& m) {
    init_type(KeptType, "bagualu2._saves.Kept",
              "Kept(tensor): a saved tensor held as it is (see csrc/saves/ledger.h); made so, an uncounted "
              "record, held and charged to nothing (a parameter, a view of one).",
              sizeof(Kept), Py_TPFLAGS_DEFAULT);  // final (no Py_TPFLAGS_BASETYPE): the hooks check the exact type
    KeptType.tp_new = kept_new;
    KeptType.tp_dealloc = kept_dealloc;
    KeptType.tp_getset = kept_fields;
    KeptType.tp_methods = kept_methods;
    add_type(m, "Kept", KeptType);
}

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

Record keep_plain_record(const std::shared_ptr<LedgerState>& s, PyObject* obj, PyObject* param_storages,
                         int64_t frame, std::optional<int64_t> target, PyObject* traced) {
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
    if (traced != nullptr && PyDict_GET_SIZE(traced) > 0) {
        const int is_traced = PyDict_Contains(traced, cdata.ptr());
        if (is_traced < 0) {
            throw py::error_already_set();
        }
        if (is_traced) {
            return {};
        }
    }
    if (t.is_view()) {  // a view of a subclass (a Parameter the model did not hold): the full way
        py::object base = wrap(at::Tensor(t._base()));
        if (reinterpret_cast<PyObject*>(Py_TYPE(base.ptr())) != THPVariableClass) {
            return {};
        }
    }
    return keep_record(s, t, py::none(), 0, frame, target);
}

// -- Ledger ---------------------------------------------------------------------------------

int64_t Ledger::resident() {
    s_->collect();
    return s_->resident;
}

int64_t Ledger::pins() {
    s_->collect();
    return static_cast<int64_t>(PyDict_Size(s_->pins.ptr())) + s_->kept;
}

// A pin's count (L2): the weak reference is made first, so nothing after the count can fail
// but a dictionary insert of a new key.
std::optional<bool> Ledger::acquire(py::handle storage, py::handle pin, std::optional<int64_t> target) {
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
void Ledger::release(py::handle ref) {
    if (PyList_Append(s_->dead.ptr(), ref.ptr()) != 0) {
        throw py::error_already_set();
    }
    s_->collect();
}

bool Ledger::holds(py::handle storage) {
    const c10::Storage& s = storage_of(storage);
    s_->collect();
    return s_->held.count(s.unsafeGetStorageImpl()) != 0;
}

std::optional<std::pair<int64_t, int64_t>> Ledger::count(uintptr_t cdata) {
    s_->collect();
    auto it = s_->held.find(reinterpret_cast<const c10::StorageImpl*>(cdata));
    if (it == s_->held.end()) {
        return std::nullopt;
    }
    return std::make_pair(it->second.count, it->second.nbytes);
}

// The live holders of type `kind` with the storage each holds, in the order they were
// counted: the Kept records for Kept, else the pins whose type is `kind`.
py::list Ledger::live(py::handle kind) {
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

py::object Ledger::keep(py::handle tensor, py::handle node, int64_t state, int64_t frame, std::optional<int64_t> target) {
    return keep_record(s_, tensor_of(tensor.ptr(), "the kept tensor"), node, state, frame, target).obj;
}

py::object Ledger::keep_plain(py::handle tensor, py::handle param_storages, int64_t frame, std::optional<int64_t> target) {
    BAGUALU2_CHECK(PyAnySet_Check(param_storages.ptr()), "param_storages must be a set, not ",
                   Py_TYPE(param_storages.ptr())->tp_name);
    return keep_plain_record(s_, tensor.ptr(), param_storages.ptr(), frame, target).obj;
}

}  // namespace bagualu2::saves
