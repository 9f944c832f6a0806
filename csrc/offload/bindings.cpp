// Placeholder: the offload component registers its bindings here.
#include "bindings/registry.h"

namespace bagualu2 {
void register_offload(pybind11::module_& /*m*/) {}
}  // namespace bagualu2
