// bagualu2._saves: the save path's per-save part in C++, linked against torch (the rest of the
// C++ core, bagualu2._C, is torch-free): the residency ledger and the kept-save record
// (ledger.h), the saved-tensor hooks' common cases (hooks.h), and the CPU allocation meter the
// benchmarks judge memory on (meter/cpu_meter.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/headeronly/version.h>

#include "saves/hooks.h"
#include "saves/ledger.h"
#include "meter/cpu_meter.h"

namespace py = pybind11;

PYBIND11_MODULE(_saves, m) {
    using namespace bagualu2::saves;
    m.doc() = "bagualu2's save path in C++: the residency ledger, the kept-save record and the saved-tensor hooks' fast paths";
    g_error = py::register_exception<bagualu2::Error>(m, "Error", PyExc_ValueError).ptr();
    // torch's C++ ABI holds within a release only: the package checks this against the torch it runs.
    m.attr("torch_release") = py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);

    add_kept(m);
    add_hooks(m);

    namespace meter = bagualu2::meter;
    m.def("meter_install", &meter::install,
          "Count every CPU storage allocated from now on (torch's CPU allocator, for the rest of the process).");
    m.def("meter_installed", &meter::installed);
    m.def("meter_charge_to", &meter::charge_to, py::arg("account"),
          "Charge later allocations to `account` (0..63); returns the account charged before.");
    m.def("meter_bytes", &meter::bytes, py::arg("account"), "An account's bytes alive now.");
    m.def("meter_high_water", &meter::high_water, py::arg("account"), py::arg("mark"),
          "An account's high-water mark `mark` (0 or 1) since it was last reset.");
    m.def("meter_reset_mark", &meter::reset_mark, py::arg("account"), py::arg("mark"),
          "Reset the mark to the account's bytes now; returns the value it had.");

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
