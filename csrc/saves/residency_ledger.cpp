// bagualu2._saves: the residency ledger and the kept-save record, the part of the save path
// that runs once per saved tensor (torch-linked; the rest of the C++ core is torch-free).
//
// The ledger counts the device bytes the activation runtime holds, once per storage: a
// storage's bytes are in `resident` while at least one holder holds it. Two kinds of holder:
//
//   * a Kept record: what autograd holds in a kept saved tensor's place (the tensor, detached
//     when it is an op's output, and its version at the save). It is its own count: made by
//     `Ledger.keep`, which checks the budget and counts in the same call, and given back by its
//     destructor or `drop()`. A step keeps one per saved tensor, so this is the path written
//     for its cost: no Python bytecode runs between autograd's call of the pack hook and the
//     record it gets back, other than the hook's own few checks.
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
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/headeronly/version.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>

#include "common/check.h"

namespace py = pybind11;

namespace bagualu2 {
namespace {

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

struct Kept {
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

const at::Tensor& tensor_of(py::handle obj, const char* what) {
    BAGUALU2_CHECK(THPVariable_Check(obj.ptr()), what, " must be a torch.Tensor, not ",
                   Py_TYPE(obj.ptr())->tp_name);
    return THPVariable_Unpack(obj.ptr());
}

const c10::Storage& storage_of(py::handle obj) {
    BAGUALU2_CHECK(THPStorage_Check(obj.ptr()), "storage must be a torch.UntypedStorage, not ",
                   Py_TYPE(obj.ptr())->tp_name);
    return THPStorage_Unpack(obj.ptr());
}

py::object wrap(const at::Tensor& t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); }

class Ledger {
public:
    Ledger() : s_(std::make_shared<LedgerState>()) {}

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
        if (kind.ptr() == py::type::of<Kept>().ptr()) {
            for (Kept* k = s_->first; k != nullptr; k = k->next) {
                out.append(py::make_tuple(py::cast(k, py::return_value_policy::reference),
                                          reinterpret_cast<uintptr_t>(k->key)));
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

    // A record as Python holds it and as C++ reads it; `kept` null (and `obj` None): none made.
    struct Record {
        py::object obj = py::none();
        const Kept* kept = nullptr;
    };

    // A Kept record of `tensor`, counted (L2): None, and nothing counted, where its storage is
    // not held yet and its bytes would take resident over `target` (L5).
    py::object keep(py::handle tensor, py::handle node, int64_t state, int64_t frame, std::optional<int64_t> target) {
        return keep_record(tensor_of(tensor, "the kept tensor"), node, state, frame, target).obj;
    }

    Record keep_record(const at::Tensor& t, py::handle node, int64_t state, int64_t frame, std::optional<int64_t> target) {
        s_->collect();
        auto kept = std::make_unique<Kept>(t);
        std::optional<bool> held = s_->add(t.storage(), target);
        if (!held) {
            return {};
        }
        // From here nothing can fail before the record owns its count (py::cast allocates: if it
        // fails, the record's destructor gives the count back).
        kept->node = py::reinterpret_borrow<py::object>(node);
        kept->state = state;
        kept->frame = frame;
        kept->shared = *held;
        kept->nbytes = static_cast<int64_t>(t.storage().nbytes());
        kept->ledger = s_;
        kept->key = t.storage().unsafeGetStorageImpl();
        s_->link(kept.get());
        const Kept* raw = kept.get();
        return {py::cast(std::move(kept)), raw};
    }

    // The calm pack hook's common case, in one call: a plain tensor (torch.Tensor or a
    // Parameter, dense and strided, no dispatch mode on the stack) is held uncounted when it is
    // a parameter (its storage in `param_storages`, the addresses of the model's parameter
    // storages, or a Parameter itself) and kept, counted against `target`, otherwise. None
    // where the caller's full way must decide: anything else, a view of a tensor subclass, a
    // save that would cross the target.
    py::object keep_plain(py::handle tensor, py::handle param_storages, int64_t frame, std::optional<int64_t> target) {
        return keep_plain_record(tensor, param_storages, frame, target).obj;
    }

    Record keep_plain_record(py::handle tensor, py::handle param_storages, int64_t frame, std::optional<int64_t> target) {
        PyObject* obj = tensor.ptr();
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
        const int in_params = PySet_Contains(param_storages.ptr(), cdata.ptr());
        if (in_params < 0) {
            throw py::error_already_set();
        }
        if (in_params || parameter) {
            auto held = std::make_unique<Kept>(t);
            const Kept* raw = held.get();
            return {py::cast(std::move(held)), raw};
        }
        if (t.is_view()) {  // a view of a subclass (a Parameter the model did not hold): the full way
            py::object base = wrap(at::Tensor(t._base()));
            if (reinterpret_cast<PyObject*>(Py_TYPE(base.ptr())) != THPVariableClass) {
                return {};
            }
        }
        return keep_record(t, py::none(), 0, frame, target);
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

// The pack hook of an untraced frame (bagualu2.runtime.ActivationRuntime), made for that
// frame. Its common case, a plain tensor that fits the budget, is counted and kept here
// (Ledger.keep_plain), and so is a parameter (held, never counted); anything else takes the
// full way, `fallback`: the frame no longer running, offloads in flight or made by this frame,
// a subclass, another dispatch mode on the stack, a save that would cross the budget. It reads
// the runtime's state where the runtime keeps it, at each call (the residency's running frame,
// in-flight offloads, parameter storages and budget; the frame's budget and untraced offloads):
// nothing is mirrored that could fall out of step. What it kept it counts here (`packed`,
// `kept_bytes`, `shared_bytes`: bytes of storages held already), for the runtime to add to the
// frame's stats when the frame's hooks come off.
class CalmPack {
public:
    CalmPack(Ledger& ledger, py::object residency, py::object frame, py::object fallback)
        : ledger_(ledger), residency_(std::move(residency)), frame_(std::move(frame)), fallback_(std::move(fallback)),
          run_(get(frame_.ptr(), name("runtime_state"))),  // made with the frame, never replaced
          index_(get(frame_.ptr(), name("index")).cast<int64_t>()) {}

    py::object operator()(py::handle t) {
        static PyObject* const frame_name = name("frame");
        static PyObject* const inflight_name = name("inflight");
        static PyObject* const untraced_name = name("untraced_offloads");
        static PyObject* const budget_name = name("budget");
        static PyObject* const target_name = name("save_target");
        static PyObject* const budget_bytes_name = name("budget_bytes");
        static PyObject* const params_name = name("param_storages");

        PyObject* residency = residency_.ptr();
        PyObject* frame = frame_.ptr();
        if (get(residency, frame_name).ptr() != frame || truthy(get(residency, inflight_name)) ||
            truthy(get(run_.ptr(), untraced_name))) {
            return fallback_(t);
        }
        py::object budget = get(frame, budget_name);
        py::object target = budget.is_none() ? get(residency, budget_bytes_name) : get(budget.ptr(), target_name);
        Ledger::Record kept = ledger_.keep_plain_record(
            t, get(residency, params_name), index_,
            target.is_none() ? std::nullopt : std::optional<int64_t>(target.cast<int64_t>()));
        if (kept.kept == nullptr) {
            return fallback_(t);
        }
        if (kept.kept->key != nullptr) {  // counted (a parameter is not)
            ++packed_;
            (kept.kept->shared ? shared_bytes_ : kept_bytes_) += kept.kept->nbytes;
        }
        return kept.obj;
    }

    const py::object& fallback() const { return fallback_; }
    int64_t packed() const { return packed_; }
    int64_t kept_bytes() const { return kept_bytes_; }
    int64_t shared_bytes() const { return shared_bytes_; }

private:
    Ledger& ledger_;
    py::object residency_;
    py::object frame_;
    py::object fallback_;
    py::object run_;
    int64_t index_;
    int64_t packed_ = 0;
    int64_t kept_bytes_ = 0;
    int64_t shared_bytes_ = 0;
};

// The unpack hook's common case in C++: a Kept record, unmoved and unchanged, inside the
// backward pass that unpacked last; anything else goes to `fallback` (the runtime's unpack,
// which counts backward passes, follows moved records and raises for changed ones).
class KeptUnpack {
public:
    explicit KeptUnpack(py::object fallback) : fallback_(std::move(fallback)) {}

    py::object operator()(py::handle packed) {
        const int task = torch::autograd::get_current_graph_task_id();
        if (task == last_task_ && py::isinstance<Kept>(packed)) {
            const Kept& k = packed.cast<const Kept&>();
            if (k.moved.is_none() && k.tensor.defined() && k.tensor._version() == k.version) {
                return wrap(k.tensor);
            }
        }
        last_task_ = task;
        return fallback_(packed);
    }

private:
    py::object fallback_;
    int last_task_ = -2;  // no task yet: the first call always reaches the fallback
};

}  // namespace
}  // namespace bagualu2

PYBIND11_MODULE(_saves, m) {
    using namespace bagualu2;
    m.doc() = "bagualu2's save path in C++: the residency ledger, the kept-save record and the unpack hook's fast path";
    py::register_exception<Error>(m, "Error", PyExc_ValueError);
    // torch's C++ ABI holds within a release only: the package checks this against the torch it runs.
    m.attr("torch_release") = py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);

    py::class_<Kept>(m, "Kept", "A saved tensor held as it is (see the module's design note).")
        .def(py::init([](py::handle t) { return std::make_unique<Kept>(tensor_of(t, "the kept tensor")); }),
             py::arg("tensor"), "An uncounted record: held, charged to nothing (a parameter, a view of one).")
        .def_property(
            "tensor", [](const Kept& k) { return k.tensor.defined() ? wrap(k.tensor) : py::none(); },
            [](Kept& k, py::handle t) {
                BAGUALU2_CHECK(t.is_none(), "Kept.tensor can only be cleared (set to None)");
                k.tensor = at::Tensor();
            })
        .def_readonly("version", &Kept::version)
        .def_readwrite("node", &Kept::node)
        .def_readonly("state", &Kept::state)
        .def_readwrite("moved", &Kept::moved)
        .def_readonly("frame", &Kept::frame)
        .def_readonly("shared", &Kept::shared, "Whether its storage was held already when it was kept.")
        .def_readonly("nbytes", &Kept::nbytes, "Its storage's bytes (0 when uncounted).")
        .def_property_readonly("pin", [](py::handle self) { return self.cast<const Kept&>().key ? py::reinterpret_borrow<py::object>(self) : py::none(); },
                               "Itself while it holds a count; None when uncounted or dropped.")
        .def("drop", &Kept::drop, "Give the count back now.");

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

    py::class_<CalmPack>(m, "CalmPack", "The pack hook of an untraced frame (see its note in csrc/saves).")
        .def(py::init<Ledger&, py::object, py::object, py::object>(), py::arg("ledger"), py::arg("residency"),
             py::arg("frame"), py::arg("fallback"), py::keep_alive<1, 2>())
        .def("__call__", &CalmPack::operator())
        .def_property_readonly("fallback", &CalmPack::fallback, "What takes the saves it does not keep.")
        .def_property_readonly("packed", &CalmPack::packed, "Saves it kept, counted.")
        .def_property_readonly("kept_bytes", &CalmPack::kept_bytes, "Bytes of the storages it counted first.")
        .def_property_readonly("shared_bytes", &CalmPack::shared_bytes, "Bytes of storages held already when kept.");

    py::class_<KeptUnpack>(m, "KeptUnpack", "The unpack hook: Kept records here, the rest through the fallback.")
        .def(py::init<py::object>(), py::arg("fallback"))
        .def("__call__", &KeptUnpack::operator());
}
