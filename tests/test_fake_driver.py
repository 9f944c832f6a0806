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
