"""RedisClusterIndex.match on a real six-node Redis Cluster: where each holder's run ends is found by
bisection (HEXISTS probes) and only that range is read, so the answers must stay the in-memory
index's wherever the run ends: at the first block, at the prompt's last block, just before a hole
that the probes jump over, at a chunk boundary of the read, and on random data with holes, tiers and
dispatch guesses over many instances."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from adapters.index.base import IndexLimits, PrefixMatch
from adapters.index.memory import MemoryIndex
from adapters.index.redis_cluster import RedisClusterIndex
from conductor.core.types import Tier
from tests.support.redis_cluster import RedisClusterNodes, redis_cluster, require_cluster_tools

from .test_index_batch import prompt

Make = Callable[[], RedisClusterIndex]
Answer = tuple[dict[str, int], dict[str, int], dict[str, Tier]]
# nothing expires or is evicted during a test: the answers must be equal
LIMITS = IndexLimits(unconfirmed_ttl_s=600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    require_cluster_tools()
    with redis_cluster() as nodes:
        yield nodes


@pytest.fixture
async def make(cluster: RedisClusterNodes) -> AsyncIterator[Make]:
    made: list[RedisClusterIndex] = []

    def new() -> RedisClusterIndex:
        prefix = f"test:kvcm:{uuid.uuid4().hex[:10]}:"
        idx = RedisClusterIndex(cluster.urls, prefix=prefix, limits=LIMITS, timeout_s=5, write_timeout_s=5)
        made.append(idx)
        return idx

    yield new
    for idx in made:
        await idx.clear()
        await idx.close()


def view(m: PrefixMatch) -> Answer:
    return dict(m.blocks), dict(m.confirmed_blocks), dict(m.tiers)


async def test_runs_ending_anywhere_are_measured_exactly(make: Make) -> None:
    idx, memory = make(), MemoryIndex(LIMITS)
    keys = prompt(900, 700)  # longer than the first read chunks (128, then 512)
    holes = {"head-only": [0], "one-short": list(range(699)), "all": list(range(700))}
    holes["gap-at-5"] = [i for i in range(700) if i != 5]  # the probes see blocks past the gap
    holes["gap-at-128"] = [i for i in range(700) if i != 128]  # a read chunk's boundary
    holes["gap-at-600"] = [i for i in range(700) if i not in (600, 650)]
    holes["head-and-tail"] = [0, 699]
    holes["no-head"] = list(range(1, 700))
    for name, held in holes.items():
        for idx_ in (idx, memory):
            await idx_.insert(name, [keys[i] for i in held], confirmed=True)
    for idx_ in (idx, memory):  # a slower tier and dispatch guesses deep in one run
        await idx_.insert("host-tail", keys[:300], tier=Tier.DEVICE, confirmed=True)
        await idx_.insert("host-tail", keys[300:640], tier=Tier.HOST, confirmed=True)
        await idx_.insert("host-tail", keys[640:690], confirmed=False)
    got = view(await idx.match(keys))
    assert got == view(await memory.match(keys))
    assert got[0] == {
        "head-only": 1,
        "one-short": 699,
        "all": 700,
        "gap-at-5": 5,
        "gap-at-128": 128,
        "gap-at-600": 600,
        "head-and-tail": 1,
        "host-tail": 690,
    }
    assert got[1]["host-tail"] == 640 and got[2]["host-tail"] == Tier.HOST
    for probe in (keys[:1], keys[:2], keys[5:300], keys[:700] + keys[:3]):
        assert view(await idx.match(probe)) == view(await memory.match(probe))


async def test_same_answers_as_the_memory_index_on_random_data_with_holes(make: Make) -> None:
    rng = random.Random(33)
    idx, memory = make(), MemoryIndex(LIMITS)
    chains = [prompt(910 + c, rng.choice([40, 300, 1100])) for c in range(5)]
    names = [f"gpu-{i}" for i in range(40)]  # over every shard's master, several holders per shard
    for step in range(300):
        inst, keys = rng.choice(names), rng.choice(chains)
        lo = rng.choice([0, 0, 0, rng.randrange(len(keys))])
        part = keys[lo : rng.randrange(lo + 1, len(keys) + 1)]
        op, tier, confirmed = rng.random(), rng.choice([Tier.DEVICE] * 3 + [Tier.HOST]), rng.random() < 0.8
        hole = [part[0]] if rng.random() < 0.7 else part  # one block out of a chain, or a run's tail
        for index in (idx, memory):
            if op < 0.5:
                await index.insert(inst, part, tier=tier, confirmed=confirmed)
            elif op < 0.7:
                await index.remove(inst, hole, tier=None)
            elif op < 0.72:
                await index.drop_instance(inst)
        if step % 10 == 9:
            for chain in chains:
                start = rng.choice([0, 0, rng.randrange(len(chain))])
                probe = chain[start : rng.randrange(start + 1, len(chain) + 1)]
                assert view(await idx.match(probe)) == view(await memory.match(probe)), step
    assert len({idx.shard_of(n) for n in (await idx.stats()).instances}) > 4
