// HostArena implementation; the invariants are listed in host_arena.h.
#include "offload/host_arena.h"

#include <algorithm>
#include <limits>

#include "common/check.h"

namespace bagualu2 {

namespace {
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
constexpr std::size_t kMaxBytes = std::numeric_limits<std::size_t>::max() >> 2;

// Whether a fence's work is known to have ended: a fence whose runtime cannot tell (it throws)
// keeps its block pending (invariant 4, offload/fence.h).
bool settled(const FencePtr& fence) {
    try {
        return fence->ready();
    } catch (const RuntimeError&) {
        return false;
    }
}
}  // namespace

void HostArena::check_aligned(void* segment, std::size_t bytes) {
    const auto addr = reinterpret_cast<std::uintptr_t>(segment);
    if (addr % kAlignment == 0) {
        return;
    }
    try {
        gpu::DeviceGuard guard(rt_, device_);
        rt_.host_free(segment);  // not kept: nothing else would ever free it
    } catch (const RuntimeError&) {
        // The runtime refuses the free as well: the reservation is lost, the error below stands.
    }
    BAGUALU2_RUNTIME_CHECK(false, "host_alloc of ", bytes, " bytes returned 0x", std::hex, addr,
                           std::dec, ", not aligned to ", kAlignment, " bytes");
}

HostArena::HostArena(std::size_t capacity, const std::string& backend, std::size_t max_capacity,
                     int device)
    : rt_(gpu::runtime(backend)), backend_(backend),
      device_(gpu::resolve_device(rt_, device, "HostArena")) {
    BAGUALU2_CHECK(capacity > 0, "HostArena capacity must be positive, got ", capacity);
    BAGUALU2_CHECK(capacity <= kMaxBytes, "HostArena capacity ", capacity, " bytes is absurd");
    BAGUALU2_CHECK(max_capacity <= kMaxBytes, "HostArena max_capacity ", max_capacity,
                   " bytes is absurd");
    const std::size_t first = round_up(capacity, kAlignment);
    BAGUALU2_CHECK(max_capacity == 0 || max_capacity >= capacity, "HostArena max_capacity (",
                   max_capacity, ") must be 0 (no growth) or at least capacity (", capacity, ")");
    max_capacity_ = max_capacity == 0 ? first : round_up(max_capacity, kAlignment);
    void* base = nullptr;
    {
        gpu::DeviceGuard guard(rt_, device_);
        base = rt_.host_alloc(first);
    }
    check_aligned(base, first);
    const auto addr = reinterpret_cast<std::uintptr_t>(base);
    segments_.push_back({addr, first});
    capacity_ = first;
    blocks_.emplace(addr, Block{first, 0, State::kFree, {}});
    free_.emplace(first, addr);
}

HostArena::~HostArena() {
    // Every engine using this arena holds a reference to it and drains its streams when it
    // dies, so no copy can still touch a segment here.
    for (const Segment& seg : segments_) {
        try {
            gpu::DeviceGuard guard(rt_, device_);
            rt_.host_free(reinterpret_cast<void*>(seg.base));
        } catch (...) {
            // A destructor must not throw.
        }
    }
}

std::size_t HostArena::capacity() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
}

std::uintptr_t HostArena::base() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return segments_.front().base;
}

std::vector<std::pair<std::uintptr_t, std::size_t>> HostArena::segments() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<std::uintptr_t, std::size_t>> out;
    for (const Segment& seg : segments_) {
        out.emplace_back(seg.base, seg.size);
    }
    return out;
}

