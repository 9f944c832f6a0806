// The bagualu2._C extension module: backends, error translation, component bindings.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/registry.h"
#include "common/check.h"
#include "gpu/gpu.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "bagualu2 C++ runtime: host arena, copy engine, planner, overlap scheduler";
    py::register_exception<bagualu2::Error>(m, "Error", PyExc_ValueError);
    py::register_exception<bagualu2::RuntimeError>(m, "RuntimeError", PyExc_RuntimeError);
    m.def("backends", &bagualu2::gpu::compiled_backends,
          "Backends compiled into this build, 'cpu' first.");
    m.def(
        "backend_status",
        [] {
            py::dict out;
            for (const auto& s : bagualu2::gpu::backend_status()) {
                py::dict d;
                d["compiled"] = s.compiled;
                d["usable"] = s.usable;
                d["reason"] = s.reason;
                d["library"] = s.library;
                out[py::str(s.name)] = d;
            }
            return out;
        },
        "{name: {compiled, usable, reason, library}} for cpu, cuda and hip; loads each compiled "
        "GPU library once per process (the GIL is held: loading is quick and happens once).");
    // How other extension modules (the test hooks) reach this process's runtimes.
    m.attr("_runtime_api") = py::capsule(
        reinterpret_cast<void*>(&bagualu2::gpu::lookup_runtime), "bagualu2._C._runtime_api");
    bagualu2::register_offload(m);
    bagualu2::register_sched(m);
}
