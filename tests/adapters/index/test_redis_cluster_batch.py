"""RedisClusterIndex.apply on a real six-node Redis Cluster: a batch of writes for one instance is one
script on the node serving the instance's shard, with what its writes one by one would leave (the
same answers as the in-memory index, the fair-share cap kept after every insert)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from adapters.index.base import ALL_TIER_BITS, DROP, REMOVE, STORE, TIER_BITS, IndexLimits, Write
from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.index.redis_cluster import RedisClusterIndex
from adapters.kv_event_batch import EventBatch
from conductor.core.block_keys import XxhashKeys
from conductor.core.types import Tier
from tests.support.redis_cluster import RedisClusterNodes, redis_cluster, require_cluster_tools

from .test_feed_batch import BS, EVENTS, stored
from .test_index_batch import one_by_one, prompt, random_batch, script_calls, view

Make = Callable[..., RedisClusterIndex]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    require_cluster_tools()
    with redis_cluster() as nodes:
        yield nodes


@pytest.fixture
async def make(cluster: RedisClusterNodes) -> AsyncIterator[Make]:
    made: list[RedisClusterIndex] = []

    def new(limits: IndexLimits | None = None) -> RedisClusterIndex:
        prefix = f"test:kvcb:{uuid.uuid4().hex[:10]}:"
        idx = RedisClusterIndex(cluster.urls, prefix=prefix, limits=limits, timeout_s=5, write_timeout_s=5)
        made.append(idx)
        return idx

    yield new
    for idx in made:
        await idx.clear()
        await idx.close()


async def test_random_batches_give_what_the_memory_index_gives_one_write_at_a_time(make: Make) -> None:
    rng = random.Random(41)
    limits = IndexLimits(unconfirmed_ttl_s=600)  # nothing expires or is evicted: the answers must be equal
    idx, memory = make(limits), MemoryIndex(limits)
    chains = [prompt(60 + c, 40) for c in range(3)]
    names = [f"inst-{i}" for i in range(6)]
    for step in range(80):
        inst = rng.choice(names)
        writes = random_batch(rng, chains)
        await idx.apply(inst, writes)
        await one_by_one(memory, inst, writes)
        probes = [chain[: rng.randrange(1, 41)] for chain in chains]
        assert [view(await idx.match(p)) for p in probes] == [view(await memory.match(p)) for p in probes], step
    got, want = await idx.stats(), await memory.stats()
    assert (got.blocks, sorted(got.instances)) == (want.blocks, sorted(want.instances))
    assert len({idx.shard_of(n) for n in got.instances}) > 1


async def test_the_fair_share_cap_is_kept_after_every_insert_of_a_batch(make: Make) -> None:
    batched, single = make(IndexLimits(max_blocks=100)), make(IndexLimits(max_blocks=100))
    x, y, z = prompt(70, 80), prompt(71, 40), prompt(72, 30)
    device = TIER_BITS[Tier.DEVICE]
    # y pushes 20 of x's tail out; removing y later in the batch does not bring them back
    writes: list[Write] = [(STORE, device, x), (STORE, device, y), (REMOVE, ALL_TIER_BITS, y), (STORE, device, z)]
    await batched.apply("solo", writes)
    await one_by_one(single, "solo", writes)
    for idx in (batched, single):
        assert [(await idx.match(k)).blocks for k in (x, y, z)] == [{"solo": 60}, {}, {"solo": 30}]
        stats = await idx.stats()
        assert (stats.blocks, stats.evictions) == (90, 20)
    await batched.apply("solo", [(STORE, device, x[:5]), (DROP, 0, ()), (STORE, device, z[:4])])
    assert (await batched.match(z)).blocks == {"solo": 4} and (await batched.match(x)).blocks == {}


async def test_a_received_batch_is_one_script_on_one_node(cluster: RedisClusterNodes, make: Make) -> None:
    idx = make()
    feeder = IndexFeeder(idx, XxhashKeys(BS), translate=True)
    await feeder.on_batch("w", EventBatch(1.0, (stored([900], None),)))  # loads the script on its node
    before = script_calls(*cluster.ports)
    await feeder.on_batch("w", EventBatch(1.0, tuple(EVENTS)))
    after = script_calls(*cluster.ports)
    assert {k: after[k] - before[k] for k in after} == {"evalsha": 1, "eval": 0, "script|load": 0}
    assert feeder.instance("w").stored == 1 + 17


async def test_hundreds_of_feeds_writing_at_once_wait_their_turn_not_fail(make: Make) -> None:
    """More calls in flight than redis-py's cluster client allows connections to a node (100, past
    which it fails a call at once): they queue and all land."""
    idx = make()
    keys = prompt(73, 4)
    device = TIER_BITS[Tier.DEVICE]
    await idx.apply("engine-0", [(STORE, device, keys)])  # the slot map, version and counts read once
    await asyncio.gather(*(idx.apply(f"engine-{n}", [(STORE, device, keys)]) for n in range(400)))
    assert len((await idx.stats()).instances) == 400
    found = await asyncio.gather(*(idx.match(keys) for _ in range(300)))
    assert all(len(m.blocks) == 400 for m in found)
