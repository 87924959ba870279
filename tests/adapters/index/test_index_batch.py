"""`apply`: a batch of writes for one instance in one call, with the same result as its writes made
one at a time through insert / remove / drop_instance (caps and evictions included), on the in-memory
and the Redis index; one Redis round trip per batch. (The cluster's: test_redis_cluster.py.)"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import redis

from adapters.breaker import CircuitBreaker
from adapters.index.base import (
    ALL_TIER_BITS,
    DROP,
    GUESS,
    REMOVE,
    STORE,
    TIER_BITS,
    BatchIndex,
    IndexLimits,
    IndexStats,
    KVIndex,
    PrefixMatch,
    Write,
    apply_writes,
    tier_of_bits,
)
from adapters.index.guarded import GuardedIndex
from adapters.index.memory import MemoryIndex
from adapters.index.redis import RedisIndex
from conductor.core.block_keys import XxhashKeys
from conductor.core.types import Tier

from .conftest import REDIS_URL, redis_available
from .redis_proc import redis_process

KEYS = XxhashKeys(16, seed=11)
DEVICE, HOST, STORE_TIER = TIER_BITS[Tier.DEVICE], TIER_BITS[Tier.HOST], TIER_BITS[Tier.STORE]
Make = Callable[[IndexLimits | None], BatchIndex]


def prompt(tag: int, blocks: int) -> list[int]:
    return KEYS.keys([tag * 100_000 + i for i in range(blocks * 16)])


@pytest.fixture(params=["memory", "redis"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Make]:
    """Indexes of one backend, each on its own prefix (its own cap), deleted afterwards."""
    made: list[RedisIndex] = []

    def new(limits: IndexLimits | None = None) -> BatchIndex:
        if request.param == "memory":
            return MemoryIndex(limits)
        if not redis_available():
            pytest.fail(f"the tests need a Redis at {REDIS_URL}")
        idx = RedisIndex(
            REDIS_URL, prefix=f"test:kvbatch:{uuid.uuid4().hex[:12]}:", limits=limits, timeout_s=10, write_timeout_s=10
        )
        made.append(idx)
        return idx

    yield new
    for idx in made:
        await idx.clear()
        await idx.close()


async def one_by_one(index: KVIndex, instance: str, writes: Sequence[Write]) -> None:
    """The reference: each write through the single-write methods, in order."""
    for kind, bits, keys in writes:
        if kind == DROP:
            await index.drop_instance(instance)
        elif kind == REMOVE:
            await index.remove(instance, keys, tier=None if bits == ALL_TIER_BITS else tier_of_bits(bits))
        else:
            await index.insert(instance, keys, tier=tier_of_bits(bits), confirmed=kind == STORE)


def view(m: PrefixMatch) -> tuple[dict[str, int], dict[str, int], dict[str, Tier]]:
    return dict(m.blocks), dict(m.confirmed_blocks), dict(m.tiers)


async def same_state(a: KVIndex, b: KVIndex, probes: Sequence[Sequence[int]], *, stats: bool = True) -> list[Any]:
    """Both indexes' answers to every probe and their stats (equal, or the assertion shows where).
    stats=False between backends: Redis counts a dropped instance's LRU members until trimmed."""
    got = [view(await a.match(p)) for p in probes]
    want = [view(await b.match(p)) for p in probes]
    assert got == want
    if not stats:
        return got
    sa, sb = await a.stats(), await b.stats()
    assert (sa.blocks, sa.evictions, sorted(sa.instances)) == (sb.blocks, sb.evictions, sorted(sb.instances))
    return got


