// The bagualu2._C extension module: backend list, error translation, component bindings.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/registry.h"
#include "common/check.h"
#include "gpu/gpu.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "bagualu2 C++ runtime: host arena, copy engine, planner, plan cache";
    py::register_exception<bagualu2::Error>(m, "Error", PyExc_ValueError);
    py::register_exception<bagualu2::RuntimeError>(m, "RuntimeError", PyExc_RuntimeError);
    m.def("backends", &bagualu2::gpu::compiled_backends, "Backends compiled into this build, 'cpu' first.");
    bagualu2::register_offload(m);
    bagualu2::register_sched(m);
}
