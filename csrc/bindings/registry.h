// Each component registers its own Python bindings; module.cpp only calls these.
#pragma once

#include <pybind11/pybind11.h>

namespace bagualu2 {

void register_offload(pybind11::module_& m);  // csrc/offload/bindings.cpp
void register_sched(pybind11::module_& m);    // csrc/sched/bindings.cpp

}  // namespace bagualu2
