// The saved-tensor hooks' common cases in C++: see hooks.cpp, whose note states the invariants.
#pragma once

#include <pybind11/pybind11.h>

namespace bagualu2::saves {

// Makes CalmPack and KeptUnpack types of `m`.
void add_hooks(pybind11::module_& m);

}  // namespace bagualu2::saves
