// Python bindings of the offload component: HostArena, CopyEngine, Ticket, fences.
//
// Test-only types (a Python-owned stream, a host-signalled fence) are not here: they live in
// the test module tests/test_hooks.cpp, beside the tests that use them.
//
// Addresses and stream handles cross as Python ints. Blocking calls release the GIL; the
// non-blocking ones (allocate, offload, reload submission) keep it, since they only take short
// locks and enqueue work, and releasing it would cost more than they do.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "bindings/registry.h"
#include "common/check.h"
#include "gpu/gpu.h"
#include "offload/copy_engine.h"
#include "offload/fence.h"
#include "offload/host_arena.h"

namespace py = pybind11;

namespace bagualu2 {
namespace {

// An offload ticket's block as a writable byte buffer (the Python buffer protocol), holding
// the block allocated while the buffer lives: torch.frombuffer keeps it for as long as the
// tensor's storage lives.
struct HostView {
    std::shared_ptr<void> hold;
    std::size_t nbytes;
};

py::dict arena_stats_dict(const ArenaStats& s) {
    py::dict d;
    d["capacity"] = s.capacity;
    d["max_capacity"] = s.max_capacity;
    d["segments"] = s.segments;
    d["in_use"] = s.in_use;
    d["pending"] = s.pending;
    d["peak_in_use"] = s.peak_in_use;
    d["largest_free_block"] = s.largest_free_block;
    d["free"] = s.free_bytes;
    d["fragmentation"] = s.fragmentation;
    d["num_blocks"] = s.num_blocks;
    d["num_allocs"] = s.num_allocs;
    d["num_frees"] = s.num_frees;
    d["num_failed"] = s.num_failed;
    return d;
}

py::list engine_trace_list(CopyEngine& engine) {
    py::list out;
    for (const TraceEntry& e : engine.trace()) {
        py::dict d;
        d["seq"] = e.seq;
        d["direction"] = e.h2d ? "h2d" : "d2h";
        d["host_ptr"] = e.host_ptr;
        d["nbytes"] = e.nbytes;
        d["submit_s"] = e.submit_s;
        out.append(std::move(d));
    }
    return out;
}

py::dict engine_stats_dict(CopyEngine& engine) {
    py::dict d;
    const DirectionStats dirs[2] = {engine.d2h_stats(), engine.h2d_stats()};
    const char* names[2] = {"d2h", "h2d"};
    for (int i = 0; i < 2; ++i) {
        const std::string p = names[i];
        d[(p + "_bytes").c_str()] = dirs[i].bytes;
        d[(p + "_copies").c_str()] = dirs[i].copies;
        d[(p + "_busy_s").c_str()] = dirs[i].busy_s;
        d[(p + "_bytes_submitted").c_str()] = dirs[i].bytes_submitted;
        d[(p + "_failed").c_str()] = dirs[i].failed;
        d[(p + "_untimed").c_str()] = dirs[i].untimed;
        d[(p + "_GBps").c_str()] =
            dirs[i].busy_s > 0 ? static_cast<double>(dirs[i].bytes) / dirs[i].busy_s / 1e9 : 0.0;
    }
    return d;
}

}  // namespace

void register_offload(py::module_& m) {
    py::class_<Fence, std::shared_ptr<Fence>>(m, "Fence",
                                              "Completion of asynchronous work (ready / wait).")
        .def("ready", &Fence::ready, "Non-blocking: has the work completed?")
        .def("wait", &Fence::wait, py::call_guard<py::gil_scoped_release>(),
             "Block until the work completed (GIL released).");

    py::class_<EventFence, Fence, std::shared_ptr<EventFence>>(m, "EventFence",
                                                                "A fence backed by a runtime event.");

    py::class_<HostArena, std::shared_ptr<HostArena>>(m, "HostArena",
                                                      "Pinned host reservation with best-fit blocks.")
        .def(py::init([](std::int64_t capacity, const std::string& backend,
                         std::int64_t max_capacity, int device) {
                 BAGUALU2_CHECK(capacity > 0, "HostArena capacity must be positive, got ",
                                capacity);
                 BAGUALU2_CHECK(max_capacity >= 0,
                                "HostArena max_capacity must be >= 0 (0: no growth), got ",
                                max_capacity);
                 return std::make_shared<HostArena>(static_cast<std::size_t>(capacity), backend,
                                                    static_cast<std::size_t>(max_capacity),
                                                    device);
             }),
             py::arg("capacity_bytes"), py::arg("backend") = "cpu", py::arg("max_capacity") = 0,
             py::arg("device") = -1)
        .def_property_readonly("device", &HostArena::device)
        .def_property_readonly("capacity", &HostArena::capacity)
        .def_property_readonly("max_capacity", &HostArena::max_capacity)
        .def_property_readonly("base", &HostArena::base)
        .def_property_readonly("segments", &HostArena::segments,
                               "(base address, bytes) of every reserved segment, oldest first.")
        .def_property_readonly("backend", &HostArena::backend)
        .def_property_readonly_static("alignment",
                                      [](py::object) { return HostArena::kAlignment; })
        .def(
            "allocate",
            [](HostArena& a, std::int64_t nbytes) -> py::object {
                BAGUALU2_CHECK(nbytes > 0, "HostArena.allocate: nbytes must be positive, got ",
                               nbytes);
                void* p = a.allocate(static_cast<std::size_t>(nbytes));
                if (p == nullptr) {
                    return py::none();
                }
                return py::int_(reinterpret_cast<std::uintptr_t>(p));
            },
            py::arg("nbytes"), "Address of a new block, or None when no free block fits.")
        .def(
            "reserve",
            [](HostArena& a, std::int64_t nbytes) {
                BAGUALU2_CHECK(nbytes >= 0, "HostArena.reserve: nbytes must be >= 0, got ", nbytes);
                py::gil_scoped_release unlocked;  // pinning gigabytes takes a while
                return a.reserve(static_cast<std::size_t>(nbytes));
            },
            py::arg("nbytes"),
            "Grow the capacity to nbytes now (max_capacity at most); whether it holds that much.")
        .def(
            "free",
            [](HostArena& a, std::uintptr_t ptr, std::vector<FencePtr> after) {
                a.free(reinterpret_cast<void*>(ptr), std::move(after));
            },
            py::arg("ptr"), py::arg("after") = std::vector<FencePtr>{},
            "Free a block; with fences it is reused only after all of them are ready.")
        .def(
            "block_size",
            [](HostArena& a, std::uintptr_t ptr) { return a.block_size(reinterpret_cast<void*>(ptr)); },
            py::arg("ptr"))
        .def("stats", [](HostArena& a) { return arena_stats_dict(a.stats()); })
        .def("reset_stats", &HostArena::reset_stats);

    py::class_<HostView>(m, "HostView", py::buffer_protocol(),
                         "An offloaded block's bytes in place; holds the block while alive.")
        .def_buffer([](HostView& v) {
            return py::buffer_info(v.hold.get(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(v.nbytes)}, {1});
        })
        .def_property_readonly("nbytes", [](const HostView& v) { return v.nbytes; });

    py::class_<Ticket, std::shared_ptr<Ticket>>(m, "Ticket", "One asynchronous copy.")
        .def("done", &Ticket::done,
             "Whether the copy completed; raises RuntimeError once it ended failed.")
        .def("wait", &Ticket::wait, py::call_guard<py::gil_scoped_release>(),
             "Block until the copy completed (GIL released); raises RuntimeError if it failed.")
        .def("release", &Ticket::release)
        .def(
            "host_view", [](Ticket& t) { return HostView{t.hold(), t.nbytes()}; },
            "The offloaded bytes in place (buffer protocol), holding the block while alive; "
            "release() meanwhile frees it when the view dies.")
        .def_property_readonly("released", &Ticket::released)
        .def_property_readonly("nbytes", &Ticket::nbytes)
        .def_property_readonly("host_ptr", &Ticket::host_ptr)
        .def_property_readonly("is_offload",
                               [](const Ticket& t) { return t.kind() == Ticket::Kind::kOffload; })
        .def_property_readonly("fence", &Ticket::fence)
        .def_property_readonly(
            "finished",
            [](const Ticket& t) {
                auto fence = t.fence();
                try {
                    return fence == nullptr || fence->ready();
                } catch (const RuntimeError&) {
                    return false;  // the runtime cannot tell: what the copy uses stays held
                }
            },
            "Whether the copy completed (failed included); unlike done() also answers after "
            "release(). False while the runtime cannot tell (done() raises its error).")
        .def_property_readonly(
            "failure",
            [](const Ticket& t) -> std::optional<std::string> {
                std::string why = t.failure();
                if (why.empty()) {
                    return std::nullopt;
                }
                return why;
            },
            "Why the copy failed (what done() and wait() raise), or None while it runs or when "
            "it succeeded.");

    py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine",
                                                        "Async D2H/H2D copies into a HostArena.")
        .def(py::init([](std::shared_ptr<HostArena> arena, const std::string& backend, int device,
                         std::optional<std::size_t> chunk_bytes) {
                 return std::make_shared<CopyEngine>(
                     std::move(arena), backend, device,
                     chunk_bytes.value_or(CopyEngine::default_chunk_bytes(backend)));
             }),
             py::arg("arena"), py::arg("backend") = "cpu", py::arg("device") = -1,
             py::arg("chunk_bytes") = py::none(),
             "chunk_bytes: largest single memcpy enqueued (None: the backend's default)")
        .def("offload", &CopyEngine::offload, py::arg("src"), py::arg("nbytes"),
             py::arg("producer_stream") = 0, py::call_guard<py::gil_scoped_release>(),
             "Ticket of a copy of [src, src+nbytes) into a new block, or None if the arena is full.")
        .def("reload", &CopyEngine::reload, py::arg("ticket"), py::arg("dst"),
             py::arg("dst_capacity"), py::arg("consumer_stream") = 0,
             py::arg("consumer_waits") = true, py::call_guard<py::gil_scoped_release>())
        .def("wait_on", &CopyEngine::wait_on, py::arg("ticket"), py::arg("stream"),
             py::call_guard<py::gil_scoped_release>())
        .def("synchronize", &CopyEngine::synchronize, py::call_guard<py::gil_scoped_release>())
        .def("stats", &engine_stats_dict)
        .def("reset_stats", &CopyEngine::reset_stats)
        .def("start_trace", &CopyEngine::start_trace, py::arg("capacity") = 1 << 16,
             "Record every submitted copy from now on (clears an earlier trace).")
        .def("stop_trace", &CopyEngine::stop_trace)
        .def("trace", &engine_trace_list,
             "Copies submitted since start_trace(), in submission order: dicts with seq, "
             "direction ('d2h'/'h2d'), host_ptr, nbytes, submit_s.")
        .def_property_readonly("trace_dropped", &CopyEngine::trace_dropped)
        .def_property_readonly("d2h_stream", &CopyEngine::d2h_stream)
        .def_property_readonly("h2d_stream", &CopyEngine::h2d_stream)
        .def_property_readonly("device", &CopyEngine::device)
        .def_property_readonly("chunk_bytes", &CopyEngine::chunk_bytes)
        .def_property_readonly("backend", &CopyEngine::backend)
        .def_property_readonly("arena", &CopyEngine::arena);
}

}  // namespace bagualu2
