"""Index fixtures: the in-memory index, and the Redis index on the real server under its own prefix."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from adapters.index.base import IndexLimits
from adapters.index.redis import RedisIndex

REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_available() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def redis_prefix() -> str:
    return f"test:kvidx:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def redis_index_factory(redis_prefix: str) -> AsyncIterator[object]:
    """Make RedisIndex objects on one fresh prefix; everything under it is deleted afterwards."""
    if not redis_available():
        pytest.fail(f"the tests need a Redis at {REDIS_URL} (redis-server --port 6379 --save '')")
    made: list[RedisIndex] = []

    def make(limits: IndexLimits | None = None) -> RedisIndex:
        # a behaviour test, not a timeout test (test_redis_outage.py is): the 2 s write bound of a
        # gateway timed an insert out while the real-vLLM engines' start-ups took both cores in CI
        idx = RedisIndex(REDIS_URL, prefix=redis_prefix, limits=limits, timeout_s=10.0, write_timeout_s=10.0)
        made.append(idx)
        return idx

    yield make
    if made:
        await made[0].clear()
    for idx in made:
        await idx.close()
