// Fences: "has this piece of asynchronous work finished?", as the arena and tickets see it.
//
// Design note
// -----------
// The arena must not hand out a block again while a copy into or out of it may still be in
// flight, but it must not call the GPU runtime while holding its lock either. So a freed block
// carries a list of fences and the arena queries them with its lock released. The library's
// one kind is EventFence: it uses one gpu::Event of one runtime and device, taken from an
// EventPool (below); ready() is event_query, wait() is event_synchronize, each with the event's
// device bound, and destroying the fence gives the event back to the pool (no runtime call;
// the last reference to a pool destroys its events, so whoever may drop it must not hold the
// arena lock). Any thread may do either, the garbage collector's included: the thread's own
// binding is given back untouched (gpu/gpu.h, DeviceGuard). Tests
// add a host-signalled fence of their own (tests/test_hooks.cpp) to hold a block or a stream
// "in flight" deterministically.
// A fence is shared (std::shared_ptr) between the ticket that created it and every freed block
// that must wait for it. ready() never blocks; wait() blocks (callers release the GIL).
//
// Failure. The work behind an EventFence may fail (a copy that failed at execution). Only a
// completion query that reports exactly that, bagualu2::WorkFailed (common/check.h: the runtime
// says the work before the event failed on the device, so it ended), makes the fence complete
// and failed: ready() returns true and wait() returns, so nothing waits for it forever and the
// arena reuses the block it guarded, and failure() keeps the runtime's message from the first
// query that saw it. The owner of the work reports the failure (Ticket::done() / wait() throw
// it: copy_engine.h). Any other error (the bind failed, the driver was deinitialised, the
// context or the event is invalid) says nothing about whether the DMA still runs: ready() and
// wait() throw it, and the arena, which cannot tell either, keeps the block pending
// (host_arena.h, invariant 4): leaking a block is safe, reusing one a copy may still write is
// not.
//
// Events. A copy brackets itself with two timing events; creating and destroying them per
// copy would be two driver calls each, thousands a step. An EventPool keeps the events of one
// runtime and device: a fence takes one from it and gives it back when the fence dies (a
// re-record starts a fresh completion for whoever records it next, and a wait enqueued
// earlier keeps the record current at its call, in every runtime). The pool destroys its
// events, with its device bound, when the last fence and its engine are gone.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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

// The timing events of one runtime and device, reused (see "Events" above). Thread-safe.
class EventPool {
public:
    /// \param[in] rt      runtime that creates the events.
    /// \param[in] device  their device.
    EventPool(gpu::Runtime& rt, int device) : rt_(rt), device_(device) {}

    ~EventPool() {
        for (gpu::Event event : free_) {
            try {
                gpu::DeviceGuard guard(rt_, device_);
                rt_.event_destroy(event);
            } catch (...) {
                // A destructor must not throw; a failing runtime at teardown leaks the event.
            }
        }
    }
    EventPool(const EventPool&) = delete;
    EventPool& operator=(const EventPool&) = delete;

    /// A timing event of the pool's device: a free one, or a new one.
    gpu::Event acquire() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!free_.empty()) {
                gpu::Event event = free_.back();
                free_.pop_back();
                return event;
            }
        }
        gpu::DeviceGuard guard(rt_, device_);
        return rt_.event_create(true);
    }

    /// Take back an event acquire() returned (no runtime call).
    void give_back(gpu::Event event) noexcept {
        try {
            std::lock_guard<std::mutex> lock(mutex_);
            free_.push_back(event);
        } catch (...) {
            // Out of memory for the list: the event leaks, nothing else breaks.
        }
    }

    gpu::Runtime& runtime() const { return rt_; }
    int device() const { return device_; }

private:
    // Runtime, device and the events not in use, guarded by mutex_.
    gpu::Runtime& rt_;
    int device_;
    std::mutex mutex_;
    std::vector<gpu::Event> free_;
};

// A fence backed by one runtime event, taken from a pool and given back when the fence dies.
class EventFence final : public Fence {
public:
    /// \param[in] pool  the events of the engine's runtime and device (kept alive by the fence).
    explicit EventFence(std::shared_ptr<EventPool> pool)
        : pool_(std::move(pool)), rt_(pool_->runtime()), event_(pool_->acquire()) {}
    ~EventFence() override { pool_->give_back(event_); }
    EventFence(const EventFence&) = delete;
    EventFence& operator=(const EventFence&) = delete;

    /// True once the work completed, failed included (see failure()); throws what the runtime
    /// said when it could not tell.
    bool ready() override {
        if (failed_.load(std::memory_order_acquire)) {
            return true;
        }
        try {
            gpu::DeviceGuard guard(rt_, pool_->device());
            return rt_.event_query(event_);
        } catch (const WorkFailed& e) {
            fail(e.what());
            return true;
        }
    }

    /// Returns once the work completed, failed included (see failure()); throws what the
    /// runtime said when it could not tell.
    void wait() override {
        if (failed_.load(std::memory_order_acquire)) {
            return;
        }
        try {
            gpu::DeviceGuard guard(rt_, pool_->device());
            rt_.event_synchronize(event_);
        } catch (const WorkFailed& e) {
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

    /// The wrapped event handle (the pool's, used by this fence until it dies).
    gpu::Event event() const { return event_; }

private:
    void fail(const char* why) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failed_.load(std::memory_order_relaxed)) {
            failure_ = why;
            failed_.store(true, std::memory_order_release);
        }
    }

    // The pool, its runtime and the event taken from it.
    std::shared_ptr<EventPool> pool_;
    gpu::Runtime& rt_;
    gpu::Event event_;
    // The failure, once seen: failed_ is set after failure_ is written (under mutex_).
    std::atomic<bool> failed_{false};
    mutable std::mutex mutex_;
    std::string failure_;
};

using FencePtr = std::shared_ptr<Fence>;

}  // namespace bagualu2
