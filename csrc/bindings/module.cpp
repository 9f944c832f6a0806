// The bagualu2._C extension module: backend list, error translation, component bindings.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/registry.h"
#include "common/check.h"

namespace py = pybind11;

namespace {

std::vector<std::string> compiled_backends() {
    std::vector<std::string> names{"cpu"};
#ifdef BAGUALU2_WITH_CUDA
    names.emplace_back("cuda");
#endif
#ifdef BAGUALU2_WITH_HIP
    names.emplace_back("hip");
#endif
    return names;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "bagualu2 C++ runtime: host arena, copy engine, planner, plan cache";
    py::register_exception<bagualu2::Error>(m, "Error", PyExc_ValueError);
    py::register_exception<bagualu2::RuntimeError>(m, "RuntimeError", PyExc_RuntimeError);
    m.def("backends", &compiled_backends, "Backends compiled into this build, 'cpu' first.");
    bagualu2::register_offload(m);
    bagualu2::register_sched(m);
}
