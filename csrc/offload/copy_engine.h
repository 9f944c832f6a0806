// CopyEngine: asynchronous device<->host copies into and out of a HostArena, with tickets.
//
// Design note
// -----------
// The engine copies on two streams of one backend, one per direction (D2H "offload", H2D
// "reload"), so both directions run at once and beside the caller's compute. On a GPU they are
// the device's process-wide copy streams (gpu::copy_stream): the facade hands them to torch,
// which may record on them after the engine died (gpu/gpu.h, "Streams handed to torch"), so
// engines of one device share them and none destroys them. Sharing must not mix the engines:
// each copy (its producer wait, start event, chunks, end event) is enqueued under the stream's
// process-wide submission lock, so another engine's copy never lands between its start and
// end events and its busy time is its own; and synchronize(), the destructor and a failed
// submission's drain wait for this engine's own copies (its last end event per direction),
// never for the whole stream. Timing events come from the engine's EventPool (offload/
// fence.h), so a copy costs no event creation once the pool holds what is in flight.
// On cpu each engine owns its two streams (gpu::UniqueStream: whatever the constructor created
// is destroyed if a later step throws); they are worker threads, a copy submitted to an idle
// stream runs on the calling thread (gpu/cpu_backend.cpp says why), and large copies are also
// split across a pool of copy threads.
//
// Devices. An engine works on one device, fixed at construction (explicit, or the caller's
// current one; never 0 by default). Every runtime call it makes, on any thread, runs inside a
// DeviceGuard for that device, so stream handle 0 means that device's default stream, and a
// producer or consumer stream of another device is refused (invariant 3): its work would be
// ordered against the wrong device's streams.
// Every copy is cut into chunks of at most `chunk_bytes` (enqueued back to back), so a huge
// copy does not monopolise the pool and the other direction interleaves with it.
//
// Pointers are raw addresses and streams are integer handles (tensor.data_ptr(),
// torch.cuda.current_stream().cuda_stream); nothing here knows torch.
//
// Invariants (each has a named test in tests/test_copy_engine.py):
//   1. Ordering. An offload starts only after the producer stream reached the point where
//      offload() was called (event recorded on it, copy stream waits). A reload writes its
//      destination only after the consumer stream reached the reload call, and the consumer
//      stream waits for the reload's completion (reload(wait=true) or wait_on()). A consumer
//      stream that is the reload stream itself imposes no wait: a prefetch whose destination
//      was allocated on the copy stream starts at once, not when the compute stream catches up
//      (bagualu2/offload/facade.py).
//   2. A ticket's block is returned to the arena by release(), or when the last reference to
//      an unreleased ticket dies (an owner that never runs its release, such as one an
//      interrupt stopped between offload() and keeping the ticket, cannot leak the block);
//      either way only after the offload copy and every reload issued from it completed (its
//      fences go to the arena) and every hold() on it was dropped (a host reader reads the
//      block in place; release() while one is held defers the free to the last drop; a hold
//      keeps its ticket alive).
//      The caller keeps the offload source alive until the ticket is done.
//   3. Misuse throws bagualu2::Error (Python ValueError) and changes nothing: waiting on or
//      querying a released ticket, releasing twice, reloading from a released ticket,
//      reloading into a too-small buffer, null pointers with nonzero sizes, negative sizes,
//      stream handles the backend does not know, streams of another device than the engine's.
//   4. Exhaustion is not an error: offload() returns nullptr when the arena has no block.
//   5. Stats: per direction bytes, copies, busy time (elapsed between a copy's start and end
//      events, so time spent waiting for a producer, or copying for another engine, is not
//      counted) and bandwidth; figures include every copy whose end event completed. A copy
//      whose elapsed time the runtime cannot give is counted in `untimed` only, and taken off
//      the queue all the same: one failed query never blocks the copies and stats after it.
//   6. Trace: while tracing, every submitted copy is appended (under the submission lock, so in
//      the exact order copies enter their streams) with its direction, host block, size and
//      submission time; the overlap scheduler's tests read it to check issue order.
//   7. Failed copies (tests/test_copy_faults.py injects them through the test-only switch of
//      gpu/copy_faults.h) are survivable and never silent:
//      * At submission (the backend throws while enqueueing): offload() / reload() throw
//        bagualu2::RuntimeError (Python RuntimeError) and leave nothing behind: a chunk
//        already enqueued is drained first, then the offload's block goes back to the arena
//        (a reload's destination and source are no longer touched when it throws).
//      * At execution (the copy was enqueued, its completion reports failure): the ticket's
//        fence is complete and failed (offload/fence.h). done() returns false while the copy
//        runs and, once it ended failed, throws bagualu2::RuntimeError naming the direction
//        and the bytes, as wait() does (no query answers "done" for a copy that did not
//        happen); failure() says the same without throwing. A reload of a failed offload
//        fails the same way: reload() throws when the offload is known to have failed, else
//        the reload ticket's done()/wait() do once both ended. hold() and wait_on() throw for
//        a known failure too.
//      * A failed ticket is still released normally, or frees its block when its last
//        reference dies (invariant 2): its fence counts as complete, so the block is reusable
//        at once. Other waiters on the fence return (nothing hangs), stats count the copy in
//        `failed` (not in bytes, copies or busy time), and later copies run normally.
// Blocking calls (Ticket::wait, synchronize) and the copies' submission (offload, reload: a
// copy may run on the calling thread) are bound with the GIL released.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/gpu.h"
#include "offload/fence.h"
#include "offload/host_arena.h"

