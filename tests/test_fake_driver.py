"""The shipped cuda backend against a stand-in CUDA driver (tests/fake_driver/fake_cuda.cpp),
loaded through BAGUALU2_CUDA_LIBRARY in a fresh process (tests/fake_driver/scenarios.py): the
GPU path's context, stream-lifetime and ordering rules (csrc/gpu/gpu.h, csrc/offload/
copy_engine.h), checked on a machine without a GPU. Every scenario uses devices 1 and 2 of three,
so any touch of device 0 shows in the driver's counters."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bagualu2_test_hooks as hooks
from bagualu2 import _C

pytestmark = pytest.mark.skipif("cuda" not in _C.backends(), reason="a build without the cuda backend")

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def observed() -> dict:
    # Built beside the test hooks by the same (in-place / editable) build.
    library = Path(hooks.__file__).resolve().parent / "libbagualu2_fake_cuda.so"
    assert library.exists(), f"{library} missing: rebuild in place (python setup.py build_ext --inplace)"
    env = {**os.environ, "BAGUALU2_CUDA_LIBRARY": str(library), "BAGUALU2_FAKE_CUDA_DEVICES": "3",
           "PYTHONPATH": os.pathsep.join([str(Path(hooks.__file__).resolve().parent),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, str(TESTS / "fake_driver" / "scenarios.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_shipped_cuda_backend_loaded_the_stand_in(observed: dict) -> None:
    status = observed["status"]
    assert status["usable"] and "libbagualu2_fake_cuda" in status["library"], status


def test_no_context_on_device_0_from_any_thread(observed: dict) -> None:
    """An engine and arena on device 2, used and finalized on threads with no context or with
    device 1's: device 0's primary context is never retained nor made current."""
    driver = observed["driver"]
    assert driver["retains"][0] == 0 and driver["ever_current"][0] == 0, driver
    assert driver["violations"] == 0, driver["violation_text"]


def test_the_loader_took_the_versioned_entry_points(observed: dict) -> None:
    """The stand-in exports cuStreamDestroy and cuStreamDestroy_v2 (and the other pairs), as a
    real libcuda does, and lists a call of a plain one: none was made."""
    assert "plain entry point" not in observed["driver"]["violation_text"]


def test_nothing_is_left_after_teardown(observed: dict) -> None:
    """Every event, pinned and device allocation the scenarios made is gone once their objects
    are; what is left is what lives as long as the process on purpose: the primary contexts of
    the devices used (1 and 2) and their process-wide copy streams, two per device."""
    live = observed["live_after_teardown"]
    assert live["events"] == 0 and live["host"] == 0 and live["device"] == 0, live
    assert live["contexts"] == 2 and live["streams"] == [0, 2, 2], live


def test_a_fence_the_driver_cannot_answer_keeps_its_block(observed: dict) -> None:
    """Issue #58, 4: a deinitialised driver (one entry point, or every one: the bind fails too)
    says nothing about a copy in flight, so its block is not handed out again until the copy
    is known to have ended; a failure of the work itself (ILLEGAL_ADDRESS) ends it."""
    fe = observed["fence_errors"]
    for case in ("query_deinitialized", "driver_deinitialized"):
        assert "DEINITIALIZED" in fe[case]["done"], fe[case]
        assert fe[case]["handed_out_while_copy_held"] is False, fe[case]
        assert fe[case]["handed_out_after_copy_ended"] is True, fe[case]
    illegal = fe["query_illegal_address"]
    assert "ILLEGAL_ADDRESS" in illegal["done"] and illegal["handed_out_while_copy_held"] is True, illegal


def test_a_failed_timing_query_costs_one_copys_time_only(observed: dict) -> None:
    """Issue #58, 5: the elapsed-time query failing inside the driver once does not wedge the
    engine: later copies and stats() work, the copy is counted as untimed."""
    tf = observed["timing_failure"]
    assert tf["first_copy"] == tf["stats_after"] == tf["second_copy"] == tf["stats_again"] == "", tf
    assert tf["d2h"] == {"copies": 1, "untimed": 1, "bytes": 1 << 16, "failed": 0}, tf


def test_engines_sharing_streams_wait_only_for_their_own_copies(observed: dict) -> None:
    """Issue #58, 6: engine A's synchronize and destructor return while engine B's copy on the
    stream they share is held."""
    ss = observed["shared_streams"]
    assert ss["same_streams"]
    assert ss["a_synchronize_returned_while_b_held"] is True, ss
    assert ss["a_destroyed_while_b_held"] is True, ss
    assert ss["b_done_while_held"] is False, ss


def test_copies_reuse_their_timing_events(observed: dict) -> None:
    """Issue #58, 7: after a warm-up, round trips create no driver events."""
    ep = observed["event_pool"]
    assert ep["exact"] and ep["created_in_20_round_trips"] == 0, ep


