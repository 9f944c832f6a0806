// cpu backend of the neutral gpu:: API: worker-thread streams, flag events, pooled memcpy.
//
// A stream is one worker thread running its operations in FIFO order; an operation submitted
// to an idle, empty stream (a copy, an event record, a wait already satisfied) runs at once on
// the submitting thread instead, which FIFO order allows (the worker has nothing it could start
// meanwhile). A copy is work for the cores either way, and on a machine whose cores all
// compute, a copy handed to another thread runs in time nothing measures: run inline, its time
// lands on the thread that submitted it, where the caller measures it, and it costs no wake-up
// (on the reference model's 2-core steps, offloading 5 storages cost the step 0.3 ms beyond the
// copies' measured time inline, against 0.6 to 1.0 ms on the worker). Copies queued behind
// running work still run on the worker, in order. A copy of at least kParallelMinBytes is cut
// into pieces of about kPieceBytes (512 KiB, half of a 1 MiB L2: measured faster than fewer,
// larger pieces) that a shared pool of copy threads and the thread running the copy execute
// together; the stream starts its next operation only when every piece is done, so stream
// order holds. Each record of an event is a fresh completion flag with a timestamp, which is
// all event_query / event_synchronize / event_elapsed_ms need. Every copy thread runs at the
// OS's idle priority (start_copy_thread): copies take only the cycles compute leaves.
//
// Failed copies (test-only). memcpy cannot fail, so a failure is injected through the copy
// fault switch of gpu/copy_faults.h, whose state lives here and which only the test module
// tests/test_hooks.cpp can set (its note says how it reaches it; the Python API cannot). A
// copy failed at submission throws bagualu2::RuntimeError from memcpy_async and enqueues
// nothing. A copy failed at execution is enqueued as an operation that copies nothing and
// marks its stream failed with a message; the next event record executed on that stream takes
// the message (and clears it), so that record's completion is complete *and* failed:
// event_query and event_synchronize of it throw bagualu2::RuntimeError with the message, as a
// device runtime reports a failed asynchronous copy at the next query of an event behind it.
// Later copies on the stream run normally. A wait (stream_wait_event) on a failed record ends
// like one on a good record: failures do not travel through waits (the copy engine tracks the
// one dependency it has, a reload on its offload, itself), and no waiter ever hangs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "common/check.h"
#include "gpu/copy_faults.h"
#include "gpu/gpu.h"

namespace bagualu2::gpu {
namespace {

constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kParallelMinBytes = std::size_t{1} << 20;  // below: one memcpy
constexpr std::size_t kPieceBytes = std::size_t{512} << 10;
constexpr int kSpinMicros = 50;  // polling before a copy thread sleeps

using Clock = std::chrono::steady_clock;

// Copy threads (the streams' and the pool's) are named "bagualu2-copy" and run at the OS's
// idle priority where it has one (Linux's SCHED_IDLE): they share the cores with the compute
// they stand in for a device's copy engines beside, so a copy runs on cycles compute leaves
// free instead of slowing it by an amount nothing measures. Compute that keeps every core busy
// delays the copies instead, and whoever needs one done (a reload, room for the next
// activation) waits for it, which frees a core for it: the cost of copying lands on the
// waiting thread, where it is measured. Busy time (event to event) then includes the time a
// copy thread was preempted.
void start_copy_thread() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "bagualu2-copy");
#if defined(SCHED_IDLE)
    sched_param param{};
    param.sched_priority = 0;
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);  // best effort: refused, it keeps its priority
#endif
#endif
}

// ---------------------------------------------------------------------------------------------
// Copy pool: persistent threads that help with the pieces of large copies.
class CopyPool {
public:
    static CopyPool& instance() {
        // Leaked on purpose: joining threads during interpreter shutdown is unsafe.
        static CopyPool* pool = new CopyPool();
        return *pool;
    }

