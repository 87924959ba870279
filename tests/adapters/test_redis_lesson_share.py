"""adapters/redis_lesson_share.py against the real Redis on 127.0.0.1:6379 (each test its own key
prefix) and, for the outage, a redis-server of the test's own: one replica's lessons are learned by
every other replica and never by itself; a replica's predictors refit on another's outcomes; what
is not a lesson is refused; a replica joining late does not replay the stream; the stream stays
bounded; a Redis that is gone costs dropped lessons, never an error. Waits poll, with generous limits."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import redis.asyncio as aioredis

from adapters.redis_lesson_share import RedisLessonShare
from predictors.lessons import checked
from predictors.online import Predictors
from tests.adapters.index.redis_proc import redis_process

URL = "redis://127.0.0.1:6379/0"


class Pupil:
    """A learn callback that checks each lesson as Predictors.learn does and keeps it."""

    def __init__(self) -> None:
        self.learned: list[tuple[object, ...]] = []

    def __call__(self, raw: object) -> None:
        self.learned.append(checked(raw))


async def until(cond: Callable[[], bool], limit_s: float = 20.0) -> bool:
    for _ in range(int(limit_s / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    name = f"test:lessons:{uuid.uuid4().hex}:"
    yield name
    client = aioredis.Redis.from_url(URL)
    await client.delete(f"{name}stream")
    await client.aclose()


def replica(name: str, prefix: str, **kw: object) -> RedisLessonShare:
    return RedisLessonShare(URL, name, prefix=prefix, flush_s=0.005, timeout_s=2.0, **kw)  # type: ignore[arg-type]


async def test_every_other_replica_learns_a_replicas_lessons_and_it_does_not(prefix: str) -> None:
    shares = [replica(f"r{i}", prefix) for i in range(3)]
    pupils = [Pupil() for _ in shares]
    for share, pupil in zip(shares, pupils, strict=True):
        share.start(pupil)
    try:
        assert await until(lambda: all(s._last_id is not None for s in shares))  # positioned at the end
        lessons = [("tbt", 4, 1000 + i, 0.02) for i in range(600)]  # more than one entry's worth
        shares[0].publish(lessons[:10])
        shares[0].publish(lessons[10:])
        shares[1].publish([("prefill", 512, 0, 0.05)])
        want = [(k, x, y, float(z)) for k, x, y, z in lessons]
        assert await until(lambda: len(pupils[2].learned) == len(want) + 1 and len(pupils[1].learned) == len(want))
        assert [lesson for lesson in pupils[2].learned if lesson[0] == "tbt"] == want  # in order
        assert pupils[1].learned == want
        assert await until(lambda: pupils[0].learned == [("prefill", 512, 0, 0.05)])  # only the other's
        assert shares[0].counts["sent"] == len(want) and shares[2].counts["received"] == len(want) + 1
    finally:
        for share in shares:
            share.close()


async def test_a_replicas_predictors_refit_on_another_replicas_outcomes(prefix: str) -> None:
    """The point of sharing: B never observes a request, yet its TBT model moves to what A measured."""
    a, b = Predictors.from_bundled_profile(), Predictors.from_bundled_profile()
    share_a, share_b = replica("a", prefix), replica("b", prefix)
    outbox = a.record_lessons()
    share_a.start(a.learn)
    share_b.start(b.learn)
    try:
        assert await until(lambda: share_a._last_id is not None and share_b._last_id is not None)
        profile = Predictors.from_bundled_profile()
        for i in range(400):  # decode steps twice as slow as the profile says
            batch, kv = 1 + i % 32, 10_000 + 300 * i
            a.observe_tbt(batch, kv, 2 * profile.tbt_s(batch, kv))
        assert a.refits > 0 and b.refits == 0
        share_a.publish(outbox)
        outbox.clear()
        assert await until(lambda: b.refits == a.refits)
        assert b.tbt_s(16, 50_000) > 1.3 * profile.tbt_s(16, 50_000)  # moved towards what A measured
        assert b.params.tbt.coef == a.params.tbt.coef  # the same samples in the same order: the same fit
    finally:
        share_a.close()
        share_b.close()


async def test_what_is_not_a_lesson_is_refused_and_the_rest_learned(prefix: str) -> None:
    share = replica("r", prefix)
    pupil = Pupil()
    share.start(pupil)
    client = aioredis.Redis.from_url(URL)
    try:
        assert await until(lambda: share._last_id is not None)
        key = f"{prefix}stream"
        await client.xadd(key, {"r": "rogue", "l": b"\xc1 not msgpack"})
        mixed = [["tbt", 4, 100], ["no such", 1], ["tbt", 4, 100, 0.02]]
        await client.xadd(key, {"r": "rogue", "l": msgspec.msgpack.encode(mixed)})
        assert await until(lambda: share.counts["refused"] == 3)
        assert pupil.learned == [("tbt", 4, 100, 0.02)]
    finally:
        share.close()
        await client.aclose()


async def test_a_replica_joining_late_starts_at_the_end_and_the_stream_stays_bounded(prefix: str) -> None:
    early = replica("early", prefix, max_entries=50)
    early.start(Pupil())
    late = None
    client = aioredis.Redis.from_url(URL)
    try:
        assert await until(lambda: early._last_id is not None)
        for i in range(300):  # one entry per exchange
            early.publish([("tbt", 4, i, 0.02)])
            await early.exchange()
        assert await client.xlen(f"{prefix}stream") < 300  # trimmed (approximately) to max_entries
        assert 0 < await client.pttl(f"{prefix}stream") <= 600_000  # gone some time after the last write
        pupil = Pupil()
        late = replica("late", prefix)
        late.start(pupil)
        assert await until(lambda: late is not None and late._last_id is not None)
        early.publish([("tbt", 8, 1, 0.03)])
        assert await until(lambda: len(pupil.learned) >= 1)
        assert pupil.learned == [("tbt", 8, 1, 0.03)]  # none of the 300 before it started
    finally:
        early.close()
        if late is not None:
            late.close()
        await client.aclose()


async def test_redis_gone_drops_lessons_and_never_raises() -> None:
    with redis_process() as server:
        share = RedisLessonShare(server.url, "r", flush_s=0.005, timeout_s=0.2)
        share.start(Pupil())
        try:
            assert await until(lambda: share._last_id is not None)
            server.kill()
            share.publish([("tbt", 4, 100, 0.02)] * 5)
            assert await until(lambda: share.counts["dropped"] >= 5)
            assert share.counts["sent"] == 0
        finally:
            share.close()
