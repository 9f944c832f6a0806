// Planner: multiple-choice knapsack DP with shared copy windows (see planner.h for invariants).
#include "sched/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "common/check.h"

namespace bagualu2 {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Default DP states per op: keeps n * cells around 2^18 state updates (well under 1 ms).
std::int64_t default_cells(std::size_t n) {
    const std::int64_t ops = std::max<std::int64_t>(1, static_cast<std::int64_t>(n));
    return std::clamp<std::int64_t>((std::int64_t{1} << 18) / ops, 1024, 16384);
}

// One DP cell: the cheapest of the three choices; ties prefer KEEP, then OFFLOAD.
inline void relax(double keep, double off, double rec, double& out, std::uint8_t& pick) {
    double best = keep;
    std::uint8_t p = static_cast<std::uint8_t>(Choice::KEEP);
    if (off < best) {
        best = off;
        p = static_cast<std::uint8_t>(Choice::OFFLOAD);
    }
    if (rec < best) {
        best = rec;
        p = static_cast<std::uint8_t>(Choice::RECOMPUTE);
    }
    out = best;
    pick = p;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Smallest integer k (as a double, exact below 2^53) with k * q >= t; t >= 0, q > 0.
double quanta_up(double t, double q) {
    double k = std::ceil(t / q);
    if (k * q < t) k += 1;
    return k;
}

// Largest integer k (as a double) with k * q <= w; w >= 0, q > 0.
double quanta_down(double w, double q) {
    double k = std::floor(w / q);
    if (k > 0 && k * q > w) k -= 1;
    return std::max(0.0, k);
}

void validate(const std::vector<Candidate>& cands, double wf, double wb) {
    BAGUALU2_CHECK(!std::isnan(wf) && wf >= 0, "offload_window_s must be >= 0, got ", wf);
    BAGUALU2_CHECK(!std::isnan(wb) && wb >= 0, "reload_window_s must be >= 0, got ", wb);
    std::unordered_set<std::string> seen;
    seen.reserve(cands.size() * 2);
    for (const auto& c : cands) {
        BAGUALU2_CHECK(c.nbytes >= 0, "candidate '", c.key, "': nbytes must be >= 0, got ",
                       c.nbytes);
        BAGUALU2_CHECK(std::isfinite(c.recompute_s) && c.recompute_s >= 0, "candidate '", c.key,
                       "': recompute_s must be finite and >= 0, got ", c.recompute_s);
        BAGUALU2_CHECK(std::isfinite(c.offload_s) && c.offload_s >= 0, "candidate '", c.key,
                       "': offload_s must be finite and >= 0, got ", c.offload_s);
        BAGUALU2_CHECK(std::isfinite(c.reload_s) && c.reload_s >= 0, "candidate '", c.key,
                       "': reload_s must be finite and >= 0, got ", c.reload_s);
        BAGUALU2_CHECK(seen.insert(c.key).second, "duplicate candidate key '", c.key, "'");
    }
}

// Local search on the exact objective: apply any change of one op's choice, or of two ops'
// choices together, that keeps freed >= target and lowers the exposed time; a few passes.
// The DP's rounding makes small copies look dearer than they are; this wins that back.
void polish(const std::vector<Candidate>& c, std::vector<Choice>& ch, std::int64_t target,
            double wf, double wb) {
    struct Sums {
        double rec = 0, off = 0, rel = 0;
        std::int64_t freed = 0;
    };
    auto add = [&](Sums& s, std::size_t i, Choice x, double sign) {
        if (x == Choice::KEEP) return;
        s.freed += sign > 0 ? c[i].nbytes : -c[i].nbytes;
        if (x == Choice::RECOMPUTE) s.rec += sign * c[i].recompute_s;
        if (x == Choice::OFFLOAD) {
            s.off += sign * c[i].offload_s;
            s.rel += sign * c[i].reload_s;
        }
    };
    auto cost = [&](const Sums& s) {
        return s.rec + std::max(0.0, s.off - wf) + std::max(0.0, s.rel - wb);
    };
    auto allowed = [&](std::size_t i, Choice x) {
        return x == Choice::KEEP || (x == Choice::OFFLOAD ? c[i].can_offload : c[i].can_recompute);
    };
    constexpr Choice kAll[3] = {Choice::KEEP, Choice::OFFLOAD, Choice::RECOMPUTE};
    Sums cur;
    for (std::size_t i = 0; i < c.size(); ++i) add(cur, i, ch[i], 1.0);
    double best = cost(cur);
    auto better = [&](const Sums& s) {
        const double v = cost(s);
        return s.freed >= target && v < best * (1 - 1e-12);
    };
    for (int pass = 0; pass < 4 && best > 0; ++pass) {
        bool improved = false;
        for (std::size_t i = 0; i < c.size(); ++i) {
            for (Choice xi : kAll) {
                if (xi == ch[i] || !allowed(i, xi)) continue;
                Sums s = cur;
                add(s, i, ch[i], -1.0);
                add(s, i, xi, 1.0);
                if (better(s)) {
                    cur = s, best = cost(s), ch[i] = xi, improved = true;
                    continue;
                }
                for (std::size_t j = i + 1; j < c.size(); ++j) {
                    for (Choice xj : kAll) {
                        if (xj == ch[j] || !allowed(j, xj) || ch[i] == xi) continue;
                        Sums t = s;
                        add(t, j, ch[j], -1.0);
                        add(t, j, xj, 1.0);
                        if (better(t)) {
                            cur = t, best = cost(t), ch[i] = xi, ch[j] = xj, improved = true;
                            break;
                        }
                    }
                    if (ch[i] == xi) break;
                }
            }
        }
        if (!improved) break;
    }
}

// Greedy seed on the exact objective: repeatedly release the (op, choice) with the least
// marginal exposed time per useful byte until the target is met.
std::vector<Choice> greedy(const std::vector<Candidate>& c, std::int64_t target, double wf,
                           double wb) {
    std::vector<Choice> ch(c.size(), Choice::KEEP);
    double rec = 0, off = 0, rel = 0;
    std::int64_t freed = 0;
    auto cost = [&](double r, double o, double b) {
        return r + std::max(0.0, o - wf) + std::max(0.0, b - wb);
    };
    while (freed < target) {
        double best = kInf;
        std::size_t bi = c.size();
        Choice bx = Choice::KEEP;
        const double now = cost(rec, off, rel);
        for (std::size_t i = 0; i < c.size(); ++i) {
            if (ch[i] != Choice::KEEP || c[i].nbytes == 0) continue;
            const double useful = static_cast<double>(std::min(c[i].nbytes, target - freed));
            if (c[i].can_offload) {
                const double d = cost(rec, off + c[i].offload_s, rel + c[i].reload_s) - now;
                if (d / useful < best) best = d / useful, bi = i, bx = Choice::OFFLOAD;
            }
            if (c[i].can_recompute) {
                const double d = c[i].recompute_s;
                if (d / useful < best) best = d / useful, bi = i, bx = Choice::RECOMPUTE;
            }
        }
        if (bi == c.size()) break;
        ch[bi] = bx;
        freed += c[bi].nbytes;
        if (bx == Choice::RECOMPUTE) rec += c[bi].recompute_s;
        if (bx == Choice::OFFLOAD) off += c[bi].offload_s, rel += c[bi].reload_s;
    }
    return ch;
}

}  // namespace

Planner::Planner(std::int64_t quantum_bytes, double time_quantum_s, std::int64_t max_cells)
    : quantum_bytes_(quantum_bytes), time_quantum_s_(time_quantum_s), max_cells_(max_cells) {
    BAGUALU2_CHECK(quantum_bytes >= 0, "quantum_bytes must be >= 0 (0 = automatic), got ",
                   quantum_bytes);
    BAGUALU2_CHECK(std::isfinite(time_quantum_s) && time_quantum_s >= 0,
                   "time_quantum_s must be finite and >= 0 (0 = automatic), got ", time_quantum_s);
    BAGUALU2_CHECK(max_cells == 0 || max_cells >= 16,
                   "max_cells must be 0 (automatic) or >= 16, got ", max_cells);
}

double Planner::exposed_time(const std::vector<Candidate>& candidates,
                             const std::vector<Choice>& choices, double offload_window_s,
                             double reload_window_s) {
    BAGUALU2_CHECK(candidates.size() == choices.size(), "got ", choices.size(),
                   " choices for ", candidates.size(), " candidates");
    double rec = 0, off = 0, rel = 0;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
        if (choices[i] == Choice::RECOMPUTE) rec += candidates[i].recompute_s;
        if (choices[i] == Choice::OFFLOAD) {
            off += candidates[i].offload_s;
            rel += candidates[i].reload_s;
        }
    }
    return rec + std::max(0.0, off - offload_window_s) + std::max(0.0, rel - reload_window_s);
}

