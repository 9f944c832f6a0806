// Fences: "has this piece of asynchronous work finished?", as the arena and tickets see it.
//
// Design note
// -----------
// The arena must not hand out a block again while a copy into or out of it may still be in
// flight, but it must not call the GPU runtime while holding its lock either. So a freed block
// carries a list of fences and the arena queries them with its lock released. The library's
// one kind is EventFence: it owns one gpu::Event of one runtime and device (a gpu::UniqueEvent);
// ready() is event_query, wait() is event_synchronize, each with the event's device bound, and
// destroying the fence destroys the event (a runtime call, so whoever drops the last reference
// must not hold the arena lock). Any thread may do either, the garbage collector's included:
// the thread's own binding is given back untouched (gpu/gpu.h, DeviceGuard). Tests
// add a host-signalled fence of their own (tests/test_hooks.cpp) to hold a block or a stream
// "in flight" deterministically.
// A fence is shared (std::shared_ptr) between the ticket that created it and every freed block
// that must wait for it. ready() never blocks; wait() blocks (callers release the GIL).
//
// Failure. The work behind an EventFence may fail (a copy that failed at execution: its
// runtime's event_query / event_synchronize throw bagualu2::RuntimeError). Such a fence is
// complete, not pending: ready() returns true and wait() returns, so nothing waits for it
// forever and the arena reuses the block it guarded (the work ended; on a device a failed
// asynchronous copy leaves the context in error, so nothing else runs into the block either),
// and failure() keeps the runtime's message from the first query that saw it. The owner of the
// work reports the failure (Ticket::done() / wait() throw it: copy_engine.h).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "common/check.h"
#include "gpu/gpu.h"

namespace bagualu2 {

class Fence {
public:
    virtual ~Fence() = default;

    /// Non-blocking: has the work this fence stands for completed?
    virtual bool ready() = 0;

    /// Block the calling thread until ready() would return true.
    virtual void wait() = 0;
};

// A fence backed by one runtime event.
class EventFence final : public Fence {
public:
    /// \param[in] rt      runtime that owns the event.
    /// \param[in] device  device of the event (the engine's).
    /// \param[in] timing  whether elapsed time may be measured against this event.
    EventFence(gpu::Runtime& rt, int device, bool timing)
        : rt_(rt), event_(rt, device, timing) {}

    /// True once the work completed, failed included (see failure()).
    bool ready() override {
        if (failed_.load(std::memory_order_acquire)) {
            return true;
        }
        try {
            gpu::DeviceGuard guard(rt_, event_.device());
            return rt_.event_query(event_.get());
        } catch (const RuntimeError& e) {
            fail(e.what());
            return true;
        }
    }

    /// Returns once the work completed, failed included (see failure()).
    void wait() override {
        if (failed_.load(std::memory_order_acquire)) {
            return;
        }
        try {
            gpu::DeviceGuard guard(rt_, event_.device());
            rt_.event_synchronize(event_.get());
        } catch (const RuntimeError& e) {
            fail(e.what());
        }
    }

    /// Why the work failed: "" unless a ready() or wait() found it completed failed.
    std::string failure() const {
        if (!failed_.load(std::memory_order_acquire)) {
            return {};
        }
        std::lock_guard<std::mutex> lock(mutex_);
        return failure_;
    }

    /// The wrapped event handle (owned by this fence).
    gpu::Event event() const { return event_.get(); }

private:
    void fail(const char* why) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failed_.load(std::memory_order_relaxed)) {
            failure_ = why;
            failed_.store(true, std::memory_order_release);
        }
    }

    // Runtime and the event it created.
    gpu::Runtime& rt_;
    gpu::UniqueEvent event_;
    // The failure, once seen: failed_ is set after failure_ is written (under mutex_).
    std::atomic<bool> failed_{false};
    mutable std::mutex mutex_;
    std::string failure_;
};

using FencePtr = std::shared_ptr<Fence>;

}  // namespace bagualu2
