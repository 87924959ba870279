"""LazyTimer on a loop whose clock the test sets: the deadline in force expires once, moving it
later re-uses the armed handle (pushed back when it fires early), a disarmed deadline lets the
handle lapse, and stop cancels it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from adapters.lazy_timer import LazyTimer


class _Clock:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.now = 0.0
        self.loop = loop
        self.armed = 0  # handles the timer asked the loop for
        real_call_at = loop.call_at

        def counting_call_at(when: float, callback: object, *args: object) -> asyncio.TimerHandle:
            self.armed += 1
            return real_call_at(when, callback, *args)  # type: ignore[arg-type]

        loop.time = lambda: self.now  # type: ignore[method-assign]
        loop.call_at = counting_call_at  # type: ignore[method-assign,assignment]

    def advance_to(self, t: float) -> None:
        self.now = t
        for _ in range(3):  # timers due now run; one re-armed by them is due later
            self.loop.run_until_complete(asyncio.sleep(0))


@pytest.fixture
def clock() -> Iterator[_Clock]:
    loop = asyncio.new_event_loop()
    try:
        yield _Clock(loop)
    finally:
        loop.close()


def test_expires_once_at_its_deadline(clock: _Clock) -> None:
    fired: list[float] = []
    timer = LazyTimer(clock.loop, lambda: fired.append(clock.now))
    timer.arm(10.0)
    clock.advance_to(9.9)
    assert fired == [] and timer.armed
    clock.advance_to(10.0)
    assert fired == [10.0] and not timer.armed
    clock.advance_to(30.0)
    assert fired == [10.0]


def test_a_later_deadline_reuses_the_armed_handle(clock: _Clock) -> None:
    fired: list[float] = []
    timer = LazyTimer(clock.loop, lambda: fired.append(clock.now))
    timer.arm(10.0)
    for t in (2.0, 4.0, 6.0, 8.0):  # requests answered back to back: the idle start moves on
        clock.advance_to(t)
        timer.arm(t + 10.0)
    assert clock.armed == 1
    clock.advance_to(10.0)  # the first handle fires early and pushes itself back
    assert fired == [] and clock.armed == 2
    clock.advance_to(17.9)
    assert fired == []
    clock.advance_to(18.0)
    assert fired == [18.0]


def test_a_disarmed_deadline_lets_the_handle_lapse(clock: _Clock) -> None:
    fired: list[float] = []
    timer = LazyTimer(clock.loop, lambda: fired.append(clock.now))
    timer.arm(10.0)
    clock.advance_to(5.0)
    timer.disarm()  # a request is being served: nothing timed
    clock.advance_to(10.0)
    assert fired == [] and not timer.armed
    clock.advance_to(12.0)
    timer.arm(22.0)  # answered: idle again, a fresh handle since the old one lapsed
    assert clock.armed == 2
    clock.advance_to(22.0)
    assert fired == [22.0]


def test_stop_cancels_the_handle(clock: _Clock) -> None:
    fired: list[float] = []
    timer = LazyTimer(clock.loop, lambda: fired.append(clock.now))
    timer.arm(10.0)
    timer.stop()
    clock.advance_to(20.0)
    assert fired == [] and not timer.armed
    assert all(h.cancelled() for h in clock.loop._scheduled)  # type: ignore[attr-defined]


def test_a_deadline_hook_is_asked_when_the_handle_fires(clock: _Clock) -> None:
    """The owner notes its activity itself; the timer asks for the deadline only when it fires:
    pushed back while there was activity, expired after silence, lapsed when nothing is timed."""
    fired: list[float] = []
    state = {"last": 0.0, "timing": True}
    asked: list[float] = []

    def deadline() -> float:
        asked.append(clock.now)
        return state["last"] + 10.0 if state["timing"] else float("inf")

    timer = LazyTimer(clock.loop, lambda: fired.append(clock.now), deadline)
    timer.arm(10.0)
    state["last"] = 7.0  # activity at 7: not told to the timer
    clock.advance_to(10.0)
    assert asked == [10.0] and fired == [] and timer.due == 17.0
    clock.advance_to(17.0)
    assert asked == [10.0, 17.0] and fired == [17.0] and not timer.armed
    timer.arm(30.0)
    state["timing"] = False  # the exchange ended: nothing to time
    clock.advance_to(30.0)
    assert fired == [17.0] and not timer.armed and clock.armed == 3