    // Copies n bytes, splitting across the pool; the caller works too and returns when done.
    // Pieces are claimed dynamically and there are several per thread, so a thread that the OS
    // deschedules mid-copy (a busy machine) leaves little behind for the others to wait on.
    void copy(void* dst, const void* src, std::size_t n) {
        const std::size_t workers = threads_.size() + 1;
        if (n < kParallelMinBytes || workers < 2) {
            std::memcpy(dst, src, n);
            return;
        }
        const std::size_t pieces = std::max<std::size_t>(2, n / kPieceBytes);
        auto job = std::make_shared<Job>();
        job->dst = static_cast<char*>(dst);
        job->src = static_cast<const char*>(src);
        job->bytes = n;
        // Piece boundaries on 4 KiB multiples keep every piece page-aligned relative to dst.
        job->piece = ((n + pieces - 1) / pieces + kPageBytes - 1) / kPageBytes * kPageBytes;
        job->pieces = (n + job->piece - 1) / job->piece;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            jobs_.push_back(job);
            queued_.fetch_add(1);
        }
        cv_.notify_all();
        run_pieces(*job);
        if (spin_until([&] { return job->done.load() == job->pieces; })) {
            return;
        }
        std::unique_lock<std::mutex> lock(job->mutex);
        job->cv.wait(lock, [&] { return job->done.load() == job->pieces; });
    }

private:
    struct Job {
        // The copy and how it is cut.
        char* dst = nullptr;
        const char* src = nullptr;
        std::size_t bytes = 0;
        std::size_t piece = 0;
        std::size_t pieces = 0;
        // Progress: next piece to claim, pieces finished.
        std::atomic<std::size_t> next{0};
        std::atomic<std::size_t> done{0};
        // Completion signal for the submitting thread.
        std::mutex mutex;
        std::condition_variable cv;
    };

    CopyPool() {
        const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        const unsigned count = std::min(8u, hw - 1);  // with the stream thread: one per core
        for (unsigned i = 0; i < count; ++i) {
            threads_.emplace_back([this] {
                start_copy_thread();
                worker();
            });
            threads_.back().detach();
        }
    }

    // Copies arrive back to back and a piece lasts tens of microseconds, about what a sleeping
    // thread takes to wake up: poll briefly before sleeping (as OpenMP's workers do).
    template <typename Ready>
    static bool spin_until(Ready ready) {
        const auto until = Clock::now() + std::chrono::microseconds(kSpinMicros);
        while (!ready()) {
            if (Clock::now() >= until) {
                return false;
            }
            std::this_thread::yield();
        }
        return true;
    }

    static void run_pieces(Job& job) {
        for (;;) {
            const std::size_t i = job.next.fetch_add(1);
            if (i >= job.pieces) {
                return;
            }
            const std::size_t begin = i * job.piece;
            const std::size_t len = std::min(job.piece, job.bytes - begin);
            std::memcpy(job.dst + begin, job.src + begin, len);
            if (job.done.fetch_add(1) + 1 == job.pieces) {
                std::lock_guard<std::mutex> lock(job.mutex);
                job.cv.notify_all();
            }
        }
    }

    void worker() {
        for (;;) {
            std::shared_ptr<Job> job;
            spin_until([&] { return queued_.load() > 0; });
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [&] { return !jobs_.empty(); });
                job = jobs_.front();
                if (job->next.load() >= job->pieces) {
                    jobs_.pop_front();  // exhausted: every piece is claimed
                    queued_.fetch_sub(1);
                    continue;
                }
            }
            run_pieces(*job);
        }
    }

    // Threads and the queue of jobs with unclaimed pieces.
    std::vector<std::thread> threads_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<Job>> jobs_;
    std::atomic<std::size_t> queued_{0};  // jobs_.size(), readable without the lock
};

// ---------------------------------------------------------------------------------------------
// Events. Each record creates a fresh Completion (flag + timestamp) that the stream operation
// completes; the event points at its latest one. A wait captures the Completion current at the
// call, so re-recording the event later (even on another stream) never satisfies or delays an
// earlier wait: the semantics of cudaEventRecord / cudaStreamWaitEvent.
// A record that completes failed (a failed copy ran before it on its stream) carries why.
struct Completion {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    Clock::time_point when{};
    std::string error;  // nonempty: completed failed

    void complete(std::string why = {}) {
        std::lock_guard<std::mutex> lock(mutex);
        done = true;
        when = Clock::now();
        error = std::move(why);
        cv.notify_all();
    }

