"""Bounded memory under a million distinct blocks, and one Redis index shared by two processes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

from adapters.index.base import IndexLimits
from adapters.index.memory import MemoryIndex
from adapters.index.redis import RedisIndex
from conductor.core.block_keys import XxhashKeys

from .conftest import REDIS_URL

MILLION = 1_000_000
ROOT = Path(__file__).resolve().parents[3]


def distinct_keys(start: int, n: int) -> list[int]:
    return (np.arange(start, start + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).tolist()


async def test_memory_index_stays_under_its_bound_for_a_million_blocks() -> None:
    cap = 50_000
    idx = MemoryIndex(IndexLimits(max_blocks=cap))
    tracemalloc.start()
    try:
        for start in range(0, cap, 1000):
            idx.insert_sync("p0", distinct_keys(start, 1000), confirmed=True)
        full = tracemalloc.get_traced_memory()[0]
        peak_after_full = 0
        for start in range(cap, MILLION, 1000):
            idx.insert_sync(f"p{start % 3}", distinct_keys(start, 1000), confirmed=start % 2 == 0)
            peak_after_full = max(peak_after_full, tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    stats = await idx.stats()
    assert stats.blocks == cap == len(idx)
    assert stats.evictions == MILLION - cap
    # 950,000 more blocks streamed through; memory stays at the level of a full index
    assert peak_after_full < full * 1.5 + (2 << 20), (full, peak_after_full)
    assert full < cap * 400  # bytes per entry, generous
    # the newest blocks are the ones kept
    assert (await idx.match(distinct_keys(MILLION - 1000, 1000))).blocks


async def test_redis_index_stays_under_its_bound_for_a_million_blocks(redis_index_factory: Callable[..., RedisIndex]) -> None:
    cap = 20_000
    idx = redis_index_factory(IndexLimits(max_blocks=cap))
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await idx.insert("p0", distinct_keys(0, cap), confirmed=True)
        mem_full = (await client.memory_usage(f"{idx.prefix}i:p0") or 0) + (await client.memory_usage(f"{idx.prefix}lru") or 0)
        for start in range(cap, MILLION, 10_000):
            await idx.insert("p0" if start % 20_000 else "p1", distinct_keys(start, 10_000), confirmed=True)
        stats = await idx.stats()
        assert stats.blocks == cap
        assert stats.evictions == MILLION - cap
        fields = await client.hlen(f"{idx.prefix}i:p0") + await client.hlen(f"{idx.prefix}i:p1")
        assert fields == cap + 2  # each instance hash also holds its one encoding marker
        mem = sum([await client.memory_usage(f"{idx.prefix}{k}") or 0 for k in ("i:p0", "i:p1", "lru")])
        assert mem < mem_full * 1.5 + (1 << 20), (mem_full, mem)
        keys_under_prefix = [k async for k in client.scan_iter(match=f"{idx.prefix}*", count=1000)]
        assert len(keys_under_prefix) <= 7  # two instance hashes plus the index's own bookkeeping
    finally:
        await client.aclose()


_PEER = """
import asyncio, json, sys
from adapters.index.redis import RedisIndex
from conductor.core.block_keys import XxhashKeys

async def main():
    prefix, mine, theirs = sys.argv[1], sys.argv[2], sys.argv[3]
    idx = RedisIndex(sys.argv[4], prefix=prefix, timeout_s=10.0, write_timeout_s=10.0)
    keys = XxhashKeys(16).keys
    await idx.insert("peer-b", keys(list(range(int(mine) * 16))), confirmed=False)
    m = await idx.match(keys(list(range(int(theirs) * 16))))
    print(json.dumps(dict(m.blocks)))
    await idx.close()

asyncio.run(main())
"""


async def test_two_processes_share_one_redis_index(redis_index_factory: Callable[..., RedisIndex]) -> None:
    idx = redis_index_factory()
    keys = XxhashKeys(16).keys(list(range(12 * 16)))
    await idx.insert("gw-a", keys[:12], confirmed=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PEER, idx.prefix, "7", "12", REDIS_URL, env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    # the other process sees this one's blocks (and its own dispatch)
    assert json.loads(out) == {"gw-a": 12, "peer-b": 7}
    # and this one sees the other's
    assert (await idx.match(keys)).blocks == {"gw-a": 12, "peer-b": 7}
