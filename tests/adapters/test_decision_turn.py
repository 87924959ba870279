"""adapters/decision_turn.py through RedisLoadShare(turns=True), against the real Redis on
127.0.0.1:6379 (each test its own key prefix): a replica deciding while another holds the turn sees
what the holder dispatched under it; a holder that never gives the turn back delays the others by
max_wait_s at most; the gateway's settings wire turns and the Redis lesson share. No wall-clock
assertion: waits poll with generous limits."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from adapters.load_share import LoadTable, RedisLoadShare
from adapters.redis_lesson_share import RedisLessonShare
from adapters.shm_load_share import SharedMemoryLoadShare
from conductor.config.settings import Settings
from conductor.gateway import Gateway, _lesson_share, _load_share
from conductor.ops.metrics import GatewayMetrics

URL = "redis://127.0.0.1:6379/0"


def replica(name: str, prefix: str, *, turns: bool) -> RedisLoadShare:
    # a beat far longer than the test: only the turn (or a refresh) exchanges tables
    return RedisLoadShare(URL, name, interval_s=30.0, prefix=prefix, timeout_s=2.0, turns=turns)


async def blind_window(prefix: str, *, turns: bool) -> int:
    """A decides and dispatches right after its refresh; B refreshes meanwhile: the prefills of
    A that B then sees on prefill-0."""
    table_a: LoadTable = {}
    a, b = replica("a", prefix, turns=turns), replica("b", prefix, turns=turns)
    await a.start(lambda: dict(table_a))
    await b.start(dict)
    try:
        await a.refresh(0.0)  # A's decision begins (with turns: A holds the turn)
        deciding_b = asyncio.ensure_future(b.refresh(0.0))  # B's decision begins meanwhile
        table_a["prefill-0"] = ([(500, 0, time.time())], [])  # A dispatches, before its next await
        await deciding_b
        return len(b.remote().get("prefill-0", ((), ()))[0])
    finally:
        await a.close()
        await b.close()


async def test_a_replica_deciding_meanwhile_sees_what_the_holder_dispatched(prefix: str) -> None:
    assert await blind_window(prefix, turns=True) == 1


async def test_without_turns_the_same_replica_is_blind_to_it(prefix: str) -> None:
    """The case turns exist for (and the proof the test above can fail)."""
    assert await blind_window(prefix, turns=False) == 0


async def test_a_turn_never_given_back_delays_the_others_by_max_wait_only(prefix: str) -> None:
    b = replica("b", prefix, turns=True)
    await b.start(dict)
    client = aioredis.Redis.from_url(URL)
    try:
        await client.set(f"{prefix}turn", "dead-replica", px=60_000)  # a holder that died holding it
        await asyncio.wait_for(b.refresh(0.0), timeout=30)
        assert b.turn is not None and b.turn.counts["timeouts"] == 1 and not b.turn.holding
        await client.delete(f"{prefix}turn")
        await b.refresh(0.0)
        assert b.turn.counts["taken"] == 1 and b.turn.holding
    finally:
        await b.close()
        await client.aclose()


async def test_the_turn_is_given_back_after_the_decision(prefix: str) -> None:
    a = replica("a", prefix, turns=True)
    await a.start(dict)
    client = aioredis.Redis.from_url(URL)
    try:
        await a.refresh(0.0)
        assert a.turn is not None and a.turn.holding  # taken: the decision is made under it
        for _ in range(2000):  # the release runs two loop iterations after the decision
            if not a.turn.holding and await client.get(f"{prefix}turn") is None:
                break
            await asyncio.sleep(0.005)
        assert not a.turn.holding and await client.get(f"{prefix}turn") is None
        await a.refresh(0.0)  # and taken again by the next decision
        assert a.turn.counts["taken"] == 2
    finally:
        await a.close()
        await client.aclose()


def test_settings_wire_turns_and_the_redis_lesson_share() -> None:
    settings = Settings.model_validate(
        {"load_share": {"mode": "redis", "redis_url": URL, "replica_id": "r1", "turns": True}, "share_lessons": True}
    )
    load = _load_share(settings)
    assert isinstance(load, RedisLoadShare) and load.turn is not None
    lessons = _lesson_share(settings, load, GatewayMetrics())
    assert isinstance(lessons, RedisLessonShare) and lessons.replica_id == "r1"
    alone = Settings.model_validate({"load_share": {"mode": "redis", "redis_url": URL}, "share_lessons": False})
    assert not isinstance(_lesson_share(alone, _load_share(alone), GatewayMetrics()), RedisLessonShare)
    assert _load_share(alone).turn is None  # type: ignore[attr-defined]


def test_settings_give_a_worker_process_its_turns() -> None:
    """`--workers N`: the supervisor makes each worker's shared memory share; the gateway sets its
    turns from `load_share.turns` before it starts."""
    fleet = {
        "workers": 2,
        "admin_port": 30000,
        "prefill": [{"url": "http://127.0.0.1:1", "name": "p", "role": "prefill"}],
        "decode": [{"url": "http://127.0.0.1:2", "name": "d", "role": "decode"}],
    }
    for turns in (True, False):
        share = SharedMemoryLoadShare("unused", 0, 2, turns=not turns)
        Gateway(Settings.model_validate({**fleet, "load_share": {"turns": turns}}), load_share=share)
        assert share.turns is turns
