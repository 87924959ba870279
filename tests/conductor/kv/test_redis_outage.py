"""A gateway with `kv.index: redis` and `load_share: redis` keeps answering 200 while its Redis is
hung (SIGSTOP) or absent, and goes back to Redis once it answers, without a restart.

Real stand-in workers and a real gateway (tests/support/cluster.py) on loopback, and a redis-server
of the test's own. No assertion on wall-clock time: the breakers' states and counters show the
calls were cut short; the cost of a failed call is printed as the breaker measured it.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from adapters.breaker import BreakerState
from adapters.index.guarded import GuardedIndex
from adapters.load_share import RedisLoadShare
from conductor.kv.analyzer import KVAwareAnalyzer
from tests.adapters.index.redis_proc import RedisProcess, redis_process
from tests.support.cluster import Cluster, cluster
from tests.support.waiting import wait_for

BODY = {"model": "tiny", "prompt": "a shared system prompt, long enough for a few blocks " * 4, "max_tokens": 2}


def redis_settings(url: str) -> dict[str, Any]:
    return {
        "kv": {
            "enabled": True,
            "index": "redis",
            "redis_url": url,
            "redis_prefix": f"test:outage:{uuid.uuid4().hex}:",
            "redis_breaker_failures": 3,
            "redis_breaker_open_s": 1.0,
            # 250 ms, not the 50 ms default: a starved CI box must not time out a look-up of a live
            # Redis, and a hung one still opens the breaker after three of them
            "redis_timeout_s": 0.25,
        },
        "load_share": {
            "mode": "redis",
            "redis_url": url,
            "replica_id": f"outage-{uuid.uuid4().hex[:8]}",
            "sync_interval_s": 0.05,
            "breaker_open_s": 1.0,
        },
    }


def guards(c: Cluster) -> tuple[GuardedIndex, RedisLoadShare]:
    analyzer = c.gateway.analyzer
    assert isinstance(analyzer, KVAwareAnalyzer) and isinstance(analyzer.index, GuardedIndex)
    share = c.gateway.registry.load_share
    assert isinstance(share, RedisLoadShare)
    return analyzer.index, share


def post(c: Cluster) -> int:
    return httpx.post(c.url + "/v1/completions", json=BODY, timeout=30).status_code


def test_gateway_answers_while_redis_is_hung_and_recovers() -> None:
    with redis_process() as server, cluster("nixl", **redis_settings(server.url)) as c:
        index, share = guards(c)
        assert post(c) == 200
        assert post(c) == 200
        assert index.breaker.state is BreakerState.CLOSED
        fell_back = index.fallback_lookups  # 0 unless a look-up of the live Redis timed out

        server.hang()
        try:
            statuses = [post(c) for _ in range(10)]
            assert statuses == [200] * 10
            stats = index.breaker.stats
            assert stats.opens >= 1 and stats.short_circuits >= 1  # later look-ups never went out
            assert index.fallback_lookups == fell_back + 10
            assert wait_for(lambda: share.breaker.stats.opens >= 1)
            metrics = httpx.get(c.url + "/metrics", timeout=10).text
            assert "conductor_kv_index_redis_breaker_opens_total" in metrics
            assert f"conductor_kv_index_fallback_lookups_total {fell_back + 10}.0" in metrics
            print(
                f"slowest look-up that fell back: {index.slowest_fallback_lookup_s * 1000:.1f} ms (timeout 250 ms); "
                f"slowest failed index call of any kind: {stats.slowest_failure_s * 1000:.1f} ms (background "
                f"writes: 250 ms); slowest failed load exchange: {share.breaker.stats.slowest_failure_s * 1000:.1f} ms"
            )
        finally:
            server.resume()

        def recovered() -> bool:
            post(c)
            return index.breaker.state is BreakerState.CLOSED and share.breaker.state is BreakerState.CLOSED

        assert wait_for(recovered, timeout=15, interval=0.1)
        looked_up = index.breaker.stats.attempts
        assert post(c) == 200
        assert index.breaker.stats.attempts > looked_up  # Redis is asked again


def test_gateway_starts_without_redis_and_picks_it_up_later() -> None:
    server = RedisProcess()  # nothing listens on its port yet
    try:
        with cluster("nixl", **redis_settings(server.url)) as c:
            index, share = guards(c)
            assert [post(c) for _ in range(5)] == [200] * 5
            assert index.breaker.stats.failures >= 1 and share.remote() == {}

            server.start()

            def recovered() -> bool:
                post(c)
                return index.breaker.state is BreakerState.CLOSED and share.breaker.state is BreakerState.CLOSED

            assert wait_for(recovered, timeout=15, interval=0.1)
            assert post(c) == 200
    finally:
        server.kill()
