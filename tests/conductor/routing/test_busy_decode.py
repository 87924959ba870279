"""A decode instance busy with hundreds of streams is busy, not dead: health probes have their own
connections, so /ready stays true and new requests are still routed while every stream runs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx

from tests.support.cluster import Cluster, cluster

STREAMS = 260  # more than max_connections_per_upstream (256): the pool is full, probes are not in it
POOL = 256


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[int, bool]:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        text = (await r.aread()).decode()
    return r.status_code, text.rstrip().endswith("data: [DONE]")


async def _polled(cond: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s  # a bound for a hang, not a speed check
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def _while_busy(c: Cluster, gate: threading.Semaphore) -> tuple[list[tuple[int, bool]], list[int], list[int]]:
    health = c.gateway.registry.states["decode-0"].health
    limits = httpx.Limits(max_connections=STREAMS + 20, max_keepalive_connections=STREAMS + 20)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        streams = [asyncio.create_task(_stream(client, c.url)) for _ in range(STREAMS)]
        # every pooled connection holds a stream, each stopped after its first token until the gate opens
        await _polled(lambda: len(c.decodes[0].requests) >= POOL, "the decode's pool never filled")
        probed = health.probes_total
        ready: list[int] = []
        for round_ in range(1, 6):  # five health rounds while the pool stays full; /ready asked in each
            ready.append((await client.get(c.url + "/ready")).status_code)
            await _polled(lambda after=probed + round_: health.probes_total >= after, "no health probe ran")
        assert not any(t.done() for t in streams), "a stream ended while the pool was to stay full"
        gate.release(STREAMS * 7)  # the other 7 tokens of every stream
        results = await asyncio.gather(*streams)
        extra = [
            (await client.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2})).status_code
        ]
        return results, ready, extra


def test_260_streams_on_one_decode_keep_it_ready() -> None:
    # the decode holds every stream after its first token, so its connection pool stays full while
    # probes run every 0.2 s with a 1 s budget: two probes stuck behind the streams would fail it
    gate = threading.Semaphore(0)
    with cluster(
        "nixl", health={"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 2}, standin={"decode": {"token_gate": gate}}
    ) as c:
        results, ready, extra = asyncio.run(_while_busy(c, gate))
        assert [s for s, _ in results] == [200] * STREAMS
        assert all(done for _, done in results)
        assert ready and all(s == 200 for s in ready), ready
        assert extra == [200]
        probes = c.gateway.registry.states["decode-0"].health
        assert probes.probe_ok and probes.probe_failures == 0
        assert not c.gateway.registry.states["decode-0"].decodes