namespace bagualu2 {

class CopyEngine;

// One asynchronous copy: an offload (owns an arena block) or a reload (reads one).
class Ticket : public std::enable_shared_from_this<Ticket> {
public:
    enum class Kind { kOffload, kReload };

    /// \param[in] source  for a reload: its offload's fence, whose failure is the reload's too.
    Ticket(Kind kind, std::shared_ptr<HostArena> arena, void* block, std::size_t nbytes,
           std::shared_ptr<EventFence> done, std::shared_ptr<EventFence> source = nullptr)
        : kind_(kind), arena_(std::move(arena)), block_(block), nbytes_(nbytes),
          done_(std::move(done)), source_(std::move(source)) {}

    /// Frees an unreleased offload ticket's block (invariant 2).
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

    /// Non-blocking completion query; throws after release(), and RuntimeError once the copy
    /// ended failed (invariant 7).
    bool done();

    /// Block until the copy completed; throws after release(), and RuntimeError when the copy
    /// failed (invariant 7).
    void wait();

    /// Why the copy failed, as done() and wait() report it: "" while it runs or when it
    /// succeeded. Non-blocking; answers after release() too.
    std::string failure() const;

    /// Give the ticket up. For an offload ticket this frees its block, which the arena reuses
    /// only after the offload copy and every reload from it completed, and once no hold()
    /// remains. Throws if released.
    void release();

    /// Keep an offload ticket's block allocated while the returned token lives, so a host
    /// reader can use the bytes where they lie (no copy back). Throws for a reload ticket,
    /// after release(), and before the offload copy completed.
    std::shared_ptr<void> hold();

    bool released() const;
    Kind kind() const { return kind_; }
    std::size_t nbytes() const { return nbytes_; }
    std::uintptr_t host_ptr() const { return reinterpret_cast<std::uintptr_t>(block_); }

    /// The completion fence (nullptr for 0-byte copies, which are complete at once).
    std::shared_ptr<EventFence> fence() const { return done_; }

private:
    friend class CopyEngine;

    // What the ticket is and the block it refers to.
    Kind kind_;
    std::shared_ptr<HostArena> arena_;
    void* block_;
    std::size_t nbytes_;
    std::shared_ptr<EventFence> done_;
    std::shared_ptr<EventFence> source_;  // a reload's offload (nullptr for offloads)

    // Throws RuntimeError with failure() when the copy is known to have failed.
    void check_failure() const;

    // Frees the block with the fences saved by release(); mutex_ held.
    void free_block_locked();

