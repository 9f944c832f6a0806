// HostArena: pinned host reservations, carved into blocks without runtime calls.
//
// Design note (in the manner of PyTorch's CachingHostAllocator, minus power-of-two rounding)
// -----------
// The arena reserves `capacity` bytes up front, through the backend's host_alloc (cudaHostAlloc
// / hipHostMalloc; page-aligned, pre-faulted memory on cpu), because pinning takes a
// driver-wide lock and stalls for milliseconds. The memory is portable (every device's copies
// may use it); reserving and freeing it run with the arena's own device bound, on whatever
// thread does them (gpu/gpu.h, "Devices and threads"). Afterwards allocate/free only move bookkeeping.
// With `max_capacity` above `capacity`, a request that no gap can hold reserves one more
// segment (a rare, slow step, never taken while the bookkeeping lock is held); segments are
// kept until the arena dies, so the steady state makes no runtime calls.
//
// Invariants (each has a named test in tests/test_host_arena.py):
//   1. Blocks never overlap, each lies inside one segment, starts on a multiple of
//      kAlignment (256) bytes and has a size that is the request rounded up to kAlignment,
//      never to a power of two.
//   2. Best fit: a request takes the smallest free block that can hold it (lowest address on a
//      tie); the remainder, when at least kAlignment bytes, is split off as a free block.
//   3. Free neighbours in one segment are always coalesced (blocks of different segments
//      never merge, even when the segments happen to be adjacent), so free space is a set of
//      maximal gaps, and a request fails only when no gap (after reclaiming completed pending
//      blocks) is big enough and no segment can be added. Failure returns nullptr and counts
//      as `num_failed`: a normal, reported outcome.
//   4. A block freed with fences (copies that may still be in flight) is "pending": it is not
//      handed out again until every one of its fences is ready ("re-used too soon" test). A
//      fence whose runtime cannot tell (its query throws: a failed bind, a deinitialised
//      driver, an invalid context) is not ready: the block stays pending, possibly for good,
//      since reusing memory a DMA may still write is the one outcome worse than a leak
//      (offload/fence.h, "Failure").
//   8. Every reservation is either a segment (freed with the arena) or freed before the call
//      that made it throws (a misaligned reservation included): nothing pinned leaks.
//   5. Thread-safe. The lock guards bookkeeping only: fences are queried, and the last
//      reference to a fence (whose destructor calls the runtime) is dropped, with the lock
//      released.
//   6. Stats: capacity (all segments), max_capacity, segments, in_use, pending, peak_in_use,
//      largest_free_block, fragmentation (1 - largest free block / free bytes), num_allocs,
//      num_frees, num_failed. reset_stats() sets peak to the current use and zeroes the
//      counters.
//   7. Growth: a new segment is reserved only for a request that fits nowhere, holds at least
//      that request, is at least as large as the arena so far (geometric growth: few
//      reservations) unless that would pass max_capacity, and the total never passes
//      max_capacity. A reservation the runtime refuses leaves the arena as it was and the
//      request fails like any exhaustion (nullptr, num_failed). reserve(n) is the one other
//      way to grow: one segment of exactly what the capacity lacks of n (of max_capacity, when
//      n is beyond it), so an owner that learns how much it will need reserves it at a quiet
//      moment instead of while copies wait.
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
    std::size_t max_capacity = 0;
    std::size_t segments = 0;
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

    /// Reserve the arena's first segment.
    /// \param[in] capacity      bytes to reserve now (> 0; rounded up to kAlignment).
    /// \param[in] backend       "cpu", "cuda" or "hip" (must be compiled in).
    /// \param[in] max_capacity  bytes the arena may grow to by adding segments (0: capacity,
    ///                          no growth; else >= capacity).
    /// \param[in] device        device whose context reserves and frees the (portable) pinned
    ///                          memory (< 0: the caller's current one; never 0 by default).
    HostArena(std::size_t capacity, const std::string& backend, std::size_t max_capacity = 0,
              int device = -1);
    ~HostArena();
    HostArena(const HostArena&) = delete;
    HostArena& operator=(const HostArena&) = delete;

    /// Best-fit allocation; adds a segment when no gap fits and max_capacity allows.
    /// \param[in] nbytes  requested bytes (> 0).
    /// \return the block's address, or nullptr when no free block is large enough.
    void* allocate(std::size_t nbytes);

    /// Grow the capacity to `capacity` bytes now (to max_capacity when that is less), with one
    /// segment of what is missing; nothing when the arena is that large already.
    /// \param[in] capacity  bytes the arena should hold in all.
    /// \return whether the arena now holds at least `capacity` bytes (false when max_capacity
    ///         is smaller or the runtime refused the reservation, which leaves it as it was).
    bool reserve(std::size_t capacity);

    /// Return a block. With fences, the block stays pending until all of them are ready.
    /// \param[in] ptr     address returned by allocate and not yet freed; anything else throws.
    /// \param[in] fences  work that may still read or write the block.
    void free(void* ptr, std::vector<FencePtr> fences = {});

    /// Size (rounded) of the allocated block starting at ptr; throws if there is none.
    /// \param[in] ptr  block address.
    std::size_t block_size(const void* ptr) const;

    /// Whether [ptr, ptr + nbytes) lies inside one segment.
    /// \param[in] ptr     start address.
    /// \param[in] nbytes  length.
    bool contains(const void* ptr, std::size_t nbytes) const;

    /// (base address, bytes) of every segment, in the order they were reserved.
    std::vector<std::pair<std::uintptr_t, std::size_t>> segments() const;

    /// A consistent snapshot of the statistics.
    ArenaStats stats() const;

    /// Peak := current use; allocation/free/failure counters := 0.
    void reset_stats();

    std::size_t capacity() const;
    std::size_t max_capacity() const { return max_capacity_; }
    /// The first segment's address.
    std::uintptr_t base() const;
    const std::string& backend() const { return backend_; }
    gpu::Runtime& runtime() const { return rt_; }
    int device() const { return device_; }

