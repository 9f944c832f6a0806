"""Extension points are subscriber lists (bagualu2.shared.Event): every subscriber is heard,
each removes only itself, and an emission sees the subscribers present when it began."""
from __future__ import annotations

from typing import List

import pytest
import torch

from bagualu2.offload import CopyEngine, HostArena
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.shared import Choice, Event


def test_two_subscribers_both_hear_in_order_and_unsubscribing_one_leaves_the_other() -> None:
    event = Event("tick")
    heard: List[str] = []
    first = event.subscribe(lambda x: heard.append(f"a{x}"))
    second = event.subscribe(lambda x: heard.append(f"b{x}"))
    event.emit(1)
    assert heard == ["a1", "b1"]
    first.unsubscribe()
    first.unsubscribe()  # again: nothing more
    event.emit(2)
    assert heard == ["a1", "b1", "b2"]
    assert not first.active and second.active
    with event.subscribe(lambda x: heard.append(f"c{x}")):
        event.subscribe(lambda x: heard.append(f"p{x}"), prepend=True)
        event.emit(3)
    event.emit(4)
    assert heard[3:] == ["p3", "b3", "c3", "p4", "b4"]


def test_no_subscriber_is_a_false_tuple_and_a_subscriber_must_be_callable() -> None:
    event = Event("tick")
    assert event.subscribers == () and not event.subscribers
    with pytest.raises(TypeError, match="subscriber of 'tick' must be callable, got int"):
        event.subscribe(3)  # type: ignore[arg-type]


def test_an_emission_calls_the_subscribers_present_when_it_began_and_an_error_stops_it() -> None:
    event = Event("tick")
    heard: List[str] = []

    def late(x: int) -> None:
        heard.append(f"late{x}")

    def first(x: int) -> None:
        heard.append(f"first{x}")
        event.subscribe(late)
        second.unsubscribe()

    event.subscribe(first)
    second = event.subscribe(lambda x: heard.append(f"second{x}"))
    event.emit(1)
    assert heard == ["first1", "second1"]  # the change takes effect from the next emission

    def failing(x: int) -> None:
        raise KeyError(x)

    event.subscribe(failing, prepend=True)
    with pytest.raises(KeyError):
        event.emit(2)
    assert heard == ["first1", "second1"]


def test_the_runtime_s_events_each_reach_every_subscriber() -> None:
    """Two parties on each of the runtime's events (where one callback slot kept only the
    last writer's): both hear every frame start and end, first save, offload, hook, released
    unpack and backward end."""
    rt = ActivationRuntime(CopyEngine(HostArena(1 << 20)))
    heard: List[List[object]] = [[], []]
    for log in heard:
        rt.on_frame_start.subscribe(lambda f, log=log: (log.append("frame"),
                                                        f.on_saved.subscribe(lambda k, log=log: log.append("saved"))))
        rt.on_frame_end.subscribe(lambda f, log=log: log.append("frame end"))
        rt.residency.on_offload.subscribe(lambda key, nbytes, log=log: log.append("offload"))
        rt.residency.on_released_unpack.subscribe(lambda key, log=log: log.append("unpack"))
        rt.residency.on_backward_end.subscribe(lambda log=log: log.append("end"))
        rt.on_hook.subscribe(lambda hook, record, s, log=log: log.append(hook))
    x = torch.randn(16, 16, requires_grad=True)
    for choice in (Choice.RECOMPUTE, Choice.OFFLOAD):
        for log in heard:
            log.clear()
        frame = Frame(default=choice)
        with rt.frame(frame):
            y = (x.exp() * x).sum()
        y.backward()
        for log in heard:
            assert log[0] == "frame" and log[-1] == "end" and log.count("frame end") == 1
            assert log.count("saved") == len(frame.keys_seen) > 0
            assert log.count("unpack") >= 1 and log.count("pack") == frame.stats.packed
            assert log.count("offload") == frame.stats.offloaded_storages
        assert heard[0] == heard[1]
        assert rt.ledger.resident == 0
    assert frame.stats.offloaded_storages > 0
