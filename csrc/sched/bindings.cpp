// Python bindings of the sched component: Planner and the overlap scheduler.
// The Python facades (bagualu2/plan/planner.py, bagualu2/plan/overlap.py) are the public interface.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/registry.h"
#include "common/check.h"
#include "sched/lru_cache.h"
#include "sched/overlap_scheduler.h"
#include "sched/planner.h"

namespace py = pybind11;

namespace bagualu2 {

namespace {

// Parallel lists -> candidates (the facade passes columns, which converts fastest).
std::vector<Candidate> make_candidates(const std::vector<std::string>& keys,
                                       const std::vector<std::int64_t>& nbytes,
                                       const std::vector<double>& recompute_s,
                                       const std::vector<double>& offload_s,
                                       const std::vector<double>& reload_s,
                                       const std::vector<bool>& can_offload,
                                       const std::vector<bool>& can_recompute) {
    const std::size_t n = keys.size();
    BAGUALU2_CHECK(nbytes.size() == n && recompute_s.size() == n && offload_s.size() == n &&
                       reload_s.size() == n && can_offload.size() == n &&
                       can_recompute.size() == n,
                   "candidate columns differ in length (", n, " keys)");
    std::vector<Candidate> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        out[i] = Candidate{keys[i],      nbytes[i],      recompute_s[i],  offload_s[i],
                           reload_s[i], can_offload[i], can_recompute[i]};
    }
    return out;
}

py::dict cache_stats_dict(const CacheStats& s) {
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["hit_rate"] = s.hit_rate;
    d["mean_lookup_us"] = s.mean_lookup_us;
    d["evictions"] = s.evictions;
    d["size"] = s.size;
    d["capacity"] = s.capacity;
    return d;
}

}  // namespace

void register_sched(py::module_& m) {
    // What a solve returns, by field name: read-only (the facade builds its Plan from it).
    py::class_<Plan>(m, "SolvedPlan", "A Planner.solve_columns result (csrc/sched/planner.h, Plan).")
        .def_property_readonly(
            "choices",
            [](const Plan& p) {
                std::vector<int> choices(p.choices.size());
                for (std::size_t i = 0; i < p.choices.size(); ++i) {
                    choices[i] = static_cast<int>(p.choices[i]);
                }
                return choices;
            },
            "Per candidate, in input order: 0 KEEP, 1 OFFLOAD, 2 RECOMPUTE.")
        .def_readonly("feasible", &Plan::feasible)
        .def_readonly("freed_bytes", &Plan::freed_bytes)
        .def_readonly("shortfall_bytes", &Plan::shortfall_bytes)
        .def_readonly("exposed_s", &Plan::exposed_s)
        .def_readonly("bound_s", &Plan::bound_s)
        .def_readonly("quantum_bytes", &Plan::quantum_bytes)
        .def_readonly("offload_quantum_s", &Plan::offload_quantum_s)
        .def_readonly("reload_quantum_s", &Plan::reload_quantum_s);

    py::class_<Planner>(m, "Planner", "Multiple-choice knapsack DP (see csrc/sched/planner.h).")
        .def(py::init<std::int64_t, double, std::int64_t>(), py::arg("quantum_bytes") = 0,
             py::arg("time_quantum_s") = 0.0, py::arg("max_cells") = 0)
        .def(
            "solve_columns",
            [](Planner& self, const std::vector<std::string>& keys,
               const std::vector<std::int64_t>& nbytes, const std::vector<double>& recompute_s,
               const std::vector<double>& offload_s, const std::vector<double>& reload_s,
               const std::vector<bool>& can_offload, const std::vector<bool>& can_recompute,
               std::int64_t must_free_bytes, double offload_window_s, double reload_window_s) {
                const auto cands = make_candidates(keys, nbytes, recompute_s, offload_s,
                                                   reload_s, can_offload, can_recompute);
                return self.solve(cands, must_free_bytes, offload_window_s, reload_window_s);
            },
            "Solve; returns a SolvedPlan.")
        .def_property_readonly("quantum_bytes", &Planner::quantum_bytes)
        .def_property_readonly("time_quantum_s", &Planner::time_quantum_s)
        .def_property_readonly("max_cells", &Planner::max_cells);

    py::class_<OverlapScheduler>(m, "OverlapScheduler",
                                 "Overlap scheduler DP (see csrc/sched/overlap_scheduler.h).")
        .def(py::init<std::int64_t, bool>(), py::arg("cache_capacity") = 256,
             py::arg("merge") = true)
        .def(
            "schedule_columns",
            [](OverlapScheduler& self, const std::vector<double>& op_duration,
               const std::vector<std::int64_t>& op_base_bytes, const std::vector<bool>& op_bubble,
               const std::vector<int>& kind, const std::vector<std::int64_t>& op,
               const std::vector<std::int64_t>& earliest, const std::vector<double>& duration,
               const std::vector<std::int64_t>& nbytes, std::int64_t budget_bytes,
               std::optional<std::vector<std::int64_t>> key) {
                const std::size_t n = op_duration.size(), t = kind.size();
                BAGUALU2_CHECK(op_base_bytes.size() == n && op_bubble.size() == n,
                               "op columns differ in length (", n, " ops)");
                BAGUALU2_CHECK(op.size() == t && earliest.size() == t && duration.size() == t &&
                                   nbytes.size() == t,
                               "task columns differ in length (", t, " tasks)");
                std::vector<OverlapOp> ops(n);
                for (std::size_t i = 0; i < n; ++i) {
                    ops[i] = OverlapOp{op_duration[i], op_base_bytes[i], op_bubble[i]};
                }
                std::vector<OverlapTask> tasks(t);
                for (std::size_t i = 0; i < t; ++i) {
                    BAGUALU2_CHECK(kind[i] >= 0 && kind[i] <= 2, "task ", i, ": kind must be 0, 1 "
                                   "or 2 (OFFLOAD, RELOAD, RECOMPUTE), got ", kind[i]);
                    tasks[i] = OverlapTask{static_cast<TaskKind>(kind[i]), op[i], earliest[i],
                                           duration[i], nbytes[i]};
                }
                std::optional<CacheKey> pk;
                if (key) {
                    BAGUALU2_CHECK(key->size() == 4, "cache key needs 4 integers, got ",
                                   key->size());
                    pk = CacheKey{(*key)[0], (*key)[1], (*key)[2], (*key)[3]};
                }
                // the facade looked the key up already (cached()); only store here
                const Schedule s = self.schedule(ops, tasks, budget_bytes);
                if (pk) self.store(*pk, s);
                return py::make_tuple(s.issue_after, s.early, s.feasible, s.exposed_s,
                                      s.peak_bytes, s.merged_ops, s.cache_hit);
            },
            "Schedule; returns (issue_after, early, feasible, exposed_s, peak_bytes, merged_ops, "
            "cache_hit).")
        .def(
            "cached",
            [](OverlapScheduler& self, std::int64_t a, std::int64_t b, std::int64_t c,
               std::int64_t d) -> py::object {
                const auto s = self.cached(CacheKey{a, b, c, d});
                if (!s) return py::none();
                return py::make_tuple(s->issue_after, s->early, s->feasible, s->exposed_s,
                                      s->peak_bytes, s->merged_ops, s->cache_hit);
            },
            "Stored schedule for a key (counted as a lookup), or None.")
        .def("cache_stats",
             [](const OverlapScheduler& self) { return cache_stats_dict(self.cache_stats()); })
        .def("clear_cache", &OverlapScheduler::clear_cache);
}

}  // namespace bagualu2