Planner::Direction Planner::make_direction(const std::vector<double>& times, double window,
                                           std::int64_t slots) const {
    Direction dir;
    const double total = std::accumulate(times.begin(), times.end(), 0.0);
    if (total <= window) {  // also covers window == inf
        dir.hidden = true;
        return dir;
    }
    const double max_slots = static_cast<double>(slots);
    // Zero or negligible window: every copy exposed, exactly (overestimates by at most the
    // window itself). A window whose quantum would be subnormal is negligible too: quanta of
    // it would not be finite.
    if (window <= total * 1e-12 || window / max_slots < std::numeric_limits<double>::min()) {
        dir.quantum = window;
        return dir;
    }
    dir.windowed = true;
    dir.quantum = time_quantum_s_ > 0 ? time_quantum_s_ : window / max_slots;
    double wq = quanta_down(window, dir.quantum);
    if (wq > max_slots) {  // requested quantum too fine for the state budget
        dir.quantum = window / max_slots;
        wq = quanta_down(window, dir.quantum);
    }
    dir.window_q = static_cast<std::int64_t>(wq);
    dir.thr1 = wq;
    return dir;
}

Planner::Direction Planner::make_folded(double own_window, double other_window, double slope,
                                        std::int64_t slots) const {
    Direction dir;
    dir.windowed = true;
    dir.slope2 = slope;
    const double max_slots = static_cast<double>(slots);
    const double wmax = std::max(own_window, other_window);  // both in this axis's seconds
    dir.quantum = wmax / max_slots;
    dir.thr1 = quanta_down(own_window, dir.quantum);
    dir.thr2 = quanta_down(other_window, dir.quantum);
    dir.window_q = static_cast<std::int64_t>(std::max(dir.thr1, dir.thr2));
    return dir;
}

