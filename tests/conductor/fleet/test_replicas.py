"""Two gateway replicas in front of the same workers see each other's in-flight load through a
real Redis, so neither piles onto an instance the other has already loaded."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import httpx
import redis

from conductor.config.settings import load_settings
from conductor.core.types import Role
from conductor.gateway import Gateway
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for


def test_replicas_share_load_through_redis() -> None:
    redis.Redis().ping()
    with ExitStack() as stack:
        prefill = StandIn(role="prefill")
        decodes = [StandIn(role="decode", token_delay_s=0.05), StandIn(role="decode", token_delay_s=0.05)]
        p_url = stack.enter_context(serve(prefill)).url
        d_urls = [stack.enter_context(serve(d)).url for d in decodes]
        gateways = []
        for name in ("replica-a", "replica-b"):
            settings = load_settings(
                environ={},
                overrides={
                    "prefill": [p_url],
                    "decode": d_urls,
                    "policy": "least_loaded",
                    "load_share": {
                        "mode": "redis",
                        "replica_id": f"test-{name}-{time.monotonic_ns()}",
                        "sync_interval_s": 0.05,
                        "timeout_s": 5.0,
                    },
                },
            )
            gw = Gateway(settings)
            gateways.append((stack.enter_context(serve_gateway(gw)).url, gw))
        (url_a, gw_a), (url_b, gw_b) = gateways

        # A long stream through replica A occupies one decode instance
        def stream_a() -> None:
            httpx.post(
                url_a + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 40, "stream": True}
            )

        t = threading.Thread(target=stream_a)
        t.start()
        assert wait_for(lambda: sum(len(s.decodes) for s in gw_a.registry.states.values()) == 1)
        busy = next(n for n, s in gw_a.registry.states.items() if s.decodes)

        # replica B sees it without having dispatched anything itself
        def b_sees() -> bool:
            view = {i.id: i for i in gw_b.registry.snapshot().instances}
            return len(view[busy].decodes) == 1

        assert wait_for(b_sees)
        assert all(not s.decodes for s in gw_b.registry.states.values())  # B's own table is empty

        # and routes B's next request to the other, idle decode instance
        r = httpx.post(url_b + "/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        idle = next(n for n, s in gw_b.registry.states.items() if s.spec.role is Role.DECODE and n != busy)
        idle_index = int(idle.split("-")[1])
        assert len(decodes[idle_index].requests) == 1
        t.join()
        # once A's stream ends, B stops counting it
        assert wait_for(lambda: all(not i.decodes for i in gw_b.registry.snapshot().instances))
