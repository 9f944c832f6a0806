// Planner: one KEEP / OFFLOAD / RECOMPUTE choice per saved activation, minimizing exposed time.
//
// Design note (invariants; each one has a test in tests/test_planner.py):
//  1. Exposed time of a plan = sum(recompute_s of RECOMPUTE)
//       + max(0, sum(offload_s of OFFLOAD) - offload_window_s)
//       + max(0, sum(reload_s  of OFFLOAD) - reload_window_s).
//     Plan::exposed_s is this value computed exactly (in double) from the unquantized inputs.
//  2. Feasibility is exact in bytes. The DP quantizes bytes with quantum q_b: item bytes are
//     rounded DOWN, the required bytes UP, so every plan the DP accepts frees >= must_free_bytes
//     exact bytes. If the quantized problem has no solution although releasing every releasable
//     op would be enough, the planner falls back to releasing all of them (still feasible).
//     feasible == (bytes of all releasable ops >= must_free_bytes), never anything else.
//  3. Copy time is quantized per direction with quantum q_t: item times are rounded UP and the
//     window DOWN, so the DP's estimate (Plan::bound_s) is never below the plan's true exposure.
//  4. Optimality: the DP is exact for the quantized problem. Hence, for any plan X that frees
//     at least must_free_bytes + k_X * q_b exact bytes (k_X = ops X releases), with o_X ops
//     offloaded:  exposed(plan) <= exposed(X) + (o_X + 1) * (q_offload + q_reload).
//     When all bytes are multiples of q_b and all copy times and windows multiples of q_t, the
//     plan is exactly optimal. (A direction whose copies always fit in its window, or whose
//     window is zero, is handled exactly without a time dimension; a window below 1e-12 of
//     its copies is treated as zero and reported as the quantum, keeping the bound true.)
//     After the DP, an exact local search (one- and two-op choice changes that keep the
//     target and lower the exact exposed time) polishes the plan: it only ever lowers
//     exposed_s, so the bound above still holds and bound_s (the DP's estimate of its own
//     plan) stays >= exposed_s. It wins back what rounding small copies up costs. A greedy
//     seed (least marginal exposed time per byte), polished the same way, replaces the
//     result when it is better in exact terms; either way the plan meets the target.
//     When every offloadable op has reload_s = rho * offload_s (copy times from two fixed
//     bandwidths) and no time quantum is forced, both windows fold into one time axis over
//     reload time (offload quantum = reload quantum / rho): many more slots per window.
//  5. must_free_bytes <= 0 returns all KEEP without running the DP.
//  6. The planner is torch-free, allocation-light (tables are reused between solves) and not
//     thread-safe: use one Planner per thread.
//
// The DP runs backward over the ops on states (bytes still needed, forward window left,
// backward window left), so each (state, choice) has exactly one successor and the plan is
// read forward from the start state with one stored choice byte per (op, state).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace bagualu2 {

enum class Choice : std::uint8_t { KEEP = 0, OFFLOAD = 1, RECOMPUTE = 2 };

// One saved activation that the planner may release.
struct Candidate {
    std::string key;          // operator key, unique within one solve
    std::int64_t nbytes = 0;  // device bytes released when not kept
    double recompute_s = 0;   // seconds to recompute in backward (always exposed)
    double offload_s = 0;     // seconds of D2H copy (shares the forward copy window)
    double reload_s = 0;      // seconds of H2D copy (shares the backward copy window)
    bool can_offload = true;
    bool can_recompute = true;
};

// The planner's answer; choices[i] belongs to candidates[i].
struct Plan {
    std::vector<Choice> choices;
    bool feasible = true;
    std::int64_t freed_bytes = 0;      // exact bytes released by the plan
    std::int64_t shortfall_bytes = 0;  // max(0, must_free_bytes - bytes of all releasable ops)
    double exposed_s = 0;              // exact exposed time (invariant 1)
    double bound_s = 0;                // DP estimate, >= exposed_s (invariant 3)
    std::int64_t quantum_bytes = 1;    // q_b used
    double offload_quantum_s = 0;      // q_t of the forward window (0: handled exactly)
    double reload_quantum_s = 0;       // q_t of the backward window (0: handled exactly)
                                       // (a window < 1e-12 of its copies is treated as 0
                                       //  and reported as its own quantum)
};

class Planner {
public:
    // \param[in] quantum_bytes   byte quantum; 0 picks one (the gcd of the sizes when the
    //                            table allows it). Raised when the table would exceed max_cells.
    // \param[in] time_quantum_s  copy-time quantum for both windows; 0 picks one per window.
    // \param[in] max_cells       upper bound on DP states per op (memory and latency cap).
    explicit Planner(std::int64_t quantum_bytes = 0, double time_quantum_s = 0.0,
                     std::int64_t max_cells = 0);

    // \param[in] candidates        ops that may be released; keys must be unique.
    // \param[in] must_free_bytes   bytes the plan must release (<= 0: all KEEP).
    // \param[in] offload_window_s  forward compute time that hides D2H copies (>= 0, may be inf).
    // \param[in] reload_window_s   backward compute time that hides H2D copies (>= 0, may be inf).
    // \return the plan minimizing exposed time with freed_bytes >= must_free_bytes, or, when
    //         impossible, feasible == false, shortfall_bytes > 0 and every releasable op released.
    Plan solve(const std::vector<Candidate>& candidates, std::int64_t must_free_bytes,
               double offload_window_s, double reload_window_s);

    // Exact exposed time of any assignment (invariant 1).
    // \param[in] candidates, choices  one choice per candidate.
    // \param[in] offload_window_s, reload_window_s  the windows.
    static double exposed_time(const std::vector<Candidate>& candidates,
                               const std::vector<Choice>& choices, double offload_window_s,
                               double reload_window_s);

    std::int64_t quantum_bytes() const { return quantum_bytes_; }
    double time_quantum_s() const { return time_quantum_s_; }
    std::int64_t max_cells() const { return max_cells_; }

private:
    // Quantized view of one copy direction.
    struct Direction {
        bool windowed = false;  // false: exact (always hidden, or window 0 -> fully exposed)
        bool hidden = false;    // all copies fit in the window
        double quantum = 0;
        std::int64_t window_q = 0;  // state range in quanta (the larger threshold)
        // exposure of x quanta copied: quantum * (max(0, x - thr1) + slope2 * max(0, x - thr2));
        // slope2 > 0 when the other window is folded into this axis (reload = rho * offload)
        double thr1 = 0, thr2 = 0, slope2 = 0;
        double exposure(double x) const {
            return quantum * (std::max(0.0, x - thr1) + slope2 * std::max(0.0, x - thr2));
        }
    };

    Direction make_direction(const std::vector<double>& times, double window,
                             std::int64_t slots) const;
    Direction make_folded(double own_window, double other_window, double slope,
                          std::int64_t slots) const;
    void run_dp(const std::vector<Candidate>& cands, const std::vector<std::int64_t>& bytes_q,
                std::int64_t need_q, const Direction& fwd, const Direction& bwd,
                std::vector<Choice>& out, double& bound);

    // configuration
    std::int64_t quantum_bytes_;
    double time_quantum_s_;
    std::int64_t max_cells_;
    // reused DP storage
    std::vector<double> cur_, next_;
    std::vector<std::uint8_t> choice_;
    std::vector<std::int64_t> oq_, rq_;  // per-op quanta, saturated at the window
    std::vector<double> oqd_, rqd_;       // per-op quanta, exact count
    std::vector<double> off_cost_;        // offload cost per backward-window state
};

}  // namespace bagualu2
