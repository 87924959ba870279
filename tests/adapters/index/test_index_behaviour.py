"""What every KVIndex backend must do: the same tests against the in-memory and the Redis index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from adapters.index.base import IndexLimits, KVIndex
from adapters.index.memory import MemoryIndex
from conductor.core.block_keys import XxhashKeys
from conductor.core.types import CachedPrefix, Tier
from tests.support.waiting import until

KEYS = XxhashKeys(16, seed=3)


def prompt(tag: int, blocks: int) -> list[int]:
    return KEYS.keys([tag * 100_000 + i for i in range(blocks * 16)])


@pytest.fixture(params=["memory", "redis"])
def make_index(request: pytest.FixtureRequest) -> Callable[..., KVIndex]:
    if request.param == "memory":
        return lambda limits=None: MemoryIndex(limits)
    factory: Any = request.getfixturevalue("redis_index_factory")
    return factory  # type: ignore[no-any-return]


async def test_longest_leading_run_per_instance_with_tiers(make_index: Callable[..., KVIndex]) -> None:
    idx = make_index()
    keys = prompt(1, 10)
    await idx.insert("a", keys[:6], confirmed=True)
    await idx.insert("b", keys[:3], confirmed=True)
    await idx.insert("b", keys[4:10], confirmed=True)  # a hole at block 3: b's run stops there
    await idx.insert("c", keys[:8], tier=Tier.HOST, confirmed=True)
    await idx.insert("d", keys[1:5], confirmed=True)  # no first block: no prefix at all
    m = await idx.match(keys)
    assert m.blocks == {"a": 6, "b": 3, "c": 8}
    assert m.cached(16) == {
        "a": CachedPrefix(96, Tier.DEVICE),
        "b": CachedPrefix(48, Tier.DEVICE),
        "c": CachedPrefix(128, Tier.HOST),
    }
    # vLLM always computes the last prompt token: a fully cached 96-token prompt reuses 80 tokens
    assert m.cached(16, prompt_tokens=96)["a"].tokens == 80
    assert m.cached(16, prompt_tokens=97)["a"].tokens == 96
    assert (await idx.match(prompt(2, 4))).blocks == {}
    assert (await idx.match([])).blocks == {}


class ManualClock:
    """A clock the test moves: MemoryIndex(clock=...) reads it instead of time.monotonic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_dispatch_guesses_expire_exactly_at_their_ttl() -> None:
    clock = ManualClock()  # steps that are binary fractions: sums without rounding
    idx = MemoryIndex(IndexLimits(unconfirmed_ttl_s=4.0), clock=clock)
    keys = prompt(3, 8)
    await idx.insert("p", keys, confirmed=False)
    await idx.insert("q", keys, confirmed=False)
    await idx.insert("p", keys[:5], confirmed=True)  # events confirm five blocks on p
    clock.now += 3.75
    m = await idx.match(keys)
    assert m.blocks == {"p": 8, "q": 8} and m.confirmed_blocks == {"p": 5}
    await idx.insert("q", keys[:2], confirmed=False)  # a later dispatch renews q's first two guesses
    clock.now += 0.25  # the TTL since the first inserts
    m = await idx.match(keys)
    assert m.blocks == {"p": 5, "q": 2}  # p's unconfirmed tail and q's older guesses are gone
    assert m.confirmed_blocks == {"p": 5}
    clock.now += 3.5
    assert (await idx.match(keys)).blocks == {"p": 5, "q": 2}
    clock.now += 0.25  # the TTL since the renewal
    assert (await idx.match(keys)).blocks == {"p": 5}  # confirmed blocks never expire
    assert (await idx.stats()).blocks == 5


async def test_redis_dispatch_guesses_expire_by_the_servers_clock(redis_index_factory: Any) -> None:
    """Redis keeps time itself (TIME), which no test moves: guesses written with an hour's TTL are
    all there; written again (same prefix, another client) with a millisecond's, they go soon after."""
    lasting = redis_index_factory(IndexLimits(unconfirmed_ttl_s=3600))
    fleeting = redis_index_factory(IndexLimits(unconfirmed_ttl_s=0.001))
    keys = prompt(3, 8)
    await lasting.insert("p", keys, confirmed=False)
    await lasting.insert("q", keys, confirmed=False)
    await lasting.insert("p", keys[:5], confirmed=True)  # events confirm five blocks on p
    m = await lasting.match(keys)
    assert m.blocks == {"p": 8, "q": 8}
    assert m.confirmed_blocks == {"p": 5}
    await fleeting.insert("p", keys, confirmed=False)  # renewed guesses: a confirmed block stays confirmed
    await fleeting.insert("q", keys, confirmed=False)

    async def expired() -> bool:
        return (await lasting.match(keys)).blocks == {"p": 5}  # q's guesses and p's unconfirmed tail are gone

    assert await until(expired)
    assert (await lasting.match(keys)).confirmed_blocks == {"p": 5}


async def test_remove_by_tier_and_drop_instance(make_index: Callable[..., KVIndex]) -> None:
    idx = make_index()
    keys = prompt(4, 6)
    await idx.insert("p", keys, confirmed=True)
    await idx.insert("p", keys[:4], tier=Tier.HOST, confirmed=True)  # offloaded copies
    await idx.remove("p", keys[2:], tier=Tier.DEVICE)  # evicted from HBM, two still in DRAM
    m = await idx.match(keys)
    assert m.blocks == {"p": 4} and m.tiers == {"p": Tier.HOST}
    await idx.remove("p", keys[3:4])
    assert (await idx.match(keys)).blocks == {"p": 3}
    await idx.insert("r", keys, confirmed=True)
    await idx.drop_instance("p")
    assert (await idx.match(keys)).blocks == {"r": 6}
    await idx.insert("p", keys[:2], confirmed=True)  # back after a resync
    assert (await idx.match(keys)).blocks == {"r": 6, "p": 2}


async def test_cap_evicts_least_recent_from_chain_tails(make_index: Callable[..., KVIndex]) -> None:
    idx = make_index(IndexLimits(max_blocks=120))
    a, b, c = prompt(5, 50), prompt(6, 50), prompt(7, 50)
    for keys in (a, b, c):
        await idx.insert("p", keys, confirmed=True)
    stats = await idx.stats()
    assert stats.blocks == 120 and stats.evictions == 30
    # the oldest prompt lost its last 30 blocks, not its head: what is left is still a usable prefix
    assert (await idx.match(a)).blocks == {"p": 20}
    assert (await idx.match(c)).blocks == {"p": 50}
    await idx.insert("p", a, confirmed=True)  # touching a again makes b the oldest
    assert (await idx.match(a)).blocks == {"p": 50}
    assert (await idx.match(b)).blocks == {"p": 20}
