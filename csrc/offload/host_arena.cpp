// HostArena implementation; the invariants are listed in host_arena.h.
#include "offload/host_arena.h"

#include <limits>

#include "common/check.h"

namespace bagualu2 {

namespace {
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
}  // namespace

HostArena::HostArena(std::size_t capacity, const std::string& backend)
    : rt_(gpu::runtime(backend)), backend_(backend) {
    BAGUALU2_CHECK(capacity > 0, "HostArena capacity must be positive, got ", capacity);
    BAGUALU2_CHECK(capacity <= (std::numeric_limits<std::size_t>::max() >> 2),
                   "HostArena capacity ", capacity, " bytes is absurd");
    capacity_ = round_up(capacity, kAlignment);
    base_ = static_cast<char*>(rt_.host_alloc(capacity_));
    BAGUALU2_RUNTIME_CHECK(reinterpret_cast<std::uintptr_t>(base_) % kAlignment == 0,
                           "host_alloc returned memory not aligned to ", kAlignment, " bytes");
    blocks_.emplace(0, Block{capacity_, State::kFree, {}});
    free_.emplace(capacity_, 0);
}

HostArena::~HostArena() {
    // Every engine using this arena holds a reference to it and drains its streams when it
    // dies, so no copy can still touch the reservation here.
    try {
        rt_.host_free(base_);
    } catch (...) {
        // A destructor must not throw.
    }
}

void HostArena::reclaim() {
    // Snapshot the pending blocks' fences under the lock, query them without it.
    std::vector<std::pair<std::size_t, std::vector<FencePtr>>> snapshot;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (pending_.empty()) {
            return;
        }
        snapshot.reserve(pending_.size());
        for (std::size_t offset : pending_) {
            snapshot.emplace_back(offset, blocks_.at(offset).fences);
        }
    }
    std::vector<std::size_t> completed;
    for (auto& [offset, fences] : snapshot) {
        bool all_ready = true;
        for (auto& fence : fences) {
            if (!fence->ready()) {
                all_ready = false;
                break;
            }
        }
        if (all_ready) {
            completed.push_back(offset);
        }
    }
    if (!completed.empty()) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (std::size_t offset : completed) {
            if (pending_.erase(offset) == 0) {
                continue;  // another thread reclaimed it first
            }
            auto it = blocks_.find(offset);
            pending_bytes_ -= it->second.size;
            // The snapshot still holds these fences, so clearing here never destroys one.
            it->second.fences.clear();
            release_locked(it);
        }
    }
    // `snapshot` dies here, with the lock released: the last fence references go now.
}

void HostArena::release_locked(std::map<std::size_t, Block>::iterator it) {
    it->second.state = State::kFree;
    // Merge with the next block.
    auto next = std::next(it);
    if (next != blocks_.end() && next->second.state == State::kFree) {
        free_.erase({next->second.size, next->first});
        it->second.size += next->second.size;
        blocks_.erase(next);
    }
    // Merge into the previous block.
    if (it != blocks_.begin()) {
        auto prev = std::prev(it);
        if (prev->second.state == State::kFree) {
            free_.erase({prev->second.size, prev->first});
            prev->second.size += it->second.size;
            blocks_.erase(it);
            it = prev;
        }
    }
    free_.emplace(it->second.size, it->first);
}

void* HostArena::allocate(std::size_t nbytes) {
    BAGUALU2_CHECK(nbytes > 0, "HostArena.allocate: nbytes must be positive, got 0");
    reclaim();
    std::lock_guard<std::mutex> lock(mutex_);
    if (nbytes > capacity_) {
        ++num_failed_;
        return nullptr;
    }
    const std::size_t size = round_up(nbytes, kAlignment);
    auto fit = free_.lower_bound({size, 0});
    if (fit == free_.end()) {
        ++num_failed_;
        return nullptr;
    }
    const std::size_t offset = fit->second;
    const std::size_t block_size = fit->first;
    free_.erase(fit);
    auto it = blocks_.find(offset);
    if (block_size - size >= kAlignment) {
        blocks_.emplace(offset + size, Block{block_size - size, State::kFree, {}});
        free_.emplace(block_size - size, offset + size);
        it->second.size = size;
    }
    it->second.state = State::kAllocated;
    in_use_ += it->second.size;
    peak_in_use_ = std::max(peak_in_use_, in_use_);
    ++num_allocs_;
    return base_ + offset;
}

void HostArena::free(void* ptr, std::vector<FencePtr> fences) {
    // Drop fences that are already complete, with the lock released (queries are runtime
    // calls); the dropped references die at the end of this function, after the lock.
    std::vector<FencePtr> open;
    for (auto& fence : fences) {
        BAGUALU2_CHECK(fence != nullptr, "HostArena.free: a fence is None");
        if (!fence->ready()) {
            open.push_back(fence);
        }
    }
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    BAGUALU2_CHECK(contains(ptr, 1), "HostArena.free: 0x", std::hex, addr,
                   " is not inside this arena [0x", base(), ", 0x", base() + capacity_,
                   "): a foreign block");
    const std::size_t offset = static_cast<std::size_t>(addr - base());
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(offset);
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
    pending_.insert(offset);
    pending_bytes_ += it->second.size;
}

std::size_t HostArena::block_size(const void* ptr) const {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    BAGUALU2_CHECK(contains(ptr, 1), "0x", std::hex, addr, " is not inside this arena");
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(static_cast<std::size_t>(addr - base()));
    BAGUALU2_CHECK(it != blocks_.end() && it->second.state == State::kAllocated, "0x", std::hex,
                   addr, " is not the start of an allocated block");
    return it->second.size;
}

bool HostArena::contains(const void* ptr, std::size_t nbytes) const {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    return addr >= base() && nbytes <= capacity_ && addr - base() <= capacity_ - nbytes;
}

ArenaStats HostArena::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    ArenaStats s;
    s.capacity = capacity_;
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
