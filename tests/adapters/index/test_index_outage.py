"""The Redis index when Redis hangs (SIGSTOP), is killed, or is absent at start-up: look-ups fall
back, the breaker opens and then keeps calls off the network, and Redis is used again once back.

Each test runs its own redis-server on a free port (the shared one must never be stopped). Nothing
asserts on wall-clock time: short-circuits are shown by the breaker's counters and by counting the
calls that reach the Redis index; the cost of a failed call is printed as the breaker measured it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest

from adapters.breaker import BreakerState, CircuitBreaker
from adapters.index.base import IndexLimits, PrefixMatch
from adapters.index.guarded import GuardedIndex
from adapters.index.memory import MemoryIndex
from adapters.index.redis import RedisIndex
from conductor.core.types import Role
from conductor.kv.analyzer import KVAwareAnalyzer, build_analyzer

from .redis_proc import RedisProcess, redis_process

KEYS = list(range(101, 133))  # a 32-block prompt


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingRedisIndex(RedisIndex):
    """Counts the look-ups that reach the Redis client."""

    lookups = 0

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        self.lookups += 1
        return await super().match(keys)


@pytest.fixture
async def server() -> AsyncIterator[RedisProcess]:
    with redis_process() as proc:
        yield proc


def guarded(url: str, clock: Clock, *, fallback: bool = True) -> tuple[GuardedIndex, CountingRedisIndex]:
    # timeouts far above what a busy laptop needs to reach a local Redis (the counts below assume no
    # call times out unless Redis is stopped), and still short: a SIGSTOPped Redis costs 3 x 0.5 s
    primary = CountingRedisIndex(url, prefix=f"test:outage:{uuid.uuid4().hex[:8]}:", timeout_s=0.5, write_timeout_s=0.5)
    breaker = CircuitBreaker("test index", failures_to_open=3, open_s=30.0, clock=clock)
    local = MemoryIndex(IndexLimits(max_blocks=10_000)) if fallback else None
    return GuardedIndex(primary, breaker, fallback=local, lookup_timeout_s=0.5, write_timeout_s=0.5), primary


async def test_hung_redis_lookups_fall_back_and_the_open_breaker_keeps_off_the_network(server: RedisProcess) -> None:
    clock = Clock()
    index, primary = guarded(server.url, clock)
    try:
        await index.insert("p0", KEYS, confirmed=True)
        assert (await index.match(KEYS)).blocks == {"p0": 32}
        assert primary.lookups == 1 and index.fallback_lookups == 0

        server.hang()
        for n in (1, 2, 3):  # each of these waits out one short timeout, then falls back
            assert (await index.match(KEYS)).blocks == {"p0": 32}  # the local copy still knows
            assert index.breaker.stats.failures == n
        stats = index.breaker.stats
        assert stats.state is BreakerState.OPEN and primary.lookups == 4
        print(
            f"slowest failed look-up against the hung Redis: {stats.slowest_failure_s * 1000:.1f} ms "
            "(timeout 50 ms; redis-py's defaults: 5 s and 10 retries)"
        )

        started = time.perf_counter()
        for _ in range(200):
            assert (await index.match(KEYS)).blocks == {"p0": 32}
        print(
            f"a look-up with the breaker open: {(time.perf_counter() - started) / 200 * 1e6:.1f} us "
            "(printed only: the claim rests on the counters below)"
        )
        assert primary.lookups == 4  # not one of the 200 reached Redis
        assert index.breaker.stats.short_circuits == 200
        assert index.breaker.stats.attempts == 5  # the insert, the first look-up and the 3 that failed
        assert index.fallback_lookups == 203

        server.resume()
        clock.now += 30.0  # the back-off is over: the next look-up is the trial
        assert (await index.match(KEYS)).blocks == {"p0": 32}
        assert index.breaker.state is BreakerState.CLOSED and primary.lookups == 5
    finally:
        server.resume()
        await index.close()


async def test_without_a_local_copy_a_hung_redis_means_nothing_cached(server: RedisProcess) -> None:
    clock = Clock()
    index, primary = guarded(server.url, clock, fallback=False)
    try:
        await index.insert("p0", KEYS, confirmed=True)
        server.hang()
        for _ in range(10):
            assert (await index.match(KEYS)).blocks == {}
        assert index.breaker.state is BreakerState.OPEN and primary.lookups == 3
        await index.insert("p0", [7, 8, 9], confirmed=True)  # not attempted, not raised
        assert index.missed_writes == 1 and index.breaker.stats.attempts == 4  # the first insert and 3 look-ups
    finally:
        server.resume()
        await index.close()


async def test_writes_missed_while_redis_hung_are_reseeded_once_it_answers(server: RedisProcess) -> None:
    clock = Clock()
    index, primary = guarded(server.url, clock)
    reader = RedisIndex(server.url, prefix=primary.prefix)  # another replica's view of the same Redis
    try:
        await index.insert("p0", KEYS, confirmed=True)
        server.hang()
        for _ in range(3):
            await index.remove("p0", KEYS[16:])  # the worker evicted the tail: Redis never hears of it
        await index.insert("p1", [900, 901], confirmed=True)
        assert index.breaker.state is BreakerState.OPEN and index.missed_writes == 4

        server.resume()
        clock.now += 30.0
        # Redis, still stale: the trial succeeds. (The removals sent while it hung may or may not land
        # once it resumes, as a timed-out write may; p1's insert was never sent: the breaker was open.)
        assert (await index.match([900, 901])).blocks == {}
        assert index._reseeding is not None
        await index._reseeding
        assert index.reseeds == 2
        assert (await reader.match(KEYS)).blocks == {"p0": 16}
        assert (await reader.match([900, 901])).blocks == {"p1": 2}
    finally:
        server.resume()
        await reader.close()
        await index.close()


async def test_redis_absent_at_start_then_started_is_picked_up() -> None:
    server = RedisProcess()  # a free port where nothing listens yet
    analyzer = build_analyzer(
        {
            "enabled": True,
            "tokenizer": "builtin",  # keys computed here: no worker answers at that address
            "index": "redis",
            "redis_url": server.url,
            "redis_prefix": f"test:absent:{uuid.uuid4().hex}:",
            "redis_breaker_failures": 2,
            "redis_breaker_open_s": 0.05,
        },
        [("p0", Role.PREFILL, "http://127.0.0.1:9")],
    )
    assert isinstance(analyzer, KVAwareAnalyzer) and isinstance(analyzer.index, GuardedIndex)
    index = analyzer.index
    try:
        await analyzer.start()
        a = await analyzer.analyse("completions", {"prompt": "z" * 200})
        assert a.exact and a.cached == {}  # no exception; routed as if nothing were cached
        await index.insert("p0", a.block_keys, confirmed=True)  # the events feed goes on, locally
        assert (await analyzer.analyse("completions", {"prompt": "z" * 200})).cached  # from the local copy
        assert index.breaker.state is BreakerState.OPEN and index.fallback_lookups == 2

        server.start()
        for _ in range(200):  # the breaker lets a trial through every 50 ms
            await analyzer.analyse("completions", {"prompt": "z" * 200})
            if index.breaker.state is BreakerState.CLOSED:
                break
            await asyncio.sleep(0.01)
        assert index.breaker.state is BreakerState.CLOSED
        if index._reseeding is not None:
            await index._reseeding
        shared = RedisIndex(server.url, prefix=index.primary.prefix, timeout_s=10.0, write_timeout_s=10.0)
        try:  # what was learnt while Redis was absent reached it
            assert (await shared.match(a.block_keys)).blocks == {"p0": len(a.block_keys)}
        finally:
            await shared.close()
    finally:
        await analyzer.close()
        server.kill()