async def test_a_batch_leaves_the_index_as_its_writes_one_by_one(make: Make) -> None:
    batched, single = make(None), make(None)
    a, b, c, d = prompt(1, 10), prompt(2, 5), prompt(3, 6), prompt(4, 4)
    first: list[Write] = [
        (STORE, DEVICE, a),
        (STORE, HOST, a[:4]),  # offloaded copies of the head
        (REMOVE, DEVICE, a[6:]),  # evicted from HBM: stored earlier in this same batch
        (REMOVE, ALL_TIER_BITS, a[3:4]),  # gone from every tier: the run stops at block 3
        (STORE, DEVICE, b),
        (REMOVE, ALL_TIER_BITS, b),  # stored and removed within the batch: nothing left
        (GUESS, DEVICE, c),
        (STORE, DEVICE, c[:3]),  # an event confirms the guessed head
    ]
    await batched.apply("p", first)
    await one_by_one(single, "p", first)
    got = await same_state(batched, single, [a, b, c, d])
    assert got[0] == ({"p": 3}, {"p": 3}, {"p": Tier.DEVICE})
    assert got[1] == ({}, {}, {})
    assert got[2][:2] == ({"p": 6}, {"p": 3})
    second: list[Write] = [(STORE, DEVICE, d), (DROP, 0, ()), (STORE, STORE_TIER, d[:2]), (REMOVE, DEVICE, d[:1])]
    await batched.apply("p", second)
    await one_by_one(single, "p", second)
    got = await same_state(batched, single, [a, b, c, d])
    # cleared, then two blocks stored in the store tier; removing the device copy leaves them
    assert got == [({}, {}, {})] * 3 + [({"p": 2}, {"p": 2}, {"p": Tier.STORE})]


async def test_the_cap_is_kept_after_every_insert_of_a_batch(make: Make) -> None:
    limits = IndexLimits(max_blocks=100)
    batched, single = make(limits), make(limits)
    x, y, z = prompt(5, 80), prompt(6, 40), prompt(7, 30)
    # y pushes 20 of x's tail out; removing y later in the batch does not bring them back, and z
    # then fits without another eviction
    writes: list[Write] = [(STORE, DEVICE, x), (STORE, DEVICE, y), (REMOVE, ALL_TIER_BITS, y), (STORE, DEVICE, z)]
    await batched.apply("p", writes)
    await one_by_one(single, "p", writes)
    got = await same_state(batched, single, [x, y, z])
    assert [g[0] for g in got] == [{"p": 60}, {}, {"p": 30}]
    stats: IndexStats = await batched.stats()
    assert (stats.blocks, stats.evictions) == (90, 20)


async def test_bad_writes_are_refused_before_any_is_applied(make: Make) -> None:
    idx = make(None)
    keys = prompt(8, 3)
    for bad in ((9, DEVICE, keys), (STORE, DEVICE | HOST, keys), (GUESS, 0, keys), (REMOVE, 8, keys)):
        with pytest.raises(ValueError, match="index"):
            await idx.apply("p", [(STORE, DEVICE, keys), bad])
    assert (await idx.match(keys)).blocks == {}
    await idx.apply("p", [])  # nothing to do: no call, no error
    await idx.apply("p", [(STORE, DEVICE, []), (REMOVE, DEVICE, [])])
    assert (await idx.match(keys)).blocks == {}


def random_batch(rng: random.Random, chains: list[list[int]]) -> list[Write]:
    writes: list[Write] = []
    for _ in range(rng.randrange(1, 9)):
        keys = rng.choice(chains)
        lo = rng.choice([0, 0, rng.randrange(len(keys))])
        part = keys[lo : rng.randrange(lo + 1, len(keys) + 1)]
        op = rng.random()
        if op < 0.5:
            bit = rng.choice([DEVICE, DEVICE, HOST, STORE_TIER])
            writes.append((STORE if rng.random() < 0.8 else GUESS, bit, part))
        elif op < 0.95:
            writes.append((REMOVE, rng.choice([ALL_TIER_BITS, DEVICE, HOST]), part))
        else:
            writes.append((DROP, 0, ()))
    return writes


async def test_random_batches_give_what_the_memory_index_gives_one_write_at_a_time(make: Make) -> None:
    rng = random.Random(33)
    limits = IndexLimits(unconfirmed_ttl_s=600)  # nothing expires or is evicted: the answers must be equal
    batched, memory = make(limits), MemoryIndex(limits)
    chains = [prompt(20 + c, 40) for c in range(3)]
    names = ["i0", "i1", "i2"]
    for step in range(60):
        inst = rng.choice(names)
        writes = random_batch(rng, chains)
        await batched.apply(inst, writes)
        await one_by_one(memory, inst, writes)
        probes = [chain[: rng.randrange(1, 41)] for chain in chains]
        assert [view(await batched.match(p)) for p in probes] == [view(await memory.match(p)) for p in probes], step


