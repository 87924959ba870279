"""Sharing predictor lessons between gateway replicas through Redis (`load_share.mode: redis`).

Replicas in front of the same workers each learn from the outcomes of the requests they dispatched:
with three replicas each refits its models on a third of the outcomes (predictors/lessons.py says
what a lesson is and why a process learns its siblings'). adapters/lesson_share.py carries them
between the worker processes of one gateway; this carries them between replicas, through the Redis
the load share already uses.

All replicas append to one Redis stream, `<prefix>stream`: every `flush_s` a replica with new
lessons adds one entry (its replica id and at most `MAX_LESSONS` lessons, msgpack) and, in the same
pipelined round trip, reads the entries added since its last read, at most `read_entries` of them.
It learns every other replica's lessons (each checked by `learn`, predictors.lessons.checked) and
skips its own. Bounded everywhere: the stream is trimmed to about `max_entries` entries and expires
`expire_s` after its last write (no replica left), the outbox keeps the newest `max_outbox` lessons
(older ones counted as dropped), one entry is one exchange's worth. A replica starts reading at the
stream's end: what was learned before it started is not replayed (its models start from the same
profile, and the entries may be from a fleet long gone).

Learning is best effort, as between worker processes: Redis down, hung or gone only means lessons
are lost (counted as dropped) until it answers; every exchange is bounded by `timeout_s` and goes
through a circuit breaker, so nothing waits on it and the event loop that decides never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry

from adapters.breaker import CircuitBreaker, fail_fast_redis, register_breaker
from adapters.lesson_share import MAX_LESSONS, Learn, learn_all

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[list[str | int | float]]).decode


class RedisLessonShare:
    """Replica `replica_id`'s lessons out to the others and theirs in, through one Redis stream."""

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        *,
        prefix: str = "conductor:lessons:",
        flush_s: float = 0.05,
        timeout_s: float = 0.2,
        max_entries: int = 2048,
        read_entries: int = 64,
        max_outbox: int = 4096,
        expire_s: float = 600.0,
        registry: CollectorRegistry | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.counts: Counter[str] = Counter()
        self.replica_id = replica_id
        self._url = redis_url
        self._key = f"{prefix}stream"
        self._flush_s = flush_s
        self.timeout_s = timeout_s
        self._max_entries = max_entries
        self._read_entries = read_entries
        self._expire_ms = int(expire_s * 1000)
        self._outbox: deque[list[str | int | float]] = deque(maxlen=max_outbox)
        self._last_id: bytes | None = None  # the newest entry read; None: not yet positioned at the end
        self._redis: aioredis.Redis | None = None
        self._learn: Learn | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None  # the client's close, held until done
        self._wake = asyncio.Event()
        self.breaker = breaker or CircuitBreaker("lesson share Redis", logger=log)
        register_breaker(self.breaker, registry, "conductor_lesson_share_redis")

    def start(self, learn: Learn) -> None:
        self._learn = learn
        self._redis = fail_fast_redis(self._url, timeout_s=self.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="lesson-share")

    def publish(self, lessons: Iterable[tuple[str | int | float, ...]]) -> None:
        if self._learn is None:
            return
        outbox = self._outbox
        for lesson in lessons:
            if len(outbox) == outbox.maxlen:  # Redis slower than learning: the oldest lesson goes
                self.counts["dropped"] += 1
            outbox.append(list(lesson))
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            # an exchange every flush_s while lessons come, or to read the others' at least that often
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_s)
            self._wake.clear()
            await self.exchange()
            await asyncio.sleep(self._flush_s)  # lessons meanwhile gather into the next entry

    async def exchange(self) -> bool:
        """One exchange through the breaker (tests call it to exchange now): True when it happened."""
        taken = [self._outbox.popleft() for _ in range(min(MAX_LESSONS, len(self._outbox)))]
        done = await self.breaker.call(lambda: self._exchange(taken), _false, timeout_s=self.timeout_s)
        if not done and taken:
            self.counts["dropped"] += len(taken)  # not sent: best effort, later outcomes teach the same
        return done

    async def _exchange(self, batch: list[list[str | int | float]]) -> bool:
        r = self._redis
        assert r is not None
        last = self._last_id
        if last is None:  # first exchange: start after the newest entry, not at the oldest
            newest: list[Any] = await r.xrevrange(self._key, "+", "-", count=1)  # type: ignore[assignment]
            last = self._last_id = newest[0][0] if newest else b"0-0"
        async with r.pipeline(transaction=False) as pipe:
            if batch:
                pipe.xadd(self._key, {"r": self.replica_id, "l": _encode(batch)}, maxlen=self._max_entries, approximate=True)
                pipe.pexpire(self._key, self._expire_ms)
            pipe.xread({self._key: last}, count=self._read_entries)
            *_, read = await pipe.execute()
        if batch:
            self.counts["sent"] += len(batch)
        for _stream, entries in read or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                self._take(fields)
        return True

    def _take(self, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"r", b"").decode(errors="replace") == self.replica_id or self._learn is None:
            return  # our own entry, read back with the others'
        try:
            lessons = _decode(fields.get(b"l", b""))
        except msgspec.DecodeError:
            self.counts["refused"] += 1
            return
        learn_all(self._learn, lessons, self.counts)

    def close(self) -> None:
        self._learn = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._redis is not None:
            redis, self._redis = self._redis, None
            with contextlib.suppress(RuntimeError):  # no loop left at interpreter exit
                self._closing = asyncio.get_running_loop().create_task(redis.aclose())


def _false() -> bool:
    return False
