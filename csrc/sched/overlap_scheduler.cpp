// OverlapScheduler: label-setting DP over a stage's op sequence (model in overlap_scheduler.h).
#include "sched/overlap_scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/check.h"

namespace bagualu2 {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

inline std::size_t U(std::int64_t x) { return static_cast<std::size_t>(x); }

// One DP label: state after op i's decisions, with the path's cost and H2D free time.
struct Label {
    double cost;
    double h2d_free;
    std::int32_t reloads;   // reloads issued (prefix in consumer order)
    std::int32_t early;     // early recomputes done (prefix in consumer order)
    std::int32_t parent;    // label index in the previous stage (-1: start)
};

void validate(const std::vector<OverlapOp>& ops, const std::vector<OverlapTask>& tasks,
              std::int64_t budget) {
    const auto n = static_cast<std::int64_t>(ops.size());
    BAGUALU2_CHECK(budget >= 0, "budget_bytes must be >= 0, got ", budget);
    for (std::int64_t i = 0; i < n; ++i) {
        const auto& op = ops[U(i)];
        BAGUALU2_CHECK(std::isfinite(op.duration_s) && op.duration_s >= 0, "op ", i,
                       ": duration_s must be finite and >= 0, got ", op.duration_s);
        BAGUALU2_CHECK(op.base_bytes >= 0, "op ", i, ": base_bytes must be >= 0, got ",
                       op.base_bytes);
    }
    for (std::size_t j = 0; j < tasks.size(); ++j) {
        const auto& t = tasks[j];
        BAGUALU2_CHECK(std::isfinite(t.duration_s) && t.duration_s >= 0, "task ", j,
                       ": duration_s must be finite and >= 0, got ", t.duration_s);
        BAGUALU2_CHECK(t.nbytes >= 0, "task ", j, ": nbytes must be >= 0, got ", t.nbytes);
        BAGUALU2_CHECK(t.op >= 0 && t.op < n, "task ", j, ": op ", t.op, " out of range [0, ", n,
                       ")");
        if (t.kind != TaskKind::OFFLOAD) {
            BAGUALU2_CHECK(t.earliest >= -1 && t.earliest < t.op, "task ", j, ": earliest ",
                           t.earliest, " must be in [-1, consumer ", t.op, ")");
        }
    }
}

}  // namespace

OverlapScheduler::OverlapScheduler(std::int64_t cache_capacity, bool merge)
    : merge_(merge), cache_(cache_capacity) {}

Schedule OverlapScheduler::schedule(const std::vector<OverlapOp>& ops,
                                    const std::vector<OverlapTask>& tasks,
                                    std::int64_t budget_bytes, const std::optional<CacheKey>& key) {
    if (key) {
        if (auto hit = cached(*key)) return *hit;
    }
    Schedule s = solve(ops, tasks, budget_bytes);
    if (key) cache_.put(*key, s);
    return s;
}

