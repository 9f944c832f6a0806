// OverlapScheduler: where to issue offload copies, reload prefetches and early recomputes on a
// stage's upcoming op sequence (forward of one micro-batch interleaved with backward of another).
//
// Model (fixed timeline; every quantity below is what Schedule::exposed_s predicts):
//  - Ops i = 0..N-1 run back to back: op i starts at T_i = sum of earlier durations and ends at
//    E_i = T_i + duration_i. A bubble op is idle compute (waiting on a pipeline neighbour).
//    "Issue after op s" happens at E_s; s = -1 means before op 0 (time 0).
//  - Offload j: issued right after its producer op on the one D2H channel, served in producer
//    order (delaying an offload never helps on its own FIFO channel). Its bytes stay resident
//    until the copy completes (counted during op i when not complete at T_i).
//  - Reload k: issued after some op s_k in [earliest_k, consumer_k - 1] on the one H2D channel,
//    served in issue order; issue order follows consumer order (the runtime prefetches in the
//    order tensors are needed). Resident during ops s_k+1 .. consumer_k. If it completes after
//    T_consumer the consumer stalls: stall = completion - T_consumer (max over its reloads).
//  - Recompute j: late (right before its consumer, fully exposed), or early at the start of a
//    bubble b with earliest_j < b < consumer_j, resident during ops b .. consumer_j. Early
//    recomputes form a prefix in consumer order; a bubble's overflow is exposed.
//  - Memory during op i: base_bytes_i + resident task bytes <= budget_bytes, for every op.
//  - exposed_s = sum of stalls + late recompute time + bubble overflow. Stalls do not shift the
//    timeline here, which makes exposed_s an upper bound of the real makespan increase (a stall
//    only gives later copies more time).
//
// Invariants (tests in tests/test_overlap_scheduler.py):
//  1. The schedule is optimal for this model (label-setting DP over ops with Pareto labels
//     (cost, H2D free time) per (reloads issued, early recomputes)), checked against brute force.
//  2. Issue points respect dependencies: offload after producer, reload and recompute before
//     consumer and not before `earliest`, reloads in consumer order.
//  3. Infeasible budget (even the lazy schedule exceeds it): feasible == false, lazy schedule.
//  4. Merging (optional) fuses runs of compute ops with no task boundary (bubbles are never
//     merged); issue points stay valid op
//     indices of the original sequence, memory is the max over the run (conservative).
//  5. Results are cached by (stage, load bucket, phase, budget bucket) when a key is given;
//     the key must cover everything the schedule depends on (the caller's contract).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sched/lru_cache.h"

namespace bagualu2 {

struct OverlapOp {
    double duration_s = 0;        // compute time (or idle time for a bubble)
    std::int64_t base_bytes = 0;  // device bytes in use during the op, task tensors excluded
    bool bubble = false;          // idle compute: early recomputes may fill it
};

enum class TaskKind : std::uint8_t { OFFLOAD = 0, RELOAD = 1, RECOMPUTE = 2 };

struct OverlapTask {
    TaskKind kind = TaskKind::RELOAD;
    std::int64_t op = 0;        // producer (OFFLOAD) or consumer (RELOAD, RECOMPUTE)
    std::int64_t earliest = -1; // reload/recompute: first op index it may be issued after
    double duration_s = 0;      // copy or recompute time
    std::int64_t nbytes = 0;    // device bytes it occupies while resident
};

struct Schedule {
    std::vector<std::int64_t> issue_after;  // per task: op index after which to issue (-1: start)
    std::vector<bool> early;                // per task: recompute run early in a bubble
    bool feasible = true;
    double exposed_s = 0;
    std::int64_t peak_bytes = 0;  // max over ops of base + resident task bytes
    std::int64_t merged_ops = 0;  // ops the DP ran on after merging
    bool cache_hit = false;
};

class OverlapScheduler {
public:
    // \param[in] cache_capacity  schedules kept by key (LRU).
    // \param[in] merge           fuse runs of ops without task boundaries before the DP.
    explicit OverlapScheduler(std::int64_t cache_capacity = 256, bool merge = true);

    // \param[in] ops           the stage's upcoming op sequence.
    // \param[in] tasks         offloads, reloads and recomputes on it.
    // \param[in] budget_bytes  device memory budget.
    // \param[in] key           optional cache key (budget state); a hit skips the DP.
    // \return issue points, predicted exposed time and peak bytes (see the model above).
    Schedule schedule(const std::vector<OverlapOp>& ops, const std::vector<OverlapTask>& tasks,
                      std::int64_t budget_bytes, const std::optional<CacheKey>& key = std::nullopt);

    // \param[in] key  cache key. \return the stored schedule (a hit) or nothing (a miss).
    std::optional<Schedule> cached(const CacheKey& key) {
        auto hit = cache_.get(key);
        if (hit) hit->cache_hit = true;
        return hit;
    }

    // \param[in] key, s  store a schedule under a key (schedule() does this itself).
    void store(const CacheKey& key, const Schedule& s) { cache_.put(key, s); }

    CacheStats cache_stats() const { return cache_.stats(); }
    void clear_cache() { cache_.clear(); }

private:
    Schedule solve(const std::vector<OverlapOp>& ops, const std::vector<OverlapTask>& tasks,
                   std::int64_t budget_bytes) const;

    // configuration
    bool merge_;
    // cached schedules
    LruCache<Schedule> cache_;
};

}  // namespace bagualu2
