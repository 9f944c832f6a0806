// HostArena: one pinned host reservation, carved into blocks without runtime calls.
//
// Design note (in the manner of PyTorch's CachingHostAllocator, minus power-of-two rounding)
// -----------
// The arena reserves `capacity` bytes once, through the backend's host_alloc (cudaHostAlloc /
// hipHostMalloc; page-aligned, pre-faulted memory on cpu), because pinning takes a driver-wide
// lock and stalls for milliseconds. Afterwards allocate/free only move bookkeeping.
//
// Invariants (each has a named test in tests/test_host_arena.py):
//   1. Blocks never overlap, lie inside [base, base + capacity), start on a multiple of
//      kAlignment (256) bytes and have a size that is the request rounded up to kAlignment,
//      never to a power of two.
//   2. Best fit: a request takes the smallest free block that can hold it (lowest address on a
//      tie); the remainder, when at least kAlignment bytes, is split off as a free block.
//   3. Free neighbours are always coalesced, so free space is a set of maximal gaps and a
//      request fails only when no gap (after reclaiming completed pending blocks) is big
//      enough. Failure returns nullptr and counts as `num_failed`: a normal, reported outcome.
//   4. A block freed with fences (copies that may still be in flight) is "pending": it is not
//      handed out again until every one of its fences is ready ("re-used too soon" test).
//   5. Thread-safe. The lock guards bookkeeping only: fences are queried, and the last
//      reference to a fence (whose destructor calls the runtime) is dropped, with the lock
//      released.
//   6. Stats: capacity, in_use, pending, peak_in_use, largest_free_block, fragmentation
//      (1 - largest free block / free bytes), num_allocs, num_frees, num_failed. reset_stats()
//      sets peak to the current use and zeroes the counters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu.h"
#include "offload/fence.h"

namespace bagualu2 {

struct ArenaStats {
    std::size_t capacity = 0;
    std::size_t in_use = 0;
    std::size_t pending = 0;
    std::size_t peak_in_use = 0;
    std::size_t largest_free_block = 0;
    std::size_t free_bytes = 0;
    double fragmentation = 0.0;
    std::size_t num_blocks = 0;
    std::uint64_t num_allocs = 0;
    std::uint64_t num_frees = 0;
    std::uint64_t num_failed = 0;
};

class HostArena {
public:
    static constexpr std::size_t kAlignment = 256;

    /// Reserve the arena.
    /// \param[in] capacity  bytes to reserve (> 0; rounded up to kAlignment).
    /// \param[in] backend   "cpu", "cuda" or "hip" (must be compiled in).
    HostArena(std::size_t capacity, const std::string& backend);
    ~HostArena();
    HostArena(const HostArena&) = delete;
    HostArena& operator=(const HostArena&) = delete;

    /// Best-fit allocation.
    /// \param[in] nbytes  requested bytes (> 0).
    /// \return the block's address, or nullptr when no free block is large enough.
    void* allocate(std::size_t nbytes);

    /// Return a block. With fences, the block stays pending until all of them are ready.
    /// \param[in] ptr     address returned by allocate and not yet freed; anything else throws.
    /// \param[in] fences  work that may still read or write the block.
    void free(void* ptr, std::vector<FencePtr> fences = {});

    /// Size (rounded) of the allocated block starting at ptr; throws if there is none.
    /// \param[in] ptr  block address.
    std::size_t block_size(const void* ptr) const;

    /// Whether [ptr, ptr + nbytes) lies inside the reservation.
    /// \param[in] ptr     start address.
    /// \param[in] nbytes  length.
    bool contains(const void* ptr, std::size_t nbytes) const;

    /// A consistent snapshot of the statistics.
    ArenaStats stats() const;

    /// Peak := current use; allocation/free/failure counters := 0.
    void reset_stats();

    std::size_t capacity() const { return capacity_; }
    std::uintptr_t base() const { return reinterpret_cast<std::uintptr_t>(base_); }
    const std::string& backend() const { return backend_; }
    gpu::Runtime& runtime() const { return rt_; }

private:
    enum class State { kFree, kAllocated, kPending };

    struct Block {
        std::size_t size = 0;
        State state = State::kFree;
        std::vector<FencePtr> fences;  // only while pending
    };

    // Moves every pending block whose fences are all ready back to the free set.
    void reclaim();
    // Marks the block at `offset` free and merges it with free neighbours. Lock held.
    void release_locked(std::map<std::size_t, Block>::iterator it);

    // The reservation.
    gpu::Runtime& rt_;
    std::string backend_;
    std::size_t capacity_ = 0;
    char* base_ = nullptr;

    // Bookkeeping, guarded by mutex_: every block by offset, free blocks by (size, offset),
    // pending block offsets.
    mutable std::mutex mutex_;
    std::map<std::size_t, Block> blocks_;
    std::set<std::pair<std::size_t, std::size_t>> free_;
    std::set<std::size_t> pending_;

    // Statistics, guarded by mutex_.
    std::size_t in_use_ = 0;
    std::size_t pending_bytes_ = 0;
    std::size_t peak_in_use_ = 0;
    std::uint64_t num_allocs_ = 0;
    std::uint64_t num_frees_ = 0;
    std::uint64_t num_failed_ = 0;
};

}  // namespace bagualu2
