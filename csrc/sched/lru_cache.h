// LruCache: bounded LRU map from a decision context to a stored value (the overlap
// scheduler's schedule cache, csrc/sched/overlap_scheduler.h).
//
// Design note (invariants; keys, hits and stats are tested through the overlap scheduler in
// tests/test_overlap_scheduler.py):
//  1. Key = (stage, load bucket, pipeline phase, budget bucket), all integers chosen by the
//     caller, who must make the key cover everything the stored value depends on.
//  2. Bounded: never more than `capacity` entries; put() on a full cache evicts the least
//     recently used entry (get() hits and put() both count as use).
//  3. Thread-safe: one mutex, held only for the map operation itself; values are copied out
//     under the lock, never referenced after it is released.
//  4. Stats: hits, misses, evictions, and the mean latency of get() measured inside the call
//     (lock included). reset_stats() zeroes them without touching the entries.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include "common/check.h"

namespace bagualu2 {

struct CacheKey {
    std::int64_t stage = 0;
    std::int64_t load_bucket = 0;
    std::int64_t phase = 0;
    std::int64_t budget_bucket = 0;

    bool operator==(const CacheKey& o) const {
        return stage == o.stage && load_bucket == o.load_bucket && phase == o.phase &&
               budget_bucket == o.budget_bucket;
    }
};

struct CacheKeyHash {
    std::size_t operator()(const CacheKey& k) const noexcept {
        std::uint64_t h = 1469598103934665603ULL;  // FNV-1a over the four fields
        for (std::int64_t v : {k.stage, k.load_bucket, k.phase, k.budget_bucket}) {
            h ^= static_cast<std::uint64_t>(v);
            h *= 1099511628211ULL;
            h ^= h >> 29;
        }
        return static_cast<std::size_t>(h);
    }
};

struct CacheStats {
    std::int64_t hits = 0;
    std::int64_t misses = 0;
    std::int64_t evictions = 0;
    std::int64_t size = 0;
    std::int64_t capacity = 0;
    double hit_rate = 0;          // hits / (hits + misses), 0 before any lookup
    double mean_lookup_us = 0;    // mean get() latency in microseconds
};

template <typename Value>
class LruCache {
public:
    // \param[in] capacity  maximum number of stored values (>= 1).
    explicit LruCache(std::int64_t capacity) : capacity_(capacity) {
        BAGUALU2_CHECK(capacity >= 1, "LruCache capacity must be >= 1, got ", capacity);
        map_.reserve(static_cast<std::size_t>(capacity));
    }

    // \param[in] key  decision context.
    // \return a copy of the stored value, or nothing (a miss).
    std::optional<Value> get(const CacheKey& key) {
        const auto t0 = std::chrono::steady_clock::now();
        std::optional<Value> out;
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = map_.find(key);
            if (it != map_.end()) {
                lru_.splice(lru_.begin(), lru_, it->second);  // most recently used first
                out = it->second->second;
                ++hits_;
            } else {
                ++misses_;
            }
            lookup_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
        }
        return out;
    }

    // \param[in] key    decision context.
    // \param[in] value  value to store (replaces an existing entry of the same key).
    void put(const CacheKey& key, Value value) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(key);
        if (it != map_.end()) {
            it->second->second = std::move(value);
            lru_.splice(lru_.begin(), lru_, it->second);
            return;
        }
        if (static_cast<std::int64_t>(map_.size()) >= capacity_) {
            map_.erase(lru_.back().first);
            lru_.pop_back();
            ++evictions_;
        }
        lru_.emplace_front(key, std::move(value));
        map_.emplace(key, lru_.begin());
    }

    // \param[in] key  decision context. \return whether a value is stored (no stats change).
    bool contains(const CacheKey& key) const {
        std::lock_guard<std::mutex> lock(mu_);
        return map_.count(key) != 0;
    }

    void clear() {
        std::lock_guard<std::mutex> lock(mu_);
        map_.clear();
        lru_.clear();
    }

    CacheStats stats() const {
        std::lock_guard<std::mutex> lock(mu_);
        CacheStats s;
        s.hits = hits_;
        s.misses = misses_;
        s.evictions = evictions_;
        s.size = static_cast<std::int64_t>(map_.size());
        s.capacity = capacity_;
        const std::int64_t lookups = hits_ + misses_;
        s.hit_rate = lookups ? static_cast<double>(hits_) / static_cast<double>(lookups) : 0.0;
        s.mean_lookup_us =
            lookups ? static_cast<double>(lookup_ns_) / 1e3 / static_cast<double>(lookups) : 0.0;
        return s;
    }

    void reset_stats() {
        std::lock_guard<std::mutex> lock(mu_);
        hits_ = misses_ = evictions_ = lookup_ns_ = 0;
    }

    std::int64_t capacity() const { return capacity_; }

    std::int64_t size() const {
        std::lock_guard<std::mutex> lock(mu_);
        return static_cast<std::int64_t>(map_.size());
    }

private:
    using Entry = std::pair<CacheKey, Value>;

    // configuration
    std::int64_t capacity_;
    // entries: LRU list (front = most recent) and an index into it
    mutable std::mutex mu_;
    std::list<Entry> lru_;
    std::unordered_map<CacheKey, typename std::list<Entry>::iterator, CacheKeyHash> map_;
    // stats
    std::int64_t hits_ = 0;
    std::int64_t misses_ = 0;
    std::int64_t evictions_ = 0;
    std::int64_t lookup_ns_ = 0;
};

}  // namespace bagualu2
