"""Fixtures shared by the adapter tests that talk to the real Redis on 127.0.0.1:6379."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    name = f"test:adapters:{uuid.uuid4().hex}:"
    yield name
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=f"{name}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