private:
    enum class State { kFree, kAllocated, kPending };

    struct Block {
        std::size_t size = 0;
        std::size_t segment = 0;  // index into segments_
        State state = State::kFree;
        std::vector<FencePtr> fences;  // only while pending
    };

    struct Segment {
        std::uintptr_t base = 0;
        std::size_t size = 0;
    };

    using BlockMap = std::map<std::uintptr_t, Block>;

    // Moves every pending block whose fences are all ready back to the free set.
    void reclaim();
    // Marks the block `it` free and merges it with free neighbours of its segment. Lock held.
    void release_locked(BlockMap::iterator it);
    // Takes the best-fitting free block for `size` (rounded) bytes, or returns 0. Lock held.
    std::uintptr_t take_locked(std::size_t size);
    // Reserves a segment that can hold `size` bytes if max_capacity allows; false otherwise.
    // Called without mutex_; serialised by grow_mutex_.
    bool grow(std::size_t size);
    // Reserves one segment of `seg_size` bytes (the runtime call with mutex_ released); false
    // when the runtime refuses. Called with grow_mutex_ held, without mutex_.
    bool add_segment(std::size_t seg_size);
    // Frees `segment` (a host_alloc of `bytes`) and throws when it is not kAlignment-aligned.
    void check_aligned(void* segment, std::size_t bytes);
    // Index of the segment holding [addr, addr + nbytes), or -1. Lock held.
    long segment_of_locked(std::uintptr_t addr, std::size_t nbytes) const;

    // The reservations. segments_ only grows, under mutex_; a segment is freed with the arena.
    gpu::Runtime& rt_;
    std::string backend_;
    int device_;
    std::size_t max_capacity_ = 0;
    std::vector<Segment> segments_;
    std::size_t capacity_ = 0;  // sum of segment sizes, guarded by mutex_
    std::mutex grow_mutex_;

    // Bookkeeping, guarded by mutex_: every block by address, free blocks by (size, address),
    // pending block addresses.
    mutable std::mutex mutex_;
    BlockMap blocks_;
    std::set<std::pair<std::size_t, std::uintptr_t>> free_;
    std::set<std::uintptr_t> pending_;

    // Statistics, guarded by mutex_.
    std::size_t in_use_ = 0;
    std::size_t pending_bytes_ = 0;
    std::size_t peak_in_use_ = 0;
    std::uint64_t num_allocs_ = 0;
    std::uint64_t num_frees_ = 0;
    std::uint64_t num_failed_ = 0;
};

}  // namespace bagualu2
