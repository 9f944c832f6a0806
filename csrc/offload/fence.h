// Fences: "has this piece of asynchronous work finished?", as the arena and tickets see it.
//
// Design note
// -----------
// The arena must not hand out a block again while a copy into or out of it may still be in
// flight, but it must not call the GPU runtime while holding its lock either. So a freed block
// carries a list of fences and the arena queries them with its lock released. Two kinds exist:
//   * EventFence: owns one gpu::Event of one runtime; ready() is event_query, wait() is
//     event_synchronize; destroying the fence destroys the event (a runtime call, so whoever
//     drops the last reference must not hold the arena lock).
//   * HostFence: a flag set by host code (signal()); used by tests to hold a block or a stream
//     "in flight" deterministically, and by host-side consumers of a block.
// A fence is shared (std::shared_ptr) between the ticket that created it and every freed block
// that must wait for it. ready() never blocks; wait() blocks (callers release the GIL).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

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
    /// \param[in] timing  whether elapsed time may be measured against this event.
    EventFence(gpu::Runtime& rt, bool timing) : rt_(rt), event_(rt.event_create(timing)) {}
    ~EventFence() override {
        try {
            rt_.event_destroy(event_);
        } catch (...) {
            // A destructor must not throw; a failing runtime at teardown leaks one event.
        }
    }
    EventFence(const EventFence&) = delete;
    EventFence& operator=(const EventFence&) = delete;

    bool ready() override { return rt_.event_query(event_); }
    void wait() override { rt_.event_synchronize(event_); }

    /// The wrapped event handle (owned by this fence).
    gpu::Event event() const { return event_; }

private:
    // Runtime and the event it created.
    gpu::Runtime& rt_;
    gpu::Event event_;
};

// A fence completed by host code calling signal().
class HostFence final : public Fence {
public:
    bool ready() override { return signalled_.load(std::memory_order_acquire); }

    void wait() override {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return signalled_.load(std::memory_order_acquire); });
    }

    /// Mark the fence complete and wake every waiter (idempotent).
    void signal() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            signalled_.store(true, std::memory_order_release);
        }
        cv_.notify_all();
    }

private:
    // The flag and the wake-up machinery for wait().
    std::atomic<bool> signalled_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
};

using FencePtr = std::shared_ptr<Fence>;

}  // namespace bagualu2