    // Release state, the fences of reloads reading the block and the holds on it, guarded by
    // mutex_. With holds left, release() saves its fences in reads_ and the last drop frees.
    mutable std::mutex mutex_;
    bool released_ = false;
    std::vector<FencePtr> reads_;
    std::size_t holds_ = 0;
};

using TicketPtr = std::shared_ptr<Ticket>;

// One submitted copy, as the trace records it.
struct TraceEntry {
    std::uint64_t seq = 0;          // submission order, from 0 at start_trace()
    bool h2d = false;               // reload (true) or offload (false)
    std::uintptr_t host_ptr = 0;    // arena block the copy writes or reads
    std::size_t nbytes = 0;
    double submit_s = 0.0;          // seconds since start_trace()
};

struct DirectionStats {
    std::uint64_t bytes = 0;
    std::uint64_t copies = 0;
    double busy_s = 0.0;
    std::uint64_t bytes_submitted = 0;
    std::uint64_t failed = 0;  // copies that ended failed (not in bytes, copies, busy_s)
    std::uint64_t untimed = 0;  // copies that ended whose elapsed time the runtime refused
};

class CopyEngine {
public:
    // Default chunk: on a device, one cudaMemcpyAsync/hipMemcpyAsync per 16 MiB keeps the
    // per-call cost (a few microseconds) under 1% of the copy. On cpu, 4 MiB chunks (each split
    // into 512 KiB pieces across the copy pool) measured fastest from 16 MiB to 1 GiB
    // (benchmarks/offload_bandwidth.py --chunk-bytes): 16 MiB chunks lost 10-25% there.
    static constexpr std::size_t kDeviceChunkBytes = std::size_t{16} << 20;
    static constexpr std::size_t kHostChunkBytes = std::size_t{4} << 20;
    static std::size_t default_chunk_bytes(const std::string& backend) {
        return backend == "cpu" ? kHostChunkBytes : kDeviceChunkBytes;
    }

    /// \param[in] arena        arena the offloads allocate from (same backend).
    /// \param[in] backend      "cpu", "cuda" or "hip".
    /// \param[in] device       device whose streams to create (< 0: the current device).
    /// \param[in] chunk_bytes  largest single memcpy enqueued (> 0).
    CopyEngine(std::shared_ptr<HostArena> arena, const std::string& backend, int device,
               std::size_t chunk_bytes);
    ~CopyEngine();
    CopyEngine(const CopyEngine&) = delete;
    CopyEngine& operator=(const CopyEngine&) = delete;

    /// Copy [src, src + nbytes) into a new arena block once the producer stream reaches this
    /// point.
    /// \param[in] src              source address (may be 0 only when nbytes is 0).
    /// \param[in] nbytes           bytes to copy (>= 0).
    /// \param[in] producer_stream  stream that writes src (0: default stream / host thread).
    /// \return a ticket, or nullptr when the arena has no block large enough.
    TicketPtr offload(std::uintptr_t src, std::int64_t nbytes, std::uintptr_t producer_stream);

    /// Copy an offloaded block back into [dst, dst + ticket.nbytes).
    /// \param[in] from             an offload ticket, not released.
    /// \param[in] dst              destination address (0 only for 0-byte tickets).
    /// \param[in] dst_capacity     bytes available at dst (must be >= from.nbytes).
    /// \param[in] consumer_stream  stream that will read dst (0: default stream / host thread).
    /// \param[in] consumer_waits   make consumer_stream wait for the copy now (GPU backends).
    /// \return the reload ticket.
    TicketPtr reload(const TicketPtr& from, std::uintptr_t dst, std::int64_t dst_capacity,
                     std::uintptr_t consumer_stream, bool consumer_waits);

    /// Make `stream` wait (on the device, not the host) for `ticket`'s copy. On cpu with
    /// stream 0 this blocks the calling thread.
    /// \param[in] ticket  a ticket of this engine, not released.
    /// \param[in] stream  stream handle.
    void wait_on(const TicketPtr& ticket, std::uintptr_t stream);

    /// Block until every copy enqueued so far completed.
    void synchronize();

