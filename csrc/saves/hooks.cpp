// The saved-tensor hooks' common cases (bagualu2._saves): the pack hook keeps a calm save (an
// untraced frame's, or what a traced one runs untraced) of a plain tensor that fits the budget
// (CalmPack), and the unpack hook serves a kept record back (KeptUnpack); everything else goes
// to the Python runtime each was made with (`fallback`).
//
// Both are called once per saved tensor, so both are Python types of their own written against
// the C API, called through vectorcall (no argument tuple, none of pybind11's overload
// dispatch), and collected by the garbage collector (each holds the runtime through its
// fallback: a cycle through one is collectable).
//
// Invariants (tests/test_save_path.py, tests/test_activations.py):
//   H1 a hook decides nothing the runtime would decide otherwise: what CalmPack keeps is what
//      the full way would have kept (bit for bit: the calm way against a hook that hands every
//      save over), and what it cannot decide from the runtime's state it hands over.
//   H2 it reads the runtime's state where the runtime keeps it, at each call: nothing is
//      mirrored that could fall out of step.
//   H3 KeptUnpack hands each backward pass's first unpack over (the runtime counts passes), and
//      a record that moved or changed since its save.
//   H4 an error raised inside a hook or a record's making comes out as itself (`guarded`, as
//      torch's bindings translate it): an interrupt that lands in Python code reached from
//      here stays a KeyboardInterrupt (tests/test_faults.py's timer storms).
#include "saves/hooks.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>

#include "saves/ledger.h"

namespace bagualu2::saves {
namespace {

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

// The pack hook of a frame (bagualu2.runtime.ActivationRuntime), made for that frame. Its
// common case, a calm save (the frame's runtime state says its saves are calm now: an untraced
// frame's, or what a traced one runs untraced, outside the blocks its plan releases from) of a
// plain tensor that fits the budget, is counted and kept here (keep_plain_record), and so is a
// parameter (held, never counted); anything else takes the full way, `fallback`: a traced save,
// the frame no longer running, offloads in flight or made by this frame, a subclass, another
// dispatch mode on the stack, a save that would cross the budget, a storage a traced op of the
// frame made (its plan decides, wherever it is saved). It reads the runtime's state where the
// runtime keeps it, at each call (the residency's running frame, in-flight offloads, parameter
// storages and budget; the frame's budget, calm flag and untraced offloads; a traced frame's
// tracing mode's nodes): nothing is mirrored that could fall out of step. What it kept it
// counts here (`packed`, `kept_bytes`, `shared_bytes`: bytes of storages held already), for the
// runtime to add to the frame's stats when the frame's hooks come off.
struct CalmPackState {
    std::shared_ptr<LedgerState> ledger;
    py::object residency;
    py::object frame;
    py::object fallback;
    py::object run;  // the frame's runtime_state: made with the frame, never replaced
    py::object mode;  // the residency's tracing mode: made with the runtime, never replaced
    bool traced;      // the frame's `traced`, set before it starts: only a traced frame has traced storages
    int64_t index;
    int64_t packed = 0;
    int64_t kept_bytes = 0;
    int64_t shared_bytes = 0;

    PyObject* pack(PyObject* t) {
        static PyObject* const calm_name = name("calm");
        static PyObject* const frame_name = name("frame");
        static PyObject* const inflight_name = name("inflight");
        static PyObject* const untraced_name = name("untraced_offloads");
        static PyObject* const budget_name = name("budget");
        static PyObject* const target_name = name("save_target");
        static PyObject* const budget_bytes_name = name("budget_bytes");
        static PyObject* const params_name = name("param_storages");
        static PyObject* const nodes_name = name("nodes");

        PyObject* res = residency.ptr();
        if (!truthy(get(run.ptr(), calm_name)) || get(res, frame_name).ptr() != frame.ptr() ||
            truthy(get(res, inflight_name)) ||
            truthy(get(run.ptr(), untraced_name))) {
            return PyObject_CallOneArg(fallback.ptr(), t);
        }
        py::object budget = get(frame.ptr(), budget_name);
        py::object target = budget.is_none() ? get(res, budget_bytes_name) : get(budget.ptr(), target_name);
        py::object nodes = traced ? get(mode.ptr(), nodes_name) : py::object();
        BAGUALU2_CHECK(!nodes || PyDict_Check(nodes.ptr()), "CalmPack: the tracing mode's nodes must be a dict, not ",
                       Py_TYPE(nodes.ptr())->tp_name);
        Record kept = keep_plain_record(ledger, t, get(res, params_name).ptr(), index,
                                        target.is_none() ? std::nullopt : std::optional<int64_t>(target.cast<int64_t>()),
                                        nodes ? nodes.ptr() : nullptr);
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
    if (t == nullptr) {
        return nullptr;
    }
    CalmPackState* s = reinterpret_cast<CalmPack*>(self)->s;
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
        static PyObject* const mode_name = name("mode");
        static PyObject* const traced_name = name("traced");
        auto state = std::make_unique<CalmPackState>(CalmPackState{
            py::cast<Ledger&>(ledger).state(), py::reinterpret_borrow<py::object>(residency),
            py::reinterpret_borrow<py::object>(frame), py::reinterpret_borrow<py::object>(fallback),
            get(frame, run_name), get(residency, mode_name), truthy(get(frame, traced_name)),
            get(frame, index_name).cast<int64_t>()});
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
        for (const py::object* field : {&s->residency, &s->frame, &s->fallback, &s->run, &s->mode}) {
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

}  // namespace

void add_hooks(py::module_& m) {
    ready_hook(CalmPackType, "bagualu2._saves.CalmPack",
               "CalmPack(ledger, residency, frame, fallback): the pack hook of a frame (see its note in "
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
}

}  // namespace bagualu2::saves
