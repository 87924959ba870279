"""A decode instance busy with hundreds of streams is busy, not dead: health probes have their own
connections, so /ready stays true and new requests are still routed while every stream runs."""

from __future__ import annotations

import asyncio

import httpx

from tests.support.cluster import cluster

STREAMS = 260  # more than max_connections_per_upstream (256): the pool is full, probes are not in it


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[int, bool]:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        text = (await r.aread()).decode()
    return r.status_code, text.rstrip().endswith("data: [DONE]")


async def _while_busy(url: str) -> tuple[list[tuple[int, bool]], list[int], list[int]]:
    limits = httpx.Limits(max_connections=STREAMS + 20, max_keepalive_connections=STREAMS + 20)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        streams = [asyncio.create_task(_stream(client, url)) for _ in range(STREAMS)]
        ready: list[int] = []
        extra: list[int] = []
        await asyncio.sleep(0.5)
        while not all(t.done() for t in streams):
            ready.append((await client.get(url + "/ready")).status_code)
            await asyncio.sleep(0.25)
        extra.append(
            (await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2})).status_code
        )
        return [t.result() for t in streams], ready, extra


def test_260_streams_on_one_decode_keep_it_ready() -> None:
    # each stream: 8 tokens 0.5 s apart, so the decode's connection pool is full for ~4 s while
    # probes run every 0.2 s with a 1 s budget: two probes stuck behind the streams would fail it
    with cluster(
        "nixl", health_interval_s=0.2, health_timeout_s=1.0, unhealthy_after=2, standin={"decode": {"token_delay_s": 0.5}}
    ) as c:
        results, ready, extra = asyncio.run(_while_busy(c.url))
        assert [s for s, _ in results] == [200] * STREAMS
        assert all(done for _, done in results)
        assert ready and all(s == 200 for s in ready), ready
        assert extra == [200]
        probes = c.gateway.registry.states["decode-0"].health
        assert probes.probe_ok and probes.probe_failures == 0
        assert not c.gateway.registry.states["decode-0"].decodes