void Planner::run_dp(const std::vector<Candidate>& cands,
                     const std::vector<std::int64_t>& bytes_q, std::int64_t need_q,
                     const Direction& fwd, const Direction& bwd, std::vector<Choice>& out,
                     double& bound) {
    // 1. active ops: releasable and able to reduce the (quantized) need
    std::vector<std::size_t> active;
    for (std::size_t i = 0; i < cands.size(); ++i) {
        if (bytes_q[i] > 0 && (cands[i].can_offload || cands[i].can_recompute)) active.push_back(i);
    }
    const std::size_t n = active.size();
    const std::int64_t nd = need_q + 1;
    const std::int64_t nf = fwd.windowed ? fwd.window_q + 1 : 1;
    const std::int64_t nb = bwd.windowed ? bwd.window_q + 1 : 1;
    const std::int64_t cells = nd * nf * nb;

    // 2. per-op quantized copy times (rounded up) and exact costs of non-windowed directions
    oq_.assign(n, 0);
    rq_.assign(n, 0);
    oqd_.assign(n, 0.0);
    rqd_.assign(n, 0.0);
    for (std::size_t k = 0; k < n; ++k) {
        const Candidate& c = cands[active[k]];
        // exposure uses the exact quanta count; the state move saturates past the window
        if (fwd.windowed) {
            oqd_[k] = quanta_up(c.offload_s, fwd.quantum);
            oq_[k] = static_cast<std::int64_t>(std::min(oqd_[k], static_cast<double>(nf)));
        }
        if (bwd.windowed) {
            rqd_[k] = quanta_up(c.reload_s, bwd.quantum);
            rq_[k] = static_cast<std::int64_t>(std::min(rqd_[k], static_cast<double>(nb)));
        }
    }

    // 3. terminal table: need met -> 0, else infeasible
    const auto ucells = static_cast<std::size_t>(cells);
    next_.assign(ucells, kInf);
    std::fill(next_.begin(), next_.begin() + nf * nb, 0.0);
    cur_.resize(ucells);
    choice_.assign(n * ucells, static_cast<std::uint8_t>(Choice::KEEP));

    // 4. backward over ops: H_k(d, f, b) = min over choices of cost + H_{k+1}(successor)
    off_cost_.resize(static_cast<std::size_t>(nb));
    for (std::size_t k = n; k-- > 0;) {
        const Candidate& c = cands[active[k]];
        const std::int64_t bq = bytes_q[active[k]];
        const double rec_cost = c.can_recompute ? c.recompute_s : kInf;
        // offload cost without the forward window part, per backward-window state
        const double off_fixed = (fwd.windowed || fwd.hidden ? 0.0 : c.offload_s) +
                                 (bwd.windowed || bwd.hidden ? 0.0 : c.reload_s);
        for (std::int64_t b = 0; b < nb; ++b) {
            const double used = static_cast<double>(bwd.window_q - b);
            const double eb = bwd.windowed
                ? bwd.exposure(used + rqd_[k]) - bwd.exposure(used) : 0.0;
            off_cost_[static_cast<std::size_t>(b)] = c.can_offload ? off_fixed + eb : kInf;
        }
        const std::int64_t rq = std::min(rq_[k], nb);
        std::uint8_t* ch = choice_.data() + k * ucells;
        std::copy(next_.begin(), next_.begin() + nf * nb, cur_.begin());  // d = 0: keep, cost 0
        for (std::int64_t d = 1; d < nd; ++d) {
            const std::int64_t dr = std::max<std::int64_t>(0, d - bq);
            for (std::int64_t f = 0; f < nf; ++f) {
                const std::int64_t f2 = std::max<std::int64_t>(0, f - oq_[k]);
                const double used = static_cast<double>(fwd.window_q - f);
                const double ef = fwd.windowed
                    ? fwd.exposure(used + oqd_[k]) - fwd.exposure(used) : 0.0;
                const double* keep_row = next_.data() + (d * nf + f) * nb;
                const double* rec_row = next_.data() + (dr * nf + f) * nb;
                const double* off_row = next_.data() + (dr * nf + f2) * nb;
                double* out_row = cur_.data() + (d * nf + f) * nb;
                std::uint8_t* ch_row = ch + (d * nf + f) * nb;
                const double* oc = off_cost_.data();
                // backward window exhausted by this reload: successor state b' = 0
                for (std::int64_t b = 0; b < rq; ++b) {
                    relax(keep_row[b], oc[b] + ef + off_row[0], rec_cost + rec_row[b],
                          out_row[b], ch_row[b]);
                }
                // window left after the reload: successor state b' = b - rq (contiguous)
                for (std::int64_t b = rq; b < nb; ++b) {
                    relax(keep_row[b], oc[b] + ef + off_row[b - rq], rec_cost + rec_row[b],
                          out_row[b], ch_row[b]);
                }
            }
        }
        std::swap(cur_, next_);
    }

    // 5. read the plan forward from the start state (all needed, both windows free)
    std::int64_t d = need_q, f = nf - 1, b = nb - 1;
    bound = next_[static_cast<std::size_t>((d * nf + f) * nb + b)];
    out.assign(cands.size(), Choice::KEEP);
    if (!std::isfinite(bound)) return;
    for (std::size_t k = 0; k < n; ++k) {
        const auto pick = static_cast<Choice>(
            choice_[k * ucells + static_cast<std::size_t>((d * nf + f) * nb + b)]);
        out[active[k]] = pick;
        if (pick == Choice::KEEP) continue;
        d = std::max<std::int64_t>(0, d - bytes_q[active[k]]);
        if (pick == Choice::OFFLOAD) {
            f = std::max<std::int64_t>(0, f - oq_[k]);
            b = std::max<std::int64_t>(0, b - rq_[k]);
        }
    }
}

