// Placeholder: the sched component registers its bindings here.
#include "bindings/registry.h"

namespace bagualu2 {
void register_sched(pybind11::module_& /*m*/) {}
}  // namespace bagualu2