void HostArena::reclaim() {
    // Snapshot the pending blocks' fences under the lock, query them without it.
    std::vector<std::pair<std::uintptr_t, std::vector<FencePtr>>> snapshot;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (pending_.empty()) {
            return;
        }
        snapshot.reserve(pending_.size());
        for (std::uintptr_t addr : pending_) {
            snapshot.emplace_back(addr, blocks_.at(addr).fences);
        }
    }
    std::vector<std::uintptr_t> completed;
    for (auto& [addr, fences] : snapshot) {
        bool all_ready = true;
        for (auto& fence : fences) {
            if (!settled(fence)) {
                all_ready = false;
                break;
            }
        }
        if (all_ready) {
            completed.push_back(addr);
        }
    }
    if (!completed.empty()) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (std::uintptr_t addr : completed) {
            if (pending_.erase(addr) == 0) {
                continue;  // another thread reclaimed it first
            }
            auto it = blocks_.find(addr);
            pending_bytes_ -= it->second.size;
            // The snapshot still holds these fences, so clearing here never destroys one.
            it->second.fences.clear();
            release_locked(it);
        }
    }
    // `snapshot` dies here, with the lock released: the last fence references go now.
}

void HostArena::release_locked(BlockMap::iterator it) {
    it->second.state = State::kFree;
    // Merge with the next block of the same segment.
    auto next = std::next(it);
    if (next != blocks_.end() && next->second.state == State::kFree &&
        next->second.segment == it->second.segment) {
        free_.erase({next->second.size, next->first});
        it->second.size += next->second.size;
        blocks_.erase(next);
    }
    // Merge into the previous block of the same segment.
    if (it != blocks_.begin()) {
        auto prev = std::prev(it);
        if (prev->second.state == State::kFree && prev->second.segment == it->second.segment) {
            free_.erase({prev->second.size, prev->first});
            prev->second.size += it->second.size;
            blocks_.erase(it);
            it = prev;
        }
    }
    free_.emplace(it->second.size, it->first);
}

std::uintptr_t HostArena::take_locked(std::size_t size) {
    auto fit = free_.lower_bound({size, 0});
    if (fit == free_.end()) {
        return 0;
    }
    const std::uintptr_t addr = fit->second;
    const std::size_t block_size = fit->first;
    free_.erase(fit);
    auto it = blocks_.find(addr);
    if (block_size - size >= kAlignment) {
        blocks_.emplace(addr + size, Block{block_size - size, it->second.segment, State::kFree, {}});
        free_.emplace(block_size - size, addr + size);
        it->second.size = size;
    }
    it->second.state = State::kAllocated;
    in_use_ += it->second.size;
    peak_in_use_ = std::max(peak_in_use_, in_use_);
    ++num_allocs_;
    return addr;
}

bool HostArena::grow(std::size_t size) {
    std::lock_guard<std::mutex> serial(grow_mutex_);
    std::size_t total = 0;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto fit = free_.lower_bound({size, 0});
        if (fit != free_.end()) {
            return true;  // another thread grew the arena, or blocks came back, meanwhile
        }
        total = capacity_;
    }
    if (total >= max_capacity_ || size > max_capacity_ - total) {
        return false;
    }
    return add_segment(std::max(size, std::min(total, max_capacity_ - total)));
}

bool HostArena::reserve(std::size_t capacity) {
    BAGUALU2_CHECK(capacity <= kMaxBytes, "HostArena.reserve: ", capacity, " bytes is absurd");
    const std::size_t want = round_up(capacity, kAlignment);
    std::lock_guard<std::mutex> serial(grow_mutex_);
    const std::size_t total = this->capacity();  // only grow() and reserve() change it, serially
    const std::size_t target = std::min(want, max_capacity_);
    if (total < target && !add_segment(target - total)) {
        return false;
    }
    return std::max(total, target) >= want;
}

bool HostArena::add_segment(std::size_t seg_size) {
    // The runtime call, with the bookkeeping lock released (pinning can take milliseconds).
    // A reservation the host refuses is exhaustion like any other: the caller keeps or
    // recomputes instead.
    void* base = nullptr;
    try {
        gpu::DeviceGuard guard(rt_, device_);
        base = rt_.host_alloc(seg_size);
    } catch (const RuntimeError&) {
        return false;
    }
    check_aligned(base, seg_size);
    const auto addr = reinterpret_cast<std::uintptr_t>(base);
    std::lock_guard<std::mutex> lock(mutex_);
    segments_.push_back({addr, seg_size});
    capacity_ += seg_size;
    blocks_.emplace(addr, Block{seg_size, segments_.size() - 1, State::kFree, {}});
    free_.emplace(seg_size, addr);
    return true;
}