Plan Planner::solve(const std::vector<Candidate>& candidates, std::int64_t must_free_bytes,
                    double offload_window_s, double reload_window_s) {
    // 1. validate; nothing to free -> all KEEP
    validate(candidates, offload_window_s, reload_window_s);
    Plan plan;
    plan.choices.assign(candidates.size(), Choice::KEEP);
    if (must_free_bytes <= 0) return plan;

    // 2. exact feasibility: can releasing everything releasable reach the target?
    std::int64_t releasable = 0, g = 0;
    std::vector<double> off_times, rel_times;
    for (const auto& c : candidates) {
        if (!(c.can_offload || c.can_recompute) || c.nbytes == 0) continue;
        releasable += c.nbytes;
        g = std::gcd(g, c.nbytes);
        if (c.can_offload) {
            off_times.push_back(c.offload_s);
            rel_times.push_back(c.reload_s);
        }
    }
    plan.shortfall_bytes = std::max<std::int64_t>(0, must_free_bytes - releasable);
    plan.feasible = plan.shortfall_bytes == 0;

    // 3. state budget: bytes axis first (exact when the sizes allow), the rest to the windows
    const std::int64_t cells = max_cells_ > 0 ? max_cells_ : default_cells(candidates.size());
    BAGUALU2_CHECK(cells <= (std::int64_t{1} << 24), "max_cells must be <= 2^24, got ", cells);
    // A window needs an axis unless its copies fit in it, or it is negligible: at most 1e-12 of
    // them, or so small that a quantum of it (at most `cells` slots) would be subnormal.
    auto windows_needed = [&](double w, const std::vector<double>& t) {
        const double total = std::accumulate(t.begin(), t.end(), 0.0);
        return (total > w && w > total * 1e-12 &&
                w / static_cast<double>(cells) >= std::numeric_limits<double>::min()) ? 1 : 0;
    };
    int nt = windows_needed(offload_window_s, off_times) +
             windows_needed(reload_window_s, rel_times);
    // proportional copy times: fold the reload window into the offload axis (see planner.h)
    double rho_lo = kInf, rho_hi = 0;
    for (const auto& c : candidates) {
        if (!c.can_offload || c.nbytes == 0) continue;
        const double r = c.offload_s > 0 ? c.reload_s / c.offload_s : kInf;
        rho_lo = std::min(rho_lo, r);
        rho_hi = std::max(rho_hi, r);
    }
    const bool fold = nt == 2 && time_quantum_s_ <= 0 && std::isfinite(rho_hi) && rho_lo > 0 &&
                      rho_hi <= rho_lo * (1 + 1e-12);  // offload O <= R / rho_lo exactly
    // The copy-time axes of a DP with `slots` time states: one per direction, or both folded
    // onto the reload axis when reload times are proportional to offload times.
    const auto copy_axes = [&](std::int64_t slots) {
        Direction fwd = make_direction(off_times, offload_window_s, slots);
        Direction bwd = make_direction(rel_times, reload_window_s, slots);
        if (fold) {  // one axis in reload seconds (innermost, fastest); offload O <= R / rho_lo
            bwd = make_folded(reload_window_s, rho_lo * offload_window_s, 1.0 / rho_lo, slots);
            fwd = Direction{};
            fwd.hidden = true;  // folded into bwd; its quantum is reported in offload seconds
            fwd.quantum = bwd.quantum / rho_lo;
        }
        return std::make_pair(fwd, bwd);
    };
    if (fold) nt = 1;
    auto slots_for = [&](std::int64_t nd) {
        if (nt == 0) return std::int64_t{1};
        const double per = std::pow(static_cast<double>(cells) / static_cast<double>(nd),
                                    1.0 / nt);
        return std::max<std::int64_t>(1, static_cast<std::int64_t>(per) - 1);
    };

    std::vector<std::int64_t> bytes_q(candidates.size(), 0);
    std::int64_t need_q = 0;
    double bound = kInf;
    if (plan.feasible) {
        std::int64_t qb = quantum_bytes_ > 0 ? quantum_bytes_ : std::max<std::int64_t>(1, g);
        // time axes: what a requested quantum needs, else at least 16 slots per window
        std::int64_t time_cells = fold ? 17 : 1;
        for (const auto& [w, t] : {std::pair{offload_window_s, &off_times},
                                  std::pair{reload_window_s, &rel_times}}) {
            if (fold || !windows_needed(w, *t)) continue;
            time_cells *= time_quantum_s_ > 0
                ? static_cast<std::int64_t>(std::min(quanta_down(w, time_quantum_s_) + 1, 4096.0))
                : 17;
        }
        const std::int64_t nd_cap = std::max<std::int64_t>(64, cells / time_cells);
        const std::int64_t need_exact = ceil_div(must_free_bytes, qb);
        if (need_exact + 1 > nd_cap) qb *= ceil_div(need_exact, nd_cap - 1);
        need_q = ceil_div(must_free_bytes, qb);
        for (std::size_t i = 0; i < candidates.size(); ++i) bytes_q[i] = candidates[i].nbytes / qb;
        auto [fwd, bwd] = copy_axes(slots_for(need_q + 1));
        run_dp(candidates, bytes_q, need_q, fwd, bwd, plan.choices, bound);
        plan.quantum_bytes = qb;
        plan.offload_quantum_s = fwd.quantum;
        plan.reload_quantum_s = bwd.quantum;
    }

    // 4. infeasible (exactly, or only after rounding): release every releasable op, cheapest mix
    if (!std::isfinite(bound)) {
        need_q = 0;
        for (std::size_t i = 0; i < candidates.size(); ++i) {
            const Candidate& c = candidates[i];
            bytes_q[i] = ((c.can_offload || c.can_recompute) && c.nbytes > 0) ? 1 : 0;
            need_q += bytes_q[i];
        }
        auto [fwd, bwd] = copy_axes(slots_for(need_q + 1));
        run_dp(candidates, bytes_q, need_q, fwd, bwd, plan.choices, bound);
        plan.offload_quantum_s = fwd.quantum;
        plan.reload_quantum_s = bwd.quantum;
    }

    // 5. polish with exact 1- and 2-op moves (only ever lowers the exact exposed time); a
    //    greedy seed polished the same way replaces the DP's plan when it ends up better
    const std::int64_t target = std::min(must_free_bytes, releasable);
    polish(candidates, plan.choices, target, offload_window_s, reload_window_s);
    std::vector<Choice> seed = greedy(candidates, target, offload_window_s, reload_window_s);
    polish(candidates, seed, target, offload_window_s, reload_window_s);
    if (exposed_time(candidates, seed, offload_window_s, reload_window_s) <
        exposed_time(candidates, plan.choices, offload_window_s, reload_window_s)) {
        plan.choices = std::move(seed);
    }

    // 6. exact accounting of the chosen plan
    for (std::size_t i = 0; i < candidates.size(); ++i) {
        if (plan.choices[i] != Choice::KEEP) plan.freed_bytes += candidates[i].nbytes;
    }
    plan.exposed_s = exposed_time(candidates, plan.choices, offload_window_s, reload_window_s);
    plan.bound_s = bound;
    return plan;
}

}  // namespace bagualu2
