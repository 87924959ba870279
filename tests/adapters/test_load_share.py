"""Load sharing when Redis hangs, dies or is absent at start-up: each replica keeps routing on its own
load, the breaker keeps exchanges off the network while open, and sharing resumes when Redis is back.

A redis-server of the test's own on a free port; no assertion on wall-clock time (waits poll for a
state with a generous deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry

from adapters.breaker import BreakerState, CircuitBreaker
from adapters.load_share import LoadTable, PrefillEnds, RedisLoadShare
from tests.adapters.index.redis_proc import RedisProcess, redis_process


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(instance: str, decodes: int) -> Callable[[], LoadTable]:
    return lambda: {instance: ([], [(100, 10, True)] * decodes)}


async def until(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


def share(url: str, name: str, prefix: str, **kw: object) -> RedisLoadShare:
    # a timeout a busy laptop never hits against a local Redis, unless the test stops it
    return RedisLoadShare(url, name, interval_s=0.02, prefix=prefix, timeout_s=0.5, **kw)  # type: ignore[arg-type]


async def test_hung_redis_routes_on_local_load_and_the_open_breaker_skips_exchanges() -> None:
    prefix = f"test:load:{uuid.uuid4().hex[:8]}:"
    clock = Clock()
    with redis_process() as server:
        registry = CollectorRegistry()
        a = share(
            server.url,
            "a",
            prefix,
            registry=registry,
            breaker=CircuitBreaker("load share a", failures_to_open=3, open_s=30.0, clock=clock),
        )
        b = share(server.url, "b", prefix)
        await a.start(table("d0", 0))
        await b.start(table("d0", 2))
        try:
            assert await until(lambda: len(a.remote().get("d0", ((), ()))[1]) == 2)  # a sees b's streams

            server.hang()
            # three exchanges of at most 0.5 s each; the bound is for a box whose cores vLLM engines
            # are starting on (a CI run saw 10 s pass without the third failure)
            assert await until(lambda: a.breaker.state is BreakerState.OPEN, 60.0), a.breaker.stats
            assert await until(lambda: a.remote() == {})  # b's table grew too old to trust: local load only
            attempts = a.breaker.stats.attempts
            skipped = a.breaker.stats.short_circuits
            # fifteen more turns of the sync loop, each one turned away by the open breaker
            assert await until(lambda: a.breaker.stats.short_circuits >= skipped + 15)
            assert a.breaker.stats.attempts == attempts  # the loop kept off the network
            assert registry.get_sample_value("conductor_load_share_redis_breaker_state") == int(BreakerState.OPEN)
            assert registry.get_sample_value("conductor_load_share_redis_breaker_failures_total") == 3
            print(f"slowest failed exchange: {a.breaker.stats.slowest_failure_s * 1000:.1f} ms (timeout 50 ms)")

            server.resume()
            # back-off over: the next exchange is the trial. On a loaded box a trial can miss its 50 ms
            # timeout and open the breaker again (as it should): then the next back-off ends, up to 10 times
            for _ in range(10):
                clock.now += 30.0
                if await until(lambda: a.breaker.state is BreakerState.CLOSED, 3.0):
                    break
            assert a.breaker.state is BreakerState.CLOSED
            assert await until(lambda: len(a.remote().get("d0", ((), ()))[1]) == 2)
        finally:
            server.resume()
            await a.close()
            await b.close()


async def test_absent_at_start_then_started_then_killed_then_back() -> None:
    prefix = f"test:load:{uuid.uuid4().hex[:8]}:"
    server = RedisProcess()  # nothing listens on its port yet
    a = share(server.url, "a", prefix, failures_to_open=2, open_s=0.05)
    b = share(server.url, "b", prefix, failures_to_open=2, open_s=0.05)
    try:
        await a.start(table("d0", 0))  # must not raise
        await b.start(table("d1", 1))
        assert a.remote() == {} and a.breaker.stats.failures >= 1

        server.start()
        assert await until(lambda: "d1" in a.remote())  # picked up without a restart
        assert a.breaker.state is BreakerState.CLOSED

        server.kill()
        assert await until(lambda: a.breaker.stats.opens >= 1 and a.remote() == {})

        server.start()  # same port, empty: the replicas publish again
        assert await until(lambda: "d1" in a.remote())
    finally:
        await a.close()
        await b.close()
        server.kill()


async def test_close_with_redis_hung_does_not_wait_for_it() -> None:
    with redis_process() as server:
        a = share(server.url, "a", f"test:load:{uuid.uuid4().hex[:8]}:", failures_to_open=1, open_s=60.0)
        await a.start(table("d0", 1))
        server.hang()
        assert await until(lambda: a.breaker.state is BreakerState.OPEN)
        attempts = a.breaker.stats.attempts
        await a.close()  # the breaker is open: the table is left to expire, not withdrawn
        assert a.breaker.stats.attempts == attempts
        server.resume()


@contextlib.asynccontextmanager
async def two_replicas(mine: LoadTable) -> AsyncIterator[tuple[RedisLoadShare, RedisLoadShare]]:
    """Replica a publishing `mine`, replica b nothing, beats a minute apart: only a dispatch, an
    end or a refresh can carry a change between them."""
    prefix = f"test:load:{uuid.uuid4().hex[:8]}:"
    with redis_process() as server:
        a = RedisLoadShare(server.url, "a", interval_s=60.0, prefix=prefix, timeout_s=0.5)
        b = RedisLoadShare(server.url, "b", interval_s=60.0, prefix=prefix, timeout_s=0.5)
        await a.start(lambda: mine)
        await b.start(dict)
        try:
            yield a, b
        finally:
            await a.close()
            await b.close()


async def test_remote_prefills_age_between_exchanges() -> None:
    # what is left of another replica's running prefill shrinks as time passes, not only at the
    # next exchange: a frozen elapsed_s overstated the head's remaining time by up to an interval
    prefix = f"test:load:{uuid.uuid4().hex[:8]}:"
    dispatched = time.time()
    with redis_process() as server:
        b = share(server.url, "b", prefix)
        a = RedisLoadShare(server.url, "a", interval_s=60.0, prefix=prefix, timeout_s=0.5)  # one exchange: start's
        await b.start(lambda: {"p0": ([(1000, 0, dispatched)], [])})
        await a.start(table("d0", 0))
        try:
            # on a loaded box b's first publish can miss its 50 ms timeout (b republishes at its next
            # beat): a dispatch of a's own wakes a's exchange until it has read b's table
            for _ in range(100):
                if "p0" in a.remote():
                    break
                a.changed()
                await asyncio.sleep(0.05)
            first = a.remote()["p0"][0][0].elapsed_s
            attempts = a.breaker.stats.attempts
            assert await until(lambda: a.remote()["p0"][0][0].elapsed_s >= first + 0.05)
            assert a.breaker.stats.attempts == attempts  # aged by a itself, not by a new exchange
        finally:
            await a.close()
            await b.close()


async def test_a_dispatch_is_shared_at_once_not_at_the_next_beat() -> None:
    # replicas deciding a burst were blind to each other until the beat; a dispatch now wakes the
    # exchange (beats here are a minute apart: only the dispatch can have carried it)
    mine: LoadTable = {}
    async with two_replicas(mine) as (a, b):
        mine["p0"] = ([(1000, 0, time.time())], [])
        a.changed()
        b.changed()  # b's own exchange reads what a published

        async def b_sees() -> bool:
            b.changed()
            await asyncio.sleep(0.01)
            return "p0" in b.remote()

        deadline = time.monotonic() + 10
        while not await b_sees():
            assert time.monotonic() < deadline, "a's dispatch never reached b"


async def test_refresh_fetches_what_another_replica_published_since() -> None:
    """A decision asks for a view at most a few ms old: one exchange, shared by every caller
    waiting at that moment, and none when the view is fresh enough."""
    mine: LoadTable = {}
    async with two_replicas(mine) as (a, b):
        mine["p0"] = ([(1000, 0, time.time())], [])
        await a.sync()  # a published its dispatch; b's view (from its start) predates it
        assert "p0" not in b.remote()
        attempts = b.breaker.stats.attempts
        await asyncio.gather(*(b.refresh(0.0) for _ in range(5)))
        assert "p0" in b.remote()
        assert b.breaker.stats.attempts == attempts + 1  # five callers, one exchange
        await b.refresh(60.0)
        assert b.breaker.stats.attempts == attempts + 1  # fresh enough: none


def test_prefill_ends_notices_an_entry_leaving_the_tables() -> None:
    ends = PrefillEnds()
    t1, t2 = (1000, 0, 100.0), (500, 16, 100.5)
    ends.update([{"p0": ([t1], [])}, {"p0": ([t2], []), "p1": ([], [(10, 5, True)])}], now_mono=1.0)
    assert ends.ended_at == {}
    ends.update([{"p0": ([t2], [])}], now_mono=2.0)  # t1 ended between the reads
    assert ends.ended_at == {"p0": 2.0}
    ends.update([], now_mono=3.0)  # t2 too, and its replica's table is gone
    assert ends.ended_at == {"p0": 3.0}
    ends.update([], now_mono=3.0 + PrefillEnds.KEEP_S + 1)
    assert ends.ended_at == {}  # old ends bound nothing and are forgotten