class SingleWrites:
    """A KVIndex with the single-write methods only (as a KVIndex of another module may be)."""

    def __init__(self) -> None:
        self.inner = MemoryIndex()
        self.limits = self.inner.limits

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        await self.inner.insert(instance, keys, tier=tier, confirmed=confirmed)

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        await self.inner.remove(instance, keys, tier=tier)

    async def drop_instance(self, instance: str) -> None:
        await self.inner.drop_instance(instance)

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        return await self.inner.match(keys)

    async def stats(self) -> IndexStats:
        return await self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


async def test_an_index_without_apply_gets_the_writes_one_by_one() -> None:
    plain, batched = SingleWrites(), MemoryIndex()
    a = prompt(9, 6)
    writes: list[Write] = [
        (STORE, DEVICE, a),
        (STORE, HOST, a),
        (STORE, STORE_TIER, a[:5]),
        (REMOVE, DEVICE | HOST, a[4:]),  # two tiers at once: block 4 keeps its store copy
        (GUESS, DEVICE, prompt(10, 2)),
    ]
    await apply_writes(plain, "p", writes)
    await apply_writes(batched, "p", writes)
    got = await same_state(plain, batched, [a, prompt(10, 2)])
    assert got[0] == ({"p": 5}, {"p": 5}, {"p": Tier.STORE})
    with pytest.raises(ValueError, match="unknown index write kind"):
        await apply_writes(plain, "p", [(7, DEVICE, a)])


def script_calls(*ports: int) -> dict[str, int]:
    """Script calls the servers have run, by command (the commands a script runs count apart)."""
    calls: dict[str, int] = {}
    for port in ports:
        with redis.Redis(port=port) as client:
            stats = client.info("commandstats")
        for name in ("evalsha", "eval", "script|load"):
            calls[name] = calls.get(name, 0) + int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
    return calls


async def test_a_batch_is_one_round_trip_and_the_guard_keeps_a_local_copy() -> None:
    with redis_process() as server:
        primary = RedisIndex(server.url, prefix="test:rt:", timeout_s=10, write_timeout_s=10)
        guarded = GuardedIndex(primary, CircuitBreaker("test index"), fallback=MemoryIndex(), write_timeout_s=10)
        try:
            a, b = prompt(11, 8), prompt(12, 4)
            await guarded.apply("p", [(STORE, DEVICE, a[:1])])  # the first call loads the script
            before = script_calls(server.port)
            batch: list[Write] = [
                (STORE, DEVICE, a),
                (REMOVE, DEVICE, a[5:]),
                (STORE, HOST, b),
                (DROP, 0, ()),
                (STORE, DEVICE, a[:3]),
            ]
            await guarded.apply("p", batch)
            after = script_calls(server.port)
            assert {k: after[k] - before[k] for k in after} == {"evalsha": 1, "eval": 0, "script|load": 0}
            assert guarded.fallback is not None
            await same_state(primary, guarded.fallback, [a, b], stats=False)
            assert (await primary.match(a)).blocks == {"p": 3} and guarded.missed_writes == 0
        finally:
            await guarded.close()


async def test_hundreds_of_feeds_writing_at_once_wait_their_turn_not_fail() -> None:
    """One batch in flight per instance, 300 instances: more calls than redis-py's pool has
    connections (100, past which it fails a call at once). They queue and all land."""
    with redis_process() as server:
        idx = RedisIndex(server.url, prefix="test:many:", timeout_s=30, write_timeout_s=30)
        try:
            keys = prompt(13, 4)
            await asyncio.gather(*(idx.apply(f"engine-{n}", [(STORE, DEVICE, keys)]) for n in range(300)))
            assert len((await idx.stats()).instances) == 300
            found = await asyncio.gather(*(idx.match(keys) for _ in range(300)))
            assert all(len(m.blocks) == 300 for m in found)
        finally:
            await idx.close()
