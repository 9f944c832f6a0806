// PlanCache is a header template; the C++ core's own instantiation lives here so that its
// code is compiled (and warning-checked) once even when no caller instantiates it yet.
#include "sched/plan_cache.h"

#include "sched/planner.h"

namespace bagualu2 {

template class PlanCache<Plan>;

}  // namespace bagualu2
