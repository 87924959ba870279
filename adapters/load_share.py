"""Sharing in-flight load between gateway replicas.

Each replica knows exactly the work it dispatched itself (prefills queued, decode streams
running, per instance). With several replicas in front of the same workers, each must also see
the others' work, or every replica would think the cluster idle and pile onto the same instance.
A replica publishes its own in-flight work per instance to Redis every `interval_s` (one pipelined
round trip, a key that expires when the replica dies) and reads everyone else's in the same trip.
What a policy sees of other replicas is therefore at most one interval old.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec
from redis.exceptions import RedisError

from conductor.core.types import ActiveDecode, QueuedPrefill

log = logging.getLogger("conductor.load_share")

# instance -> (prefills as (new_tokens, cached_tokens, dispatched_at_wall_s),
#              decodes as (context_tokens, remaining_tokens, decoding))
LoadTable = dict[str, tuple[list[tuple[int, int, float]], list[tuple[int, int, bool]]]]
RemoteLoad = dict[str, tuple[tuple[QueuedPrefill, ...], tuple[ActiveDecode, ...]]]

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class LoadShare(Protocol):
    async def start(self, local: Callable[[], LoadTable]) -> None: ...

    async def close(self) -> None: ...

    def remote(self) -> RemoteLoad: ...


class NoLoadShare:
    """A single replica: nobody else's load to see."""

    async def start(self, local: Callable[[], LoadTable]) -> None:
        return None

    async def close(self) -> None:
        return None

    def remote(self) -> RemoteLoad:
        return {}


def merge_tables(tables: list[LoadTable], now_wall: float) -> RemoteLoad:
    """Other replicas' tables as the value objects a policy reads, oldest prefill first."""
    prefills: dict[str, list[tuple[int, int, float]]] = {}
    decodes: dict[str, list[ActiveDecode]] = {}
    for table in tables:
        for instance, (p_entries, d_entries) in table.items():
            prefills.setdefault(instance, []).extend(tuple(p) for p in p_entries)  # type: ignore[misc]
            decodes.setdefault(instance, []).extend(ActiveDecode(int(c), int(r), bool(d)) for c, r, d in d_entries)
    out: RemoteLoad = {}
    for instance in prefills.keys() | decodes.keys():
        queue = sorted(prefills.get(instance, []), key=lambda p: p[2])
        out[instance] = (
            tuple(QueuedPrefill(int(n), int(c), max(0.0, now_wall - t)) for n, c, t in queue),
            tuple(decodes.get(instance, [])),
        )
    return out


class RedisLoadShare:
    """Replicas exchange their in-flight tables through Redis hashes that expire."""

    def __init__(self, redis_url: str, replica_id: str, *, interval_s: float = 0.1, prefix: str = "conductor:load:") -> None:
        self._url = redis_url
        self.replica_id = replica_id
        self.interval_s = interval_s
        self._key = f"{prefix}{replica_id}"
        self._prefix = prefix
        self._remote: RemoteLoad = {}
        self._task: asyncio.Task[None] | None = None
        self._redis: object | None = None

    async def start(self, local: Callable[[], LoadTable]) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(self._url)
        self._local = local
        await self.sync_once()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._redis is not None:
            try:
                await self._redis.delete(self._key)  # type: ignore[attr-defined]
                await self._redis.zrem(self._prefix + "replicas", self.replica_id)  # type: ignore[attr-defined]
            except (OSError, ConnectionError, RedisError) as exc:  # closing: Redis may be gone already
                log.debug("could not withdraw this replica's load table: %s", exc)
            await self._redis.aclose()  # type: ignore[attr-defined]

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_once()
            except (OSError, ConnectionError, RedisError, msgspec.DecodeError) as exc:  # keep serving on local knowledge
                log.warning("load sharing through Redis failed: %s", exc)

    async def sync_once(self) -> None:
        r = self._redis
        assert r is not None
        ttl_ms = max(1000, int(self.interval_s * 5000))
        now = time.time()
        members = self._prefix + "replicas"
        async with r.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
            pipe.set(self._key, _encode(self._local()), px=ttl_ms)
            pipe.zadd(members, {self.replica_id: now})
            pipe.zremrangebyscore(members, "-inf", now - ttl_ms / 1000)  # replicas that stopped beating
            pipe.zrange(members, 0, -1)
            *_, replicas = await pipe.execute()
        others = [self._prefix + m.decode() for m in replicas if m.decode() != self.replica_id]
        tables: list[LoadTable] = []
        if others:
            for raw in await r.mget(others):  # type: ignore[attr-defined]
                if raw:
                    tables.append(_decode(raw))
        self._remote = merge_tables(tables, time.time())

    def remote(self) -> RemoteLoad:
        return self._remote


def local_table(states: Mapping[str, object]) -> LoadTable:
    """This replica's own in-flight work, in the shape it is published."""
    out: LoadTable = {}
    now_mono, now_wall = time.monotonic(), time.time()
    for name, state in states.items():
        prefills = [
            (p.new_tokens, p.cached_tokens, now_wall - (now_mono - state.started[rid]))  # type: ignore[attr-defined]
            for rid, p in state.prefills.items()  # type: ignore[attr-defined]
        ]
        decodes = [(d.context_tokens, d.remaining_tokens, d.decoding) for d in state.decodes.values()]  # type: ignore[attr-defined]
        if prefills or decodes:
            out[name] = (prefills, decodes)
    return out