    void wait() {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return done; });
    }

    bool ready() {
        std::lock_guard<std::mutex> lock(mutex);
        return done;
    }

    // Throws bagualu2::WorkFailed when the record completed failed.
    void check() {
        std::string why;
        {
            std::lock_guard<std::mutex> lock(mutex);
            why = error;
        }
        BAGUALU2_WORK_CHECK(why.empty(), why);
    }
};

struct CpuEvent {
    std::mutex mutex;
    std::shared_ptr<Completion> latest;  // nullptr: never recorded (counts as complete)

    std::shared_ptr<Completion> current() {
        std::lock_guard<std::mutex> lock(mutex);
        return latest;
    }
};

// ---------------------------------------------------------------------------------------------
// Streams: one worker thread, FIFO operations.
class CpuStream {
public:
    CpuStream() : thread_([this] {
        start_copy_thread();
        loop();
    }) {}

    ~CpuStream() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        cv_.notify_all();
        thread_.join();  // drains queued work first
    }

    // Appends `op`; with `may_run_inline`, runs it right here instead when the stream is
    // empty and idle (the worker cannot start anything meanwhile, so FIFO order holds): the
    // design note says why copies do.
    void submit(std::function<void()> op, bool may_run_inline) {
        bool wake = false;
        bool run_here = false;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++enqueued_;
            if (!may_run_inline || running_ || !queue_.empty()) {
                queue_.push_back(std::move(op));
                // Wake the worker only for the first operation it will find: a copy enqueues
                // several operations back to back and one wake-up serves them all.
                wake = idle_ && queue_.size() == 1;
            } else {
                running_ = true;
                run_here = true;
            }
        }
        if (run_here) {
            run(op);
            {
                std::lock_guard<std::mutex> lock(mutex_);
                running_ = false;
                ++executed_;
                wake = !queue_.empty();
            }
            done_cv_.notify_all();
        }
        if (wake) {
            cv_.notify_one();
        }
    }

    void synchronize() {
        std::unique_lock<std::mutex> lock(mutex_);
        const std::uint64_t target = enqueued_;
        done_cv_.wait(lock, [&] { return executed_ >= target; });
    }

    // A failed copy's operation marks the stream failed; the next event record's operation
    // takes the message. Only operations call these, and they run one at a time, in order
    // (the stream's mutex orders them), so error_ needs no lock of its own.
    void fail(std::string why) {
        if (error_.empty()) {
            error_ = std::move(why);
        }
    }
    std::string take_error() {
        std::string why;
        why.swap(error_);  // leaves error_ empty (a moved-from string need not be)
        return why;
    }

private:
    static void run(std::function<void()>& op) {
        try {
            op();
        } catch (...) {
            // Operations are memcpy, event completion and C++ host functions; none throws by
            // contract, and a worker thread must not die with an exception.
        }
    }

    void loop() {
        for (;;) {
            std::function<void()> op;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                idle_ = true;
                cv_.wait(lock, [&] { return !running_ && (stopping_ || !queue_.empty()); });
                idle_ = false;
                if (queue_.empty()) {
                    return;  // stopping and drained
                }
                op = std::move(queue_.front());
                queue_.pop_front();
                running_ = true;
            }
            run(op);
            {
                std::lock_guard<std::mutex> lock(mutex_);
                running_ = false;
                ++executed_;
            }
            done_cv_.notify_all();
        }
    }

    // Queue state, guarded by mutex_.
    std::mutex mutex_;
    std::condition_variable cv_;
    std::condition_variable done_cv_;
    std::deque<std::function<void()>> queue_;
    std::uint64_t enqueued_ = 0;
    std::uint64_t executed_ = 0;
    bool idle_ = false;     // the worker is waiting for work
    bool running_ = false;  // an operation is executing (on the worker or inline)
    bool stopping_ = false;
    // Set by a failed copy's operation, taken by the next event record's (see fail()).
    std::string error_;
    // The worker (declared last: it starts after the fields above exist).
    std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
