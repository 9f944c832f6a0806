// CopyEngine implementation; the invariants are listed in copy_engine.h.
#include "offload/copy_engine.h"

#include <algorithm>
#include <limits>

#include "common/check.h"

namespace bagualu2 {

namespace {

gpu::Stream as_stream(std::uintptr_t handle) { return reinterpret_cast<gpu::Stream>(handle); }

std::size_t checked_size(std::int64_t nbytes, const char* what) {
    BAGUALU2_CHECK(nbytes >= 0, what, " must be >= 0, got ", nbytes);
    BAGUALU2_CHECK(static_cast<std::uint64_t>(nbytes) <= (std::numeric_limits<std::size_t>::max() >> 2),
                   what, " = ", nbytes, " is absurd");
    return static_cast<std::size_t>(nbytes);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Ticket

bool Ticket::done() {
    std::shared_ptr<EventFence> fence;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        BAGUALU2_CHECK(!released_, "done() on a released ticket (use after release)");
        fence = done_;
    }
    if (fence == nullptr) {
        return true;
    }
    if (!fence->ready()) {
        return false;
    }
    check_failure();
    return true;
}

void Ticket::wait() {
    std::shared_ptr<EventFence> fence;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        BAGUALU2_CHECK(!released_, "wait() on a released ticket (use after release)");
        fence = done_;
    }
    if (fence != nullptr) {
        fence->wait();
        check_failure();
    }
}

std::string Ticket::failure() const {
    // done_ and source_ never change after construction: no lock needed.
    if (done_ == nullptr || !done_->ready()) {
        return {};
    }
    const char* what = kind_ == Kind::kOffload ? "offload copy (device to host) of "
                                               : "reload copy (host to device) of ";
    std::string why = done_->failure();
    if (!why.empty()) {
        return what + std::to_string(nbytes_) + " bytes failed: " + why;
    }
    // A reload's stream waited for its offload, so that ended before the reload did.
    if (source_ != nullptr && source_->ready()) {
        why = source_->failure();
        if (!why.empty()) {
            return what + std::to_string(nbytes_) + " bytes failed: the offload it reads failed: " +
                   why;
        }
    }
    return {};
}

void Ticket::check_failure() const {
    const std::string why = failure();
    BAGUALU2_RUNTIME_CHECK(why.empty(), why);
}

bool Ticket::released() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return released_;
}

Ticket::~Ticket() {
    // No lock: the last reference is gone, so no other thread can reach this ticket, and no
    // hold is left (each keeps the ticket alive).
    if (released_ || kind_ != Kind::kOffload) {
        return;
    }
    if (done_ != nullptr) {
        reads_.push_back(done_);
    }
    try {
        free_block_locked();
    } catch (...) {
        // A destructor must not throw; the block is the arena's own, so this is unreachable.
    }
}

void Ticket::release() {
    std::lock_guard<std::mutex> lock(mutex_);
    BAGUALU2_CHECK(!released_, "release() of a ticket that was already released");
    released_ = true;
    if (done_ != nullptr) {
        reads_.push_back(done_);
    }
    if (holds_ == 0) {
        free_block_locked();
    }
}

void Ticket::free_block_locked() {
    std::vector<FencePtr> fences = std::move(reads_);
    reads_.clear();
    if (kind_ == Kind::kOffload && block_ != nullptr) {
        arena_->free(block_, std::move(fences));
    }
}

