"""The circuit breaker on its own: opening, short-circuiting, the half-open trial, timeouts, metrics.

Time is a fake clock the test moves, so nothing here depends on how fast the box is.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from adapters.breaker import BreakerState, CircuitBreaker, fail_fast_redis, register_breaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Service:
    """Counts the calls that really reach it; fails while `down`."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = False

    async def op(self) -> str:
        self.calls += 1
        if self.down:
            raise ConnectionError("refused")
        return "answer"


def fallback() -> str:
    return "fallback"


async def test_opens_after_n_failures_then_short_circuits_without_calling() -> None:
    clock, svc = Clock(), Service()
    b = CircuitBreaker("svc", failures_to_open=3, open_s=5.0, clock=clock)
    assert await b.call(svc.op, fallback, timeout_s=1) == "answer"
    svc.down = True
    for n in (1, 2):
        assert await b.call(svc.op, fallback, timeout_s=1) == "fallback"
        assert b.state is BreakerState.CLOSED and b.stats.consecutive_failures == n
    assert await b.call(svc.op, fallback, timeout_s=1) == "fallback"
    assert b.state is BreakerState.OPEN and b.stats.opens == 1 and b.stats.failures == 3
    calls = svc.calls
    for _ in range(100):
        assert await b.call(svc.op, fallback, timeout_s=1) == "fallback"
    assert svc.calls == calls  # not one of the 100 reached the service
    assert b.stats.short_circuits == 100 and b.stats.attempts == 4


async def test_half_open_trial_closes_on_success_and_reopens_on_failure() -> None:
    clock, svc = Clock(), Service()
    b = CircuitBreaker("svc", failures_to_open=1, open_s=5.0, clock=clock)
    svc.down = True
    await b.call(svc.op, fallback, timeout_s=1)
    assert b.state is BreakerState.OPEN
    clock.now += 4.9
    await b.call(svc.op, fallback, timeout_s=1)
    assert svc.calls == 1  # still inside the back-off
    clock.now += 0.2
    await b.call(svc.op, fallback, timeout_s=1)  # the trial, which fails: open for another 5 s
    assert svc.calls == 2 and b.state is BreakerState.OPEN and b.stats.opens == 2
    await b.call(svc.op, fallback, timeout_s=1)
    assert svc.calls == 2
    clock.now += 5.0
    svc.down = False
    assert await b.call(svc.op, fallback, timeout_s=1) == "answer"
    assert b.state is BreakerState.CLOSED and b.stats.consecutive_failures == 0


async def test_only_one_trial_in_flight_while_half_open() -> None:
    clock = Clock()
    b = CircuitBreaker("svc", failures_to_open=1, open_s=1.0, clock=clock)
    b.failure("down")
    clock.now += 1.0
    gate = asyncio.Event()
    reached = 0

    async def slow() -> str:
        nonlocal reached
        reached += 1
        await gate.wait()
        return "answer"

    trial = asyncio.create_task(b.call(slow, fallback, timeout_s=10))
    await asyncio.sleep(0)
    assert b.state is BreakerState.HALF_OPEN
    assert [await b.call(slow, fallback, timeout_s=10) for _ in range(5)] == ["fallback"] * 5
    gate.set()
    assert await trial == "answer" and reached == 1 and b.state is BreakerState.CLOSED


async def test_a_hung_call_is_a_failure_after_its_timeout() -> None:
    b = CircuitBreaker("svc", failures_to_open=2, open_s=60.0)

    async def hang() -> str:
        await asyncio.Event().wait()
        return "never"

    for _ in range(2):
        assert await b.call(hang, fallback, timeout_s=0.01) == "fallback"
    s = b.stats
    assert s.state is BreakerState.OPEN and s.failures == 2 and "TimeoutError" in (s.last_error or "")
    print(f"slowest failed call, as the breaker measured it: {s.slowest_failure_s * 1000:.1f} ms (timeout 10 ms)")


async def test_a_cancelled_trial_frees_the_half_open_slot() -> None:
    clock = Clock()
    b = CircuitBreaker("svc", failures_to_open=1, open_s=1.0, clock=clock)
    b.failure("down")
    clock.now += 1.0

    async def hang() -> str:
        await asyncio.Event().wait()
        return "never"

    trial = asyncio.create_task(b.call(hang, fallback, timeout_s=10))
    await asyncio.sleep(0)
    trial.cancel()
    with pytest.raises(asyncio.CancelledError):
        await trial
    svc = Service()
    assert await b.call(svc.op, fallback, timeout_s=1) == "answer"  # the next caller gets the trial
    assert b.state is BreakerState.CLOSED


async def test_breaker_metrics_on_the_registry() -> None:
    registry, clock, svc = CollectorRegistry(), Clock(), Service()
    b = CircuitBreaker("svc", failures_to_open=2, open_s=5.0, clock=clock)
    register_breaker(b, registry, "conductor_test_svc")
    svc.down = True
    for _ in range(5):
        await b.call(svc.op, fallback, timeout_s=1)
    assert registry.get_sample_value("conductor_test_svc_breaker_state") == int(BreakerState.OPEN)
    assert registry.get_sample_value("conductor_test_svc_breaker_failures_total") == 2
    assert registry.get_sample_value("conductor_test_svc_breaker_short_circuits_total") == 3
    assert registry.get_sample_value("conductor_test_svc_breaker_opens_total") == 1


async def test_fail_fast_client_has_short_timeouts_and_no_retries() -> None:
    client = fail_fast_redis("redis://127.0.0.1:6379/0", timeout_s=0.05)
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.05 and kwargs["socket_connect_timeout"] == 0.05
        assert kwargs["retry"].get_retries() == 0  # redis-py would otherwise retry 10 times
    finally:
        await client.aclose()
