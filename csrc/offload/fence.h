// Fences: "has this piece of asynchronous work finished?", as the arena and tickets see it.
//
// Design note
// -----------
// The arena must not hand out a block again while a copy into or out of it may still be in
// flight, but it must not call the GPU runtime while holding its lock either. So a freed block
// carries a list of fences and the arena queries them with its lock released. The library's
// one kind is EventFence: it owns one gpu::Event of one runtime (a gpu::UniqueEvent);
// ready() is event_query, wait() is event_synchronize; destroying the fence destroys the event
// (a runtime call, so whoever drops the last reference must not hold the arena lock). Tests
// add a host-signalled fence of their own (tests/test_hooks.cpp) to hold a block or a stream
// "in flight" deterministically.
// A fence is shared (std::shared_ptr) between the ticket that created it and every freed block
// that must wait for it. ready() never blocks; wait() blocks (callers release the GIL).
#pragma once

#include <memory>

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
    EventFence(gpu::Runtime& rt, bool timing) : rt_(rt), event_(rt, timing) {}

    bool ready() override { return rt_.event_query(event_.get()); }
    void wait() override { rt_.event_synchronize(event_.get()); }

    /// The wrapped event handle (owned by this fence).
    gpu::Event event() const { return event_.get(); }

private:
    // Runtime and the event it created.
    gpu::Runtime& rt_;
    gpu::UniqueEvent event_;
};

using FencePtr = std::shared_ptr<Fence>;

}  // namespace bagualu2