std::shared_ptr<void> Ticket::hold() {
    std::lock_guard<std::mutex> lock(mutex_);
    BAGUALU2_CHECK(kind_ == Kind::kOffload, "hold() needs an offload ticket, got a reload ticket");
    BAGUALU2_CHECK(!released_, "hold() on a released ticket (use after release)");
    BAGUALU2_CHECK(done_ == nullptr || done_->ready(),
                   "hold() before the offload copy completed: wait() first");
    check_failure();  // the block holds no copy
    ++holds_;
    // The token owns a reference to the ticket, so the last drop can free the block.
    std::shared_ptr<Ticket> self = shared_from_this();
    return std::shared_ptr<void>(block_, [self](void*) {
        std::lock_guard<std::mutex> drop_lock(self->mutex_);
        if (--self->holds_ == 0 && self->released_) {
            try {
                self->free_block_locked();
            } catch (...) {
                // A deleter must not throw; the block was the arena's own, so this is unreachable.
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// CopyEngine

namespace {

// The engine's device, checked before any stream is created (-1: the caller's current one).
int checked_device(gpu::Runtime& rt, const std::string& backend,
                   const std::shared_ptr<HostArena>& arena, std::size_t chunk_bytes, int device) {
    BAGUALU2_CHECK(arena != nullptr, "CopyEngine needs an arena");
    BAGUALU2_CHECK(arena->backend() == backend, "CopyEngine backend '", backend,
                   "' differs from its arena's backend '", arena->backend(), "'");
    BAGUALU2_CHECK(chunk_bytes > 0, "chunk_bytes must be positive");
    return gpu::resolve_device(rt, device, "CopyEngine");
}

}  // namespace

CopyEngine::Direction::Direction(gpu::Runtime& rt, int device, int slot)
    : owned(rt.is_host() ? std::make_unique<gpu::UniqueStream>(rt, device) : nullptr),
      owned_lock(rt.is_host() ? std::make_unique<std::mutex>() : nullptr),
      shared(rt.is_host() ? gpu::CopyStream{} : gpu::copy_stream(rt, device, slot)),
      stream(owned != nullptr ? owned->get() : shared.stream),
      submit(owned_lock != nullptr ? owned_lock.get() : shared.submit) {}

CopyEngine::CopyEngine(std::shared_ptr<HostArena> arena, const std::string& backend, int device,
                       std::size_t chunk_bytes)
    : arena_(std::move(arena)), rt_(gpu::runtime(backend)), backend_(backend),
      chunk_bytes_(chunk_bytes),
      device_(checked_device(rt_, backend_, arena_, chunk_bytes_, device)),
      events_(std::make_shared<EventPool>(rt_, device_)), d2h_dir_(rt_, device_, 0),
      h2d_dir_(rt_, device_, 1), d2h_(d2h_dir_.stream), h2d_(h2d_dir_.stream),
      sync_event_(rt_, device_, false) {}

CopyEngine::~CopyEngine() {
    // This engine's copies end before the members go (the timing events first, then the
    // event, then a cpu engine's own streams; a GPU engine's streams stay, see copy_engine.h).
    try {
        synchronize();
    } catch (...) {
        // A destructor must not throw.
    }
}

void CopyEngine::wait_for_stream(Direction& dir, gpu::Stream stream) {
    if ((stream == nullptr && rt_.is_host()) || stream == dir.stream) {
        // The host thread is synchronous (everything it wrote is already there); the copy
        // stream runs in order with itself.
        return;
    }
    rt_.event_record(sync_event_.get(), stream);
    rt_.stream_wait_event(dir.stream, sync_event_.get());
}

std::shared_ptr<EventFence> CopyEngine::enqueue_copy(Direction& dir, void* dst, const void* src,
                                                     std::size_t nbytes) {
    {
        // Completed copies give their events back to the pool before this one takes two.
        std::lock_guard<std::mutex> lock(stats_mutex_);
        account(dir);
    }
    auto start = std::make_shared<EventFence>(events_);
    auto end = std::make_shared<EventFence>(events_);
    rt_.event_record(start->event(), dir.stream);
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    for (std::size_t offset = 0; offset < nbytes; offset += chunk_bytes_) {
        const std::size_t len = std::min(chunk_bytes_, nbytes - offset);
        rt_.memcpy_async(d + offset, s + offset, len, dir.stream);
    }
    rt_.event_record(end->event(), dir.stream);
    dir.last = end;
    std::lock_guard<std::mutex> lock(stats_mutex_);
    dir.timings.push_back(Timing{std::move(start), end, nbytes});
    dir.stats.bytes_submitted += nbytes;
    return end;
}

TicketPtr CopyEngine::offload(std::uintptr_t src, std::int64_t nbytes,
                              std::uintptr_t producer_stream) {
    const std::size_t n = checked_size(nbytes, "offload nbytes");
    BAGUALU2_CHECK(n == 0 || src != 0, "offload of ", n, " bytes from a null pointer");
    {
        gpu::DeviceGuard guard(rt_, device_);
        rt_.check_stream(as_stream(producer_stream), device_);
    }
    if (n == 0) {
        return std::make_shared<Ticket>(Ticket::Kind::kOffload, arena_, nullptr, 0, nullptr);
    }
    BAGUALU2_CHECK(!arena_->contains(reinterpret_cast<void*>(src), 1),
                   "offload source 0x", std::hex, src, " lies inside the host arena");
    void* block = arena_->allocate(n);
    if (block == nullptr) {
        return nullptr;
    }
    std::shared_ptr<EventFence> done;
    try {
        gpu::DeviceGuard guard(rt_, device_);
        std::lock_guard<std::mutex> lock(submit_mutex_);
        std::lock_guard<std::mutex> stream_lock(*d2h_dir_.submit);
        wait_for_stream(d2h_dir_, as_stream(producer_stream));
        done = enqueue_copy(d2h_dir_, block, reinterpret_cast<const void*>(src), n);
        record(false, block, n);
    } catch (...) {
        drain(d2h_dir_);      // chunks enqueued before the failure may still write the block
        arena_->free(block);  // nothing enqueued can touch it any more
        throw;
    }
    return std::make_shared<Ticket>(Ticket::Kind::kOffload, arena_, block, n, std::move(done));
}

TicketPtr CopyEngine::reload(const TicketPtr& from, std::uintptr_t dst, std::int64_t dst_capacity,
                             std::uintptr_t consumer_stream, bool consumer_waits) {
    BAGUALU2_CHECK(from != nullptr, "reload from None");
    BAGUALU2_CHECK(from->kind() == Ticket::Kind::kOffload,
                   "reload needs an offload ticket, got a reload ticket");
    BAGUALU2_CHECK(from->arena_ == arena_, "reload of a ticket that belongs to another engine's arena");
    const std::size_t capacity = checked_size(dst_capacity, "reload dst_capacity");
    const std::size_t n = from->nbytes();
    BAGUALU2_CHECK(capacity >= n, "reload destination too small: ", capacity,
                   " bytes available, ", n, " bytes needed");
    BAGUALU2_CHECK(n == 0 || dst != 0, "reload of ", n, " bytes into a null pointer");
    {
        gpu::DeviceGuard guard(rt_, device_);
        rt_.check_stream(as_stream(consumer_stream), device_);
    }

    // Hold the source ticket's lock across submission: a concurrent release() must either see
    // this reload's fence or happen before it (and then this reload fails cleanly).
    std::lock_guard<std::mutex> ticket_lock(from->mutex_);
    BAGUALU2_CHECK(!from->released_, "reload from a released ticket (use after release)");
    if (n == 0) {
        return std::make_shared<Ticket>(Ticket::Kind::kReload, arena_, nullptr, 0, nullptr);
    }
    // An offload known to have failed left nothing in its block to reload (invariant 7).
    const bool source_ended = from->done_->ready();
    if (source_ended) {
        const std::string why = from->done_->failure();
        BAGUALU2_RUNTIME_CHECK(why.empty(), "reload of ", n,
                               " bytes from an offload whose copy failed: ", why);
    }
    std::shared_ptr<EventFence> done;
    {
        gpu::DeviceGuard guard(rt_, device_);
        std::lock_guard<std::mutex> lock(submit_mutex_);
        try {
            std::lock_guard<std::mutex> stream_lock(*h2d_dir_.submit);
            if (!source_ended) {
                rt_.stream_wait_event(h2d_, from->done_->event());
            }
            wait_for_stream(h2d_dir_, as_stream(consumer_stream));
            done = enqueue_copy(h2d_dir_, reinterpret_cast<void*>(dst), from->block_, n);
            record(true, from->block_, n);
            if (consumer_waits && !(consumer_stream == 0 && rt_.is_host())) {
                rt_.stream_wait_event(as_stream(consumer_stream), done->event());
            }
        } catch (...) {
            // Chunks enqueued before the failure may still write dst (the caller frees it when
            // this throws) or read the block (no fence of theirs is registered): drain them.
            drain(h2d_dir_);
            throw;
        }
    }
    from->reads_.push_back(done);
    return std::make_shared<Ticket>(Ticket::Kind::kReload, arena_, from->block_, n, std::move(done),
                                    from->done_);
}

void CopyEngine::record(bool h2d, const void* host, std::size_t nbytes) {
    if (!tracing_) {
        return;
    }
    const std::uint64_t seq = trace_seq_++;
    if (trace_.size() >= trace_capacity_) {
        return;  // counted by trace_dropped()
    }
    const std::chrono::duration<double> since = std::chrono::steady_clock::now() - trace_start_;
    trace_.push_back(TraceEntry{seq, h2d, reinterpret_cast<std::uintptr_t>(host), nbytes,
                                since.count()});
}

void CopyEngine::start_trace(std::size_t capacity) {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    trace_.clear();
    trace_.reserve(std::min<std::size_t>(capacity, 4096));
    trace_capacity_ = capacity;
    trace_seq_ = 0;
    trace_start_ = std::chrono::steady_clock::now();
    tracing_ = true;
}

void CopyEngine::stop_trace() {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    tracing_ = false;
}

std::vector<TraceEntry> CopyEngine::trace() {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    return trace_;
}

std::uint64_t CopyEngine::trace_dropped() {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    return trace_seq_ - trace_.size();
}

void CopyEngine::wait_on(const TicketPtr& ticket, std::uintptr_t stream) {
    BAGUALU2_CHECK(ticket != nullptr, "wait_on(None)");
    BAGUALU2_CHECK(!ticket->released(), "wait_on a released ticket (use after release)");
    gpu::DeviceGuard guard(rt_, device_);
    rt_.check_stream(as_stream(stream), device_);
    auto fence = ticket->fence();
    if (fence == nullptr) {
        return;
    }
    ticket->check_failure();  // a copy known to have failed is not handed to a consumer
    rt_.stream_wait_event(as_stream(stream), fence->event());
    ticket->check_failure();  // ... nor one found failed by now (the host thread waited on cpu)
}

void CopyEngine::drain(Direction& dir) noexcept {
    try {
        // An event of its own: what this submission enqueued ends before it; copies other
        // engines enqueue later on a shared stream do not.
        gpu::UniqueEvent tail(rt_, device_, false);
        gpu::DeviceGuard guard(rt_, device_);
        rt_.event_record(tail.get(), dir.stream);
        rt_.event_synchronize(tail.get());
    } catch (...) {
        // A runtime that cannot synchronize has failed as a whole: nothing of it still runs.
    }
}

void CopyEngine::synchronize() {
    std::shared_ptr<EventFence> last[2];
    {
        std::lock_guard<std::mutex> lock(submit_mutex_);
        last[0] = d2h_dir_.last;
        last[1] = h2d_dir_.last;
    }
    // Each stream runs in order: this engine's last copy on it ends after all its earlier ones.
    for (const auto& fence : last) {
        if (fence != nullptr) {
            fence->wait();  // a failed copy ended too (the ticket reports it)
        }
    }
}

void CopyEngine::account(Direction& dir) {
    while (!dir.timings.empty()) {
        bool ended = false;
        try {
            ended = dir.timings.front().end->ready();
        } catch (const RuntimeError&) {
            return;  // the runtime cannot tell now: the copy stays queued, nothing is counted
        }
        if (!ended) {
            return;
        }
        // Off the queue first, so a query that throws below cannot keep it at the head.
        const Timing t = std::move(dir.timings.front());
        dir.timings.pop_front();
        if (!t.end->failure().empty()) {
            dir.stats.failed += 1;  // moved nothing: its time and bytes are not bandwidth
            continue;
        }
        double ms = 0.0;
        try {
            ms = rt_.event_elapsed_ms(t.start->event(), t.end->event());
        } catch (const RuntimeError&) {
            dir.stats.untimed += 1;  // it moved, but bytes without a time are not bandwidth
            continue;
        }
        dir.stats.busy_s += ms / 1e3;
        dir.stats.bytes += t.bytes;
        dir.stats.copies += 1;
    }
}

DirectionStats CopyEngine::snapshot(Direction& dir) {
    gpu::DeviceGuard guard(rt_, device_);  // account() reads event times
    std::lock_guard<std::mutex> lock(stats_mutex_);
    account(dir);
    return dir.stats;
}

DirectionStats CopyEngine::d2h_stats() { return snapshot(d2h_dir_); }
DirectionStats CopyEngine::h2d_stats() { return snapshot(h2d_dir_); }

void CopyEngine::reset_stats() {
    gpu::DeviceGuard guard(rt_, device_);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    account(d2h_dir_);
    account(h2d_dir_);
    d2h_dir_.stats = DirectionStats{};
    h2d_dir_.stats = DirectionStats{};
}

}  // namespace bagualu2
