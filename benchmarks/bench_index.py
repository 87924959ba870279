"""Block keys and cache index lookups, side by side: `python benchmarks/bench_index.py`.

For prompts of 1K, 8K, 32K and 128K tokens at block sizes 16, 32 and 512 it measures (median of
repeated runs, milliseconds):
- keys: chained xxh3_64 keys of the whole prompt (conductor.core.block_keys.XxhashKeys);
- memory: MemoryIndex.match, the worst case: the whole prompt cached on one instance, half of it on
  another, a quarter on a third (each holder's run is walked to its end);
- redis: RedisIndex.match of the same, one round trip to the Redis at --redis-url;
- redis/1: the same with the prompt cached on one instance only (the usual case: one holder);
- total: keys + lookup, against the goal (128K tokens: <= 2 ms in memory, <= 4 ms on Redis).
`--vllm` adds vLLM-mode keys (sha256_cbor: what matching vLLM's own hashes costs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial

import numpy as np

from adapters.index.base import IndexLimits
from adapters.index.memory import MemoryIndex
from adapters.index.redis import RedisIndex
from conductor.core.block_keys import VllmKeys, XxhashKeys

SIZES = (1024, 8192, 32768, 131072)
BLOCK_SIZES = (16, 32, 512)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def _amedian_ms(fn: Callable[[], Awaitable[object]], reps: int) -> float:
    await fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def run(redis_url: str | None, with_vllm: bool) -> None:
    rng = np.random.default_rng(0)
    header = f"{'tokens':>7} {'bs':>4} {'blocks':>6} | {'keys':>7} {'memory':>7} {'total':>7}"
    if redis_url:
        header += f" | {'redis':>7} {'total':>7} | {'redis/1':>7} {'total':>7}"
    if with_vllm:
        header += f" | {'vllm keys':>9}"
    print(header + "   (ms, median)")
    print("-" * len(header))
    for bs in BLOCK_SIZES:
        for n in SIZES:
            tokens = rng.integers(0, 150_000, size=n, dtype=np.int64).tolist()
            scheme = XxhashKeys(block_size=bs, seed=1)
            reps = max(5, min(200, 400_000 // n))
            keys_ms = _median_ms(partial(scheme.keys, tokens), reps)
            keys = scheme.keys(tokens)
            mem = MemoryIndex(IndexLimits(max_blocks=10_000_000))
            for inst, frac in (("p0", 1.0), ("p1", 0.5), ("p2", 0.25)):
                mem.insert_sync(inst, keys[: int(len(keys) * frac)], confirmed=True)
            mem_ms = _median_ms(partial(mem.match_sync, keys), reps)
            assert mem.match_sync(keys).blocks["p0"] == len(keys)
            row = f"{n:>7} {bs:>4} {len(keys):>6} | {keys_ms:>7.3f} {mem_ms:>7.3f} {keys_ms + mem_ms:>7.3f}"
            if redis_url:
                for holders in ((("p0", 1.0), ("p1", 0.5), ("p2", 0.25)), (("p0", 1.0),)):
                    ridx = RedisIndex(
                        redis_url, prefix=f"bench:kvidx:{uuid.uuid4().hex[:8]}:", limits=IndexLimits(max_blocks=10_000_000)
                    )
                    try:
                        for inst, frac in holders:
                            await ridx.insert(inst, keys[: int(len(keys) * frac)], confirmed=True)
                        redis_ms = await _amedian_ms(partial(ridx.match, keys), reps)
                        assert (await ridx.match(keys)).blocks["p0"] == len(keys)
                    finally:
                        await ridx.clear()
                        await ridx.close()
                    row += f" | {redis_ms:>7.3f} {keys_ms + redis_ms:>7.3f}"
            if with_vllm:
                vk = VllmKeys(bs, "sha256_cbor", "0")
                row += f" | {_median_ms(partial(vk.keys, tokens), max(3, reps // 10)):>9.3f}"
            print(row)
    print("goal: 128K tokens keyed and looked up in <= 2 ms in memory, <= 4 ms on Redis")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' to skip Redis")
    parser.add_argument("--vllm", action="store_true", help="also time vLLM-mode (sha256_cbor) keys")
    args = parser.parse_args()
    asyncio.run(run(args.redis_url or None, args.vllm))


if __name__ == "__main__":
    main()