void* HostArena::allocate(std::size_t nbytes) {
    BAGUALU2_CHECK(nbytes > 0, "HostArena.allocate: nbytes must be positive, got 0");
    reclaim();
    if (nbytes <= max_capacity_) {
        const std::size_t size = round_up(nbytes, kAlignment);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (std::uintptr_t addr = take_locked(size)) {
                return reinterpret_cast<void*>(addr);
            }
        }
        if (grow(size)) {
            std::lock_guard<std::mutex> lock(mutex_);
            if (std::uintptr_t addr = take_locked(size)) {
                return reinterpret_cast<void*>(addr);
            }
        }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ++num_failed_;
    return nullptr;
}

long HostArena::segment_of_locked(std::uintptr_t addr, std::size_t nbytes) const {
    for (std::size_t i = 0; i < segments_.size(); ++i) {
        const Segment& seg = segments_[i];
        if (addr >= seg.base && nbytes <= seg.size && addr - seg.base <= seg.size - nbytes) {
            return static_cast<long>(i);
        }
    }
    return -1;
}

void HostArena::free(void* ptr, std::vector<FencePtr> fences) {
    // Drop fences that are already complete, with the lock released (queries are runtime
    // calls); the dropped references die at the end of this function, after the lock.
    std::vector<FencePtr> open;
    for (auto& fence : fences) {
        BAGUALU2_CHECK(fence != nullptr, "HostArena.free: a fence is None");
        if (!settled(fence)) {
            open.push_back(fence);
        }
    }
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    BAGUALU2_CHECK(segment_of_locked(addr, 1) >= 0, "HostArena.free: 0x", std::hex, addr,
                   " is not inside this arena's ", std::dec, segments_.size(),
                   " segment(s) (the first at 0x", std::hex, segments_.front().base,
                   "): a foreign block");
    auto it = blocks_.find(addr);
    BAGUALU2_CHECK(it != blocks_.end() && it->second.state == State::kAllocated,
                   "HostArena.free: 0x", std::hex, addr,
                   " is not the start of an allocated block (freed twice, or never allocated)");
    in_use_ -= it->second.size;
    ++num_frees_;
    if (open.empty()) {
        release_locked(it);
        return;
    }
    it->second.state = State::kPending;
    it->second.fences = std::move(open);
    pending_.insert(addr);
    pending_bytes_ += it->second.size;
}

std::size_t HostArena::block_size(const void* ptr) const {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    BAGUALU2_CHECK(segment_of_locked(addr, 1) >= 0, "0x", std::hex, addr,
                   " is not inside this arena");
    auto it = blocks_.find(addr);
    BAGUALU2_CHECK(it != blocks_.end() && it->second.state == State::kAllocated, "0x", std::hex,
                   addr, " is not the start of an allocated block");
    return it->second.size;
}

bool HostArena::contains(const void* ptr, std::size_t nbytes) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return segment_of_locked(reinterpret_cast<std::uintptr_t>(ptr), nbytes) >= 0;
}

ArenaStats HostArena::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    ArenaStats s;
    s.capacity = capacity_;
    s.max_capacity = max_capacity_;
    s.segments = segments_.size();
    s.in_use = in_use_;
    s.pending = pending_bytes_;
    s.peak_in_use = peak_in_use_;
    s.largest_free_block = free_.empty() ? 0 : free_.rbegin()->first;
    s.free_bytes = capacity_ - in_use_ - pending_bytes_;
    s.fragmentation = s.free_bytes == 0 ? 0.0
                                        : 1.0 - static_cast<double>(s.largest_free_block) /
                                                    static_cast<double>(s.free_bytes);
    s.num_blocks = blocks_.size() - free_.size() - pending_.size();
    s.num_allocs = num_allocs_;
    s.num_frees = num_frees_;
    s.num_failed = num_failed_;
    return s;
}

void HostArena::reset_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_in_use_ = in_use_;
    num_allocs_ = 0;
    num_frees_ = 0;
    num_failed_ = 0;
}

}  // namespace bagualu2