Schedule OverlapScheduler::solve(const std::vector<OverlapOp>& ops,
                                 const std::vector<OverlapTask>& tasks,
                                 std::int64_t budget) const {
    // 1. validate
    validate(ops, tasks, budget);
    const std::size_t n_orig = ops.size();
    Schedule out;
    out.issue_after.assign(tasks.size(), -1);
    out.early.assign(tasks.size(), false);

    // 2. merge runs of ops that no task boundary separates (a group starts at every consumer,
    //    after every producer and earliest point, and at every bubble)
    std::vector<bool> starts(n_orig, !merge_);
    if (n_orig) starts[0] = true;
    for (std::size_t i = 1; i < n_orig; ++i) {
        if (ops[i].bubble || ops[i - 1].bubble) starts[i] = true;  // bubbles stay separate
    }
    auto mark_after = [&](std::int64_t op) {
        if (op >= 0 && U(op) + 1 < n_orig) starts[U(op) + 1] = true;
    };
    for (const auto& t : tasks) {
        if (t.kind == TaskKind::OFFLOAD) {
            mark_after(t.op);
        } else {
            starts[U(t.op)] = true;
            mark_after(t.earliest);
        }
    }
    std::vector<std::int64_t> group_of(n_orig), last_of;
    std::vector<OverlapOp> m;  // merged ops
    for (std::size_t i = 0; i < n_orig; ++i) {
        if (starts[i]) {
            m.push_back(ops[i]);
            last_of.push_back(static_cast<std::int64_t>(i));
        } else {
            m.back().duration_s += ops[i].duration_s;
            m.back().base_bytes = std::max(m.back().base_bytes, ops[i].base_bytes);
            last_of.back() = static_cast<std::int64_t>(i);
        }
        group_of[i] = static_cast<std::int64_t>(m.size()) - 1;
    }
    const auto n = static_cast<std::int64_t>(m.size());
    out.merged_ops = n;
    auto orig_after = [&](std::int64_t g) { return g < 0 ? std::int64_t{-1} : last_of[U(g)]; };
    auto grp = [&](std::int64_t op) { return op < 0 ? std::int64_t{-1} : group_of[U(op)]; };

    // 3. fixed timeline: start T_i and end E_i of every merged op
    std::vector<double> T(U(n) + 1, 0.0);
    for (std::int64_t i = 0; i < n; ++i) T[U(i) + 1] = T[U(i)] + m[U(i)].duration_s;
    auto end_of = [&](std::int64_t g) { return g < 0 ? 0.0 : T[U(g) + 1]; };

    // 4. offloads: issued after their producer, FIFO on D2H; resident until complete
    std::vector<std::size_t> offs, rels, recs;
    for (std::size_t j = 0; j < tasks.size(); ++j) {
        auto& bin = tasks[j].kind == TaskKind::OFFLOAD  ? offs
                    : tasks[j].kind == TaskKind::RELOAD ? rels
                                                        : recs;
        bin.push_back(j);
    }
    auto by_op = [&](std::size_t a, std::size_t b) {
        return tasks[a].op != tasks[b].op ? tasks[a].op < tasks[b].op : a < b;
    };
    std::sort(offs.begin(), offs.end(), by_op);
    std::sort(rels.begin(), rels.end(), by_op);
    std::sort(recs.begin(), recs.end(), by_op);
    std::vector<std::int64_t> off_bytes(U(n), 0);
    double d2h_free = 0;
    for (std::size_t j : offs) {
        const std::int64_t g = grp(tasks[j].op);
        d2h_free = std::max(d2h_free, end_of(g)) + tasks[j].duration_s;
        out.issue_after[j] = tasks[j].op;
        for (std::int64_t i = g + 1; i < n && d2h_free > T[U(i)]; ++i) {
            off_bytes[U(i)] += tasks[j].nbytes;
        }
    }

    // 5. reloads and recomputes in consumer order: prefix sums and per-op windows
    const auto K = static_cast<std::int32_t>(rels.size());
    const auto J = static_cast<std::int32_t>(recs.size());
    auto prefix = [&](const std::vector<std::size_t>& v) {
        std::vector<std::int64_t> p(v.size() + 1, 0);
        for (std::size_t k = 0; k < v.size(); ++k) p[k + 1] = p[k] + tasks[v[k]].nbytes;
        return p;
    };
    const auto rel_pre = prefix(rels), rec_pre = prefix(recs);
    auto q_of = [&](const std::vector<std::size_t>& v, std::int32_t k) {
        return grp(tasks[v[U(k)]].op);
    };
    auto e_of = [&](const std::vector<std::size_t>& v, std::int32_t k) {
        return grp(tasks[v[U(k)]].earliest);
    };
    auto first_with_q_at_least = [&](const std::vector<std::size_t>& v, std::int64_t i) {
        std::int32_t k = 0;
        while (k < static_cast<std::int32_t>(v.size()) && q_of(v, k) < i) ++k;
        return k;
    };
    double late_total = 0;
    std::vector<double> late_suffix(U(J) + 1, 0.0);  // late cost of j >= e
    for (std::int32_t j = J; j-- > 0;) {
        late_suffix[U(j)] = late_suffix[U(j) + 1] + tasks[recs[U(j)]].duration_s;
    }
    late_total = late_suffix[0];

    // 6. DP over ops: at boundary i-1 issue more reloads, in bubble i run more recomputes
    std::vector<std::vector<Label>> stages(U(n));
    std::vector<Label> prev{Label{0.0, 0.0, 0, 0, -1}};
    for (std::int64_t i = 0; i < n; ++i) {
        const auto& op = m[U(i)];
        const std::int32_t need = first_with_q_at_least(rels, i + 1);  // consumers <= i issued
        // resident during op i: reloads/recomputes with consumer >= i that started by op i
        // (a late recompute starts right before its consumer, so it counts there too)
        const std::int32_t lo_r = first_with_q_at_least(rels, i);
        const std::int32_t lo_c = first_with_q_at_least(recs, i);
        const std::int32_t hi_c = first_with_q_at_least(recs, i + 1);
        std::vector<Label> cand;
        for (std::size_t li = 0; li < prev.size(); ++li) {
            const Label& L = prev[li];
            // 6a. issue reloads [L.reloads, r) at E_{i-1}; a consumer stalls on its last reload
            double F = L.h2d_free, cost = L.cost;
            for (std::int32_t r = L.reloads; r <= K; ++r) {
                if (r > L.reloads) {
                    const std::int32_t k = r - 1;
                    if (e_of(rels, k) > i - 1) break;  // may not be issued yet
                    F = std::max(F, end_of(i - 1)) + tasks[rels[U(k)]].duration_s;
                    const bool last = k + 1 == K || q_of(rels, k + 1) != q_of(rels, k);
                    if (last) cost += std::max(0.0, F - T[U(q_of(rels, k))]);
                }
                if (r < need) continue;
                // 6b. early recomputes [L.early, e) at the start of bubble i
                double work = 0;
                for (std::int32_t e = L.early; e <= J; ++e) {
                    if (e > L.early) {
                        const std::int32_t j = e - 1;
                        if (!op.bubble || e_of(recs, j) > i - 1 || q_of(recs, j) <= i) break;
                        work += tasks[recs[U(j)]].duration_s;
                    }
                    // 6c. memory during op i: base + offloads in flight + resident tasks
                    const std::int64_t mem = op.base_bytes + off_bytes[U(i)] +
                                             rel_pre[U(r)] - rel_pre[U(lo_r)] +
                                             rec_pre[U(std::max(e, hi_c))] - rec_pre[U(lo_c)];
                    if (mem > budget) continue;
                    cand.push_back(Label{cost + std::max(0.0, work - op.duration_s), F, r, e,
                                         static_cast<std::int32_t>(li)});
                }
            }
        }
        // 6d. Pareto prune per (reloads, early): keep labels not beaten in both cost and F
        std::sort(cand.begin(), cand.end(), [](const Label& a, const Label& b) {
            if (a.reloads != b.reloads) return a.reloads < b.reloads;
            if (a.early != b.early) return a.early < b.early;
            if (a.cost != b.cost) return a.cost < b.cost;
            return a.h2d_free < b.h2d_free;
        });
        std::vector<Label> kept;
        for (const Label& c : cand) {
            if (!kept.empty() && kept.back().reloads == c.reloads && kept.back().early == c.early) {
                bool dominated = false;
                for (auto it = kept.rbegin(); it != kept.rend() && it->reloads == c.reloads &&
                                              it->early == c.early;
                     ++it) {
                    if (it->h2d_free <= c.h2d_free) { dominated = true; break; }
                }
                if (dominated) continue;
            }
            kept.push_back(c);
        }
        stages[U(i)] = kept;
        prev = std::move(kept);
    }

    // 7. best final label (late recomputes cost their full time), then read decisions back
    std::int32_t best = -1;
    double best_cost = kInf;
    for (std::size_t li = 0; li < prev.size(); ++li) {
        const double c = prev[li].cost + late_suffix[U(prev[li].early)];
        if (prev[li].reloads == K && c < best_cost) {
            best_cost = c;
            best = static_cast<std::int32_t>(li);
        }
    }
    for (std::size_t j : recs) out.issue_after[j] = tasks[j].op - 1;  // late: right before consumer
    auto resident = [&](std::int64_t i, std::int32_t r, std::int32_t e) {
        const std::int32_t lo_r = first_with_q_at_least(rels, i);
        const std::int32_t lo_c = first_with_q_at_least(recs, i);
        const std::int32_t hi_c = first_with_q_at_least(recs, i + 1);
        return m[U(i)].base_bytes + off_bytes[U(i)] + rel_pre[U(r)] - rel_pre[U(lo_r)] +
               rec_pre[U(std::max(e, hi_c))] - rec_pre[U(lo_c)];
    };
    if (best < 0) {  // 8. infeasible: lazy schedule (reload right before its consumer)
        out.feasible = false;
        double F = 0, stall = 0;
        for (std::int32_t k = 0; k < K; ++k) {
            const std::size_t t = rels[U(k)];
            out.issue_after[t] = tasks[t].op - 1;
            F = std::max(F, end_of(q_of(rels, k) - 1)) + tasks[t].duration_s;
            const bool last = k + 1 == K || q_of(rels, k + 1) != q_of(rels, k);
            if (last) stall += std::max(0.0, F - T[U(q_of(rels, k))]);
        }
        out.exposed_s = stall + late_total;
        for (std::int64_t i = 0; i < n; ++i) {
            const std::int32_t issued = first_with_q_at_least(rels, i + 1);
            out.peak_bytes = std::max(out.peak_bytes, resident(i, issued, 0));
        }
        return out;
    }
    out.exposed_s = best_cost;
    std::int32_t li = best;
    for (std::int64_t i = n - 1; i >= 0; --i) {
        const Label& L = stages[U(i)][U(li)];
        const Label P = i > 0 ? stages[U(i) - 1][U(L.parent)]
                              : Label{0.0, 0.0, 0, 0, -1};
        for (std::int32_t k = P.reloads; k < L.reloads; ++k) {
            out.issue_after[rels[U(k)]] = orig_after(i - 1);
        }
        for (std::int32_t j = P.early; j < L.early; ++j) {
            out.issue_after[recs[U(j)]] = orig_after(i - 1);
            out.early[recs[U(j)]] = true;
        }
        out.peak_bytes = std::max(out.peak_bytes, resident(i, L.reloads, L.early));
        li = L.parent;
    }
    return out;
}

template class LruCache<Schedule>;

}  // namespace bagualu2