    DirectionStats d2h_stats();
    DirectionStats h2d_stats();
    void reset_stats();

    /// Start recording submitted copies (clears an earlier trace).
    /// \param[in] capacity  entries kept; later copies are counted in trace_dropped() only.
    void start_trace(std::size_t capacity);
    /// Stop recording; the trace stays readable.
    void stop_trace();
    /// Copies recorded since start_trace(), in submission order.
    std::vector<TraceEntry> trace();
    std::uint64_t trace_dropped();

    std::uintptr_t d2h_stream() const { return reinterpret_cast<std::uintptr_t>(d2h_); }
    std::uintptr_t h2d_stream() const { return reinterpret_cast<std::uintptr_t>(h2d_); }
    int device() const { return device_; }
    std::size_t chunk_bytes() const { return chunk_bytes_; }
    const std::shared_ptr<HostArena>& arena() const { return arena_; }
    const std::string& backend() const { return backend_; }

private:
    struct Timing {
        std::shared_ptr<EventFence> start;
        std::shared_ptr<EventFence> end;
        std::size_t bytes;
    };

    struct Direction {
        Direction(gpu::Runtime& rt, int device, int slot);
        std::unique_ptr<gpu::UniqueStream> owned;  // cpu: the engine's own stream
        std::unique_ptr<std::mutex> owned_lock;    // cpu: its submission lock
        gpu::CopyStream shared;      // GPU: the device's process-wide copy stream and its lock
        gpu::Stream stream;          // owned's or shared's
        std::mutex* submit;          // owned_lock's or shared's, taken inside submit_mutex_
        std::shared_ptr<EventFence> last;  // this engine's last copy here, under submit_mutex_
        std::deque<Timing> timings;  // copies whose time is not yet accounted
        DirectionStats stats;
    };

    // Enqueues a chunked copy bracketed by timing events on `dir`; returns the end fence.
    // submit_mutex_ and *dir.submit held.
    std::shared_ptr<EventFence> enqueue_copy(Direction& dir, void* dst, const void* src,
                                             std::size_t nbytes);
    // Blocks until `dir`'s stream ran everything enqueued on it so far (not what other engines
    // enqueue later), swallowing runtime errors: a submission that failed half-way drains what
    // it enqueued before the memory goes.
    void drain(Direction& dir) noexcept;
    // Appends a submitted copy to the trace when tracing. submit_mutex_ held.
    void record(bool h2d, const void* host, std::size_t nbytes);
    // Makes dir's stream wait for `stream`'s current tail (skipped for the host thread).
    void wait_for_stream(Direction& dir, gpu::Stream stream);
    // Accounts completed copies of `dir`. stats_mutex_ held.
    void account(Direction& dir);
    DirectionStats snapshot(Direction& dir);

    // Configuration (validated before any stream exists: see the constructor).
    std::shared_ptr<HostArena> arena_;
    gpu::Runtime& rt_;
    std::string backend_;
    std::size_t chunk_bytes_;
    int device_ = 0;
    std::shared_ptr<EventPool> events_;  // the copies' timing events (fences share it)

    // Submission: streams and the reusable cross-stream event, guarded by submit_mutex_ so one
    // ticket's operations are contiguous on its stream. Each is owned by a member, constructed
    // in declaration order, so a failure creating a later one destroys the earlier ones.
    std::mutex submit_mutex_;
    Direction d2h_dir_;
    Direction h2d_dir_;
    gpu::Stream d2h_ = nullptr;  // d2h_dir_.stream
    gpu::Stream h2d_ = nullptr;  // h2d_dir_.stream
    gpu::UniqueEvent sync_event_;
    // Issue trace, guarded by submit_mutex_.
    bool tracing_ = false;
    std::size_t trace_capacity_ = 0;
    std::uint64_t trace_seq_ = 0;
    std::chrono::steady_clock::time_point trace_start_{};
    std::vector<TraceEntry> trace_;

    // Statistics, guarded by stats_mutex_ (timings are appended under both locks).
    std::mutex stats_mutex_;
};

}  // namespace bagualu2