def test_a_misaligned_reservation_is_given_back(observed: dict) -> None:
    """Issue #58, 11: host_alloc returning memory off the arena's alignment fails the call and
    frees the reservation (at construction and when growing)."""
    mr = observed["misaligned_reservation"]
    assert "not aligned" in mr["construct"] and "not aligned" in mr["grow"], mr
    assert mr["left_by_construct"] == 0 and mr["left_by_grow"] == 0, mr


def test_a_forked_child_refuses_before_reaching_the_driver(observed: dict) -> None:
    """Issue #58, 10: in a child forked after the runtime was created, the parent's engine, a
    new engine and a new arena all refuse, saying why, and the child makes no driver call."""
    fc = observed["fork_child"]
    child = fc["child"]
    for what in ("offload", "new_engine", "new_arena"):
        assert "forked" in child[what] and "spawn" in child[what], child
    assert child["driver_calls"] == 0, child
    assert fc["parent_after"] is True


def test_the_device0_probe_asks_the_driver(observed: dict) -> None:
    """Issue #58, 8: the selftest's device>0 probe reads device 0's primary context state from
    the driver: inactive in a process that never touched it, active for device 2."""
    assert observed["primary_contexts"] == {"device0": False, "device2": True}


def test_the_stand_in_refuses_wrong_memory_kinds_host_function_calls_and_plain_names(observed: dict) -> None:
    """The double is strict: an async copy from pageable or another device's memory, a CUDA
    call inside a host function and a call of a plain entry point are refused or listed."""
    strict = observed["the_stand_in_is_strict"]
    assert "INVALID_VALUE" in strict["pageable"] and "INVALID_VALUE" in strict["other_device"], strict
    assert strict["launch"] == 0 and strict["inside_host_function"] == [800], strict
    assert strict["plain_destroy"] == 0
    assert strict["new_violations"] == 4, strict


def test_every_call_gives_the_thread_back_its_own_context_none_included(observed: dict) -> None:
    ft = observed["foreign_threads"]
    assert ft["no_context_thread"] == {"result": True, "device_after": -1}
    assert ft["device1_thread"] == {"result": True, "device_after": 1}
    assert ft["finalizer_thread"]["device_after"] == -1 and ft["finalizer_thread"]["result"] > 0
    assert ft["main_device_before"] == ft["main_device_after"] == -1


def test_stream_0_is_the_engine_devices_default_stream_from_a_thread_on_another_device(observed: dict) -> None:
    # The device-1 thread's round trip named stream 0: it meant device 2's default stream.
    delta = observed["foreign_threads"]["default_stream_uses_delta"]
    assert delta[2] > 0 and delta[0] == delta[1] == 0, delta


def test_copy_streams_outlive_their_engine_so_torch_can_still_record_on_them(observed: dict) -> None:
    sl = observed["stream_lifetime"]
    assert sl["destroyed_after_engine"] == [0, 0]
    assert sl["record_after_engine"] == {"result": [0, 0, 0, 0], "device_after": 2}
    assert sl["same_streams"] and sl["stream_devices"] == [2, 2]


def test_the_stand_in_catches_a_destroyed_stream(observed: dict) -> None:
    """The double is strict: recording on a stream after its destruction (what torch's allocator
    would have done on an engine-owned copy stream) is an error and a violation."""
    caught = observed["destroyed_stream_is_caught"]
    assert caught["destroyed"] == 1 and caught["record"]["result"] == 400
    assert caught["new_violations"] == 1


def test_every_wait_in_the_right_order(observed: dict) -> None:
    o = observed["ordering"]
    assert o["offload_done_while_producer_held"] is False
    assert o["offload_saw_producer_data"]
    assert o["reload_done_while_consumer_held"] is False
    assert o["consumer_read_old_before_reload"] and o["consumer_read_reloaded_after"]
    assert o["wait_on_orders_consumer_after_reload"]
    assert o["prefetch_on_copy_stream_done_while_compute_held"]


def test_streams_of_another_device_are_refused_naming_both_devices(observed: dict) -> None:
    wd = observed["wrong_device"]
    for call in ("offload", "reload", "wait_on"):
        assert "belongs to device 1" in wd[call] and "on device 2" in wd[call], wd[call]
    assert "not a live cuda stream" in wd["unknown_handle"]


def test_no_device_is_picked_by_default(observed: dict) -> None:
    wd = observed["wrong_device"]
    for what in ("engine_without_device", "arena_without_device"):
        assert "pass device=" in wd[what]["result"] and wd[what]["device_after"] == -1, wd[what]
    assert wd["engine_current_device"] == {"result": 1, "device_after": 1}