class CpuRuntime final : public Runtime {
public:
    const char* name() const override { return "cpu"; }
    bool is_host() const override { return true; }
    int device_count() override { return 1; }
    int get_device() override { return 0; }
    std::uintptr_t bind(int device) override {
        BAGUALU2_CHECK(device == 0, "the cpu backend has one device (0), got ", device);
        return 0;
    }
    void restore(std::uintptr_t /*previous*/) override {}

    void* host_alloc(std::size_t bytes) override {
        BAGUALU2_CHECK(bytes > 0, "host_alloc of 0 bytes");
        const std::size_t rounded = (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
        void* ptr = std::aligned_alloc(kPageBytes, rounded);
        BAGUALU2_RUNTIME_CHECK(ptr != nullptr, "cpu host_alloc of ", bytes, " bytes failed");
        // Touch every page now so copies never page-fault (the cpu stand-in for pinning).
        std::memset(ptr, 0, rounded);
        return ptr;
    }

    void host_free(void* ptr) override { std::free(ptr); }

    Stream stream_create() override {
        check_not_forked(born_, "cpu");
        auto* stream = new CpuStream();
        std::lock_guard<std::mutex> lock(registry_mutex_);
        streams_.insert(stream);
        return stream;
    }

    void stream_destroy(Stream stream) override {
        check_stream(stream, 0);
        {
            std::lock_guard<std::mutex> lock(registry_mutex_);
            streams_.erase(stream);
        }
        delete static_cast<CpuStream*>(stream);
    }

    void check_stream(Stream stream, int /*device*/) override {
        if (stream == nullptr) {
            return;
        }
        std::lock_guard<std::mutex> lock(registry_mutex_);
        BAGUALU2_CHECK(streams_.count(stream) == 1, "0x", std::hex,
                       reinterpret_cast<std::uintptr_t>(stream),
                       " is not a live stream of the cpu backend");
    }

    void stream_synchronize(Stream stream) override {
        check_not_forked(born_, "cpu");
        if (stream != nullptr) {
            static_cast<CpuStream*>(stream)->synchronize();
        }
    }

    void stream_wait_event(Stream stream, Event event) override {
        check_not_forked(born_, "cpu");
        auto target = static_cast<CpuEvent*>(event)->current();
        if (target == nullptr) {
            return;  // never recorded: nothing to wait for
        }
        if (stream == nullptr) {
            target->wait();  // the host thread is the stream: wait here
            return;
        }
        const bool ready = target->ready();
        static_cast<CpuStream*>(stream)->submit([target] { target->wait(); }, ready);
    }

    Event event_create(bool /*timing*/) override { return new CpuEvent(); }

    void event_destroy(Event event) override { delete static_cast<CpuEvent*>(event); }

    void event_record(Event event, Stream stream) override {
        check_not_forked(born_, "cpu");
        auto* ev = static_cast<CpuEvent*>(event);
        auto completion = std::make_shared<Completion>();
        {
            std::lock_guard<std::mutex> lock(ev->mutex);
            ev->latest = completion;
        }
        if (stream == nullptr) {
            completion->complete();
            return;
        }
        auto* s = static_cast<CpuStream*>(stream);
        s->submit([completion, s] { completion->complete(s->take_error()); }, true);
    }

    bool event_query(Event event) override {
        auto c = static_cast<CpuEvent*>(event)->current();
        if (c == nullptr) {
            return true;
        }
        if (!c->ready()) {
            return false;
        }
        c->check();  // a record behind a failed copy: throws its message
        return true;
    }

    void event_synchronize(Event event) override {
        check_not_forked(born_, "cpu");
        auto c = static_cast<CpuEvent*>(event)->current();
        if (c != nullptr) {
            c->wait();
            c->check();
        }
    }

    double event_elapsed_ms(Event start, Event end) override {
        auto a = static_cast<CpuEvent*>(start)->current();
        auto b = static_cast<CpuEvent*>(end)->current();
        BAGUALU2_CHECK(a != nullptr && a->ready(), "event_elapsed_ms: start event has not completed");
        BAGUALU2_CHECK(b != nullptr && b->ready(), "event_elapsed_ms: end event has not completed");
        Clock::time_point ta;
        Clock::time_point tb;
        {
            std::lock_guard<std::mutex> lock(a->mutex);
            ta = a->when;
        }
        {
            std::lock_guard<std::mutex> lock(b->mutex);
            tb = b->when;
        }
        return std::chrono::duration<double, std::milli>(tb - ta).count();
    }

    void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream stream) override {
        check_not_forked(born_, "cpu");
        if (bytes == 0) {
            return;
        }
        const CopyFault fault = claim_copy_fault();  // test-only: kNone unless a test armed it
        BAGUALU2_RUNTIME_CHECK(fault != CopyFault::kSubmit, "cpu memcpy_async of ", bytes,
                               " bytes failed at submission: injected fault (test switch)");
        BAGUALU2_RUNTIME_CHECK(fault != CopyFault::kExecute || stream != nullptr, "cpu copy of ",
                               bytes, " bytes on the calling thread failed: injected fault (test "
                               "switch)");
        if (fault == CopyFault::kExecute) {
            auto* s = static_cast<CpuStream*>(stream);
            s->submit(
                [s, bytes] {
                    s->fail("cpu copy of " + std::to_string(bytes) +
                            " bytes failed at execution: injected fault (test switch)");
                },
                true);
            return;
        }
        if (stream == nullptr) {
            CopyPool::instance().copy(dst, src, bytes);
            return;
        }
        static_cast<CpuStream*>(stream)->submit(
            [dst, src, bytes] { CopyPool::instance().copy(dst, src, bytes); }, true);
    }

