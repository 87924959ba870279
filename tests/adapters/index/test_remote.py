"""`IndexerClient` against a real `conductor indexer` (uvicorn on a socket, fed by real ZMQ KV events):
what the indexer confirms, merged with this gateway's own dispatch guesses; and an indexer that is
down, slow or disagrees costs look-ups nothing but the cache knowledge it held."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from adapters.breaker import BreakerState
from adapters.index.base import IndexLimits
from adapters.index.remote import IndexerClient
from conductor.core.block_keys import XxhashKeys
from conductor.core.types import Tier
from tests.conductor.indexer.test_indexer import BS, VllmPublisher, indexer_settings, running_indexer, stored, warm_up
from tests.support.emulator import free_port
from tests.support.waiting import wait_for

TOKENS = list(range(1, 8 * BS + 1))
KEYS = XxhashKeys(BS).keys(TOKENS)


@pytest.fixture(scope="module")
def indexer() -> Iterator[tuple[str, VllmPublisher]]:
    """An indexer following one worker ("mixed-0") that holds TOKENS' first 4 blocks on its GPU."""
    pub = VllmPublisher()
    try:
        with running_indexer(indexer_settings([pub.instance])) as (url, service):
            warm_up(pub, service)
            pub.publish([stored([1, 2, 3, 4], None, TOKENS[: 4 * BS])])
            assert wait_for(lambda: service.feeder.stats.stored == 4, timeout=20)
            yield url, pub
    finally:
        pub.close()


def client(url: str, **kwargs: object) -> IndexerClient:
    return IndexerClient(url, IndexLimits(max_blocks=1000, unconfirmed_ttl_s=30.0), 5.0, block_size=BS, **kwargs)  # type: ignore[arg-type]


async def test_match_reads_what_the_indexer_confirmed(indexer: tuple[str, VllmPublisher]) -> None:
    c = client(indexer[0])
    try:
        m = await c.match(KEYS)
        assert dict(m.blocks) == {"mixed-0": 4} and dict(m.confirmed_blocks) == {"mixed-0": 4}
        assert m.tiers["mixed-0"] is Tier.DEVICE
        assert (await c.match([12345, *KEYS])).blocks == {}  # a run must start at the first block
        assert c.remote_lookups == 2 and c.fallback_lookups == 0
    finally:
        await c.close()


async def test_dispatch_guesses_are_merged_and_dropped_once_confirmed(indexer: tuple[str, VllmPublisher]) -> None:
    c = client(indexer[0])
    try:
        await c.insert("mixed-1", KEYS[:6], confirmed=False)  # dispatched there: a guess only
        m = await c.match(KEYS)
        assert dict(m.blocks) == {"mixed-0": 4, "mixed-1": 6} and dict(m.confirmed_blocks) == {"mixed-0": 4}
        # the guess on the holder covers the whole prompt: longer than the confirmed run
        await c.insert("mixed-0", KEYS, confirmed=False)
        m = await c.match(KEYS)
        assert m.blocks["mixed-0"] == 8 and m.confirmed_blocks["mixed-0"] == 4
        # ...and the 4 confirmed ones are no longer guesses: the indexer answers for them now
        assert (await c.stats()).blocks == 6 + 4
        # where the confirmed run stops, guesses made since carry it on
        m = await c.match(KEYS)
        assert m.blocks["mixed-0"] == 8
        await c.drop_instance("mixed-0")
        await c.remove("mixed-1", KEYS[3:6])
        m = await c.match(KEYS)
        assert dict(m.blocks) == {"mixed-0": 4, "mixed-1": 3}
    finally:
        await c.close()


async def test_an_indexer_that_is_down_leaves_the_guesses() -> None:
    c = client(f"http://127.0.0.1:{free_port()}", breaker_failures=2, breaker_open_s=60.0)
    try:
        await c.insert("mixed-1", KEYS[:2], confirmed=False)
        for _ in range(3):
            m = await c.match(KEYS)
            assert dict(m.blocks) == {"mixed-1": 2} and not m.confirmed_blocks
        assert c.fallback_lookups == 3 and c.remote_lookups == 0
        assert c.breaker.state is BreakerState.OPEN  # the third was not even tried
        assert c.breaker.stats.attempts == 2
    finally:
        await c.close()


async def test_an_indexer_that_disagrees_is_a_fallback_not_an_error(indexer: tuple[str, VllmPublisher]) -> None:
    c = IndexerClient(indexer[0], IndexLimits(max_blocks=1000), 5.0, block_size=32)  # not the indexer's block size
    try:
        assert (await c.match(KEYS)).blocks == {}
        assert c.fallback_lookups == 1 and "HTTP 400" in (c.breaker.stats.last_error or "")
    finally:
        await c.close()


async def test_a_slow_indexer_costs_at_most_the_timeout() -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = IndexerClient(f"http://127.0.0.1:{port}", IndexLimits(max_blocks=1000), 0.2, block_size=BS)
    try:
        assert (await asyncio.wait_for(c.match(KEYS), 20)).blocks == {}
        assert c.fallback_lookups == 1 and c.breaker.stats.failures == 1
    finally:
        await c.close()
        server.close()


def test_constructor_checks() -> None:
    with pytest.raises(ValueError):
        IndexerClient("http://x", IndexLimits(), 0)
    with pytest.raises(ValueError):
        IndexerClient("http://x", IndexLimits(), 1.0, block_size=0)