    void launch_host_func(Stream stream, std::function<void()> fn) override {
        check_not_forked(born_, "cpu");
        if (stream == nullptr) {
            fn();
            return;
        }
        static_cast<CpuStream*>(stream)->submit(std::move(fn), false);  // may block
    }

private:
    // The fork generation this runtime was created in: its worker threads and copy pool exist
    // only there (gpu.h, "Fork").
    const std::uint64_t born_ = fork_generation();
    // Live streams, so handles coming from Python can be checked.
    std::mutex registry_mutex_;
    std::unordered_set<Stream> streams_;
};

}  // namespace

Runtime& cpu_runtime() {
    static CpuRuntime* rt = new CpuRuntime();  // leaked: outlives every stream and event
    return *rt;
}

// ---------------------------------------------------------------------------------------------
// The test-only copy fault switch (gpu/copy_faults.h). `armed` is the fast path of every copy;
// the rest is read and changed under the mutex.
namespace {

struct FaultSwitch {
    std::atomic<bool> armed{false};
    std::mutex mutex;
    CopyFault mode = CopyFault::kNone;
    long long after = 0;  // copies still let through before the faults
    long long count = 0;  // faults still to inject
};

FaultSwitch& fault_switch() {
    static FaultSwitch* state = new FaultSwitch();  // leaked: copies may run at exit
    return *state;
}

}  // namespace

CopyFault claim_copy_fault() {
    FaultSwitch& f = fault_switch();
    if (!f.armed.load(std::memory_order_acquire)) {
        return CopyFault::kNone;
    }
    std::lock_guard<std::mutex> lock(f.mutex);
    if (f.count == 0) {
        return CopyFault::kNone;
    }
    if (f.after > 0) {
        --f.after;
        return CopyFault::kNone;
    }
    if (--f.count == 0) {
        f.armed.store(false, std::memory_order_release);
    }
    return f.mode;
}

}  // namespace bagualu2::gpu

extern "C" int bagualu2_test_set_copy_faults(int mode, long long count, long long after) {
    using bagualu2::gpu::CopyFault;
    if (mode < 0 || mode > 2 || count < 0 || after < 0) {
        return -1;
    }
    auto& f = bagualu2::gpu::fault_switch();
    std::lock_guard<std::mutex> lock(f.mutex);
    const bool arm = mode != 0 && count > 0;
    f.mode = arm ? static_cast<CopyFault>(mode) : CopyFault::kNone;
    f.count = arm ? count : 0;
    f.after = arm ? after : 0;
    f.armed.store(arm, std::memory_order_release);
    return 0;
}

extern "C" long long bagualu2_test_copy_faults_left() {
    auto& f = bagualu2::gpu::fault_switch();
    std::lock_guard<std::mutex> lock(f.mutex);
    return f.count;
}
