"""What a faulty or forged KV event publisher can do to the index, over real ZMQ sockets (issue 34):
bad messages are dropped and counted with the sequence state untouched, a far-ahead jump is not
acted on by itself, oversize messages never arrive, big batches are applied in slices."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.kv_event_batch import EventBatch, batch_blocks, decode_batch
from adapters.kv_events import EventSource, EventSubscriber
from conductor.core.block_keys import XxhashKeys
from conductor.kv.event_metrics import KVEventsCollector
from tests.adapters.test_kv_events import BS, WirePublisher, _batch, connect, ctx, stored, wait_for

__all__ = ["ctx"]  # the fixture, shared with test_kv_events.py

SCHEME = XxhashKeys(BS)
A = list(range(2 * BS))
B = list(range(500, 500 + 2 * BS))  # the two blocks after A's


class Feed:
    """A publisher, a subscriber on it, and the index it feeds (xxhash keys: a resync leaves the
    instance blind to children of what it held, the worst case)."""

    def __init__(self, ctx: zmq.asyncio.Context, **options: Any) -> None:
        self.index = MemoryIndex()
        self.feeder = IndexFeeder(self.index, SCHEME, translate=True)
        self.pub = WirePublisher(ctx, bind=True, replay=False)
        self.sub = EventSubscriber(
            EventSource("p0", f"tcp://*:{self.pub.port}"), self.feeder.on_batch, self.feeder.on_resync, context=ctx, **options
        )

    async def forge(self, seq: int, payload: bytes, *extra: bytes) -> None:
        """A message straight onto the wire, its seq whatever the forger likes."""
        await self.pub.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload, *extra])

    async def applied_upto(self, seq: int) -> None:
        await wait_for(lambda: self.sub.stats.last_seq == seq)

    def held(self, tokens: list[int]) -> int:
        return self.index.match_sync(SCHEME.keys(tokens)).blocks.get("p0", 0)

    async def close(self) -> None:
        await self.sub.close()
        await self.pub.close()


@pytest.fixture
async def feed(ctx: zmq.asyncio.Context, request: pytest.FixtureRequest) -> AsyncIterator[Feed]:
    options = getattr(request, "param", {})
    f = Feed(ctx, **options)
    await connect(f.pub, f.sub)
    try:
        yield f
    finally:
        await f.close()


GARBAGE = {
    "not-msgpack": b"\xc1\xc1\xc1 garbage",
    "wrong-shape": msgspec.msgpack.encode({"ts": "yesterday", "events": 5}),
    "negative-hash": _batch([stored([-7], None, A[:BS])]),
    "truncated": _batch([stored([1, 2], None, A)])[:-3],
}


@pytest.mark.parametrize("payload", GARBAGE.values(), ids=GARBAGE.keys())
async def test_garbage_with_a_far_sequence_number_is_dropped_and_counted(feed: Feed, payload: bytes) -> None:
    await feed.pub.publish([stored([1, 2], None, A)])
    await feed.forge(feed.pub.seq + 1_000_000, payload)
    await feed.pub.publish([stored([3, 4], 2, B)])  # the real feed goes on: children of A's blocks
    await feed.applied_upto(feed.pub.seq - 1)
    st = feed.sub.stats
    assert (st.resyncs, st.gaps) == (0, 0)
    assert sum(st.rejected.values()) == 1 and set(st.rejected) <= {"undecodable", "invalid"}
    assert feed.held(A + B) == 4  # nothing forgotten: B chained onto A's keys


async def test_a_forged_far_ahead_empty_batch_does_not_wipe_the_instance(feed: Feed) -> None:
    await feed.pub.publish([stored([1, 2], None, A)])
    await feed.forge(feed.pub.seq + 1_000_000, _batch([]))  # decodes, and checks out
    await feed.pub.publish([stored([3, 4], 2, B)])
    await feed.applied_upto(feed.pub.seq - 1)
    st = feed.sub.stats
    assert (st.resyncs, st.gaps) == (0, 0) and st.rejected == {"seq_jump": 1}
    assert feed.held(A + B) == 4


@pytest.mark.parametrize("feed", [{"max_seq_jump": 100}], indirect=True)
async def test_a_real_jump_counts_once_the_feed_goes_on_from_it(feed: Feed) -> None:
    """A long outage: the publisher went on far past the bound; its next batch confirms the jump."""
    await feed.pub.publish([stored([1, 2], None, A)])
    feed.pub.seq += 500  # lost on the wire, beyond any replay
    await feed.pub.publish([stored([5, 6], None, B)])  # held: forged or real?
    await feed.pub.publish([stored([7], 6, list(range(900, 900 + BS)))])  # real: it goes on from there
    await feed.applied_upto(feed.pub.seq - 1)
    st = feed.sub.stats
    assert (st.resyncs, st.gaps) == (1, 1) and st.rejected == {}
    assert feed.held(A) == 0  # the gap forgot what came before it
    assert feed.held(B + list(range(900, 900 + BS))) == 3  # the held batch and the next, applied


async def test_a_message_of_the_wrong_shape_is_counted_and_changes_nothing(feed: Feed) -> None:
    await feed.pub.publish([stored([1, 2], None, A)])
    await feed.forge(feed.pub.seq, _batch([]), b"a fourth frame")
    await feed.pub.pub.send_multipart([b"kv", b"short", _batch([])])
    await feed.pub.publish([stored([3, 4], 2, B)])
    await feed.applied_upto(feed.pub.seq - 1)
    st = feed.sub.stats
    assert st.rejected == {"frames": 2} and (st.resyncs, st.gaps) == (0, 0)
    assert feed.held(A + B) == 4


@pytest.mark.parametrize("feed", [{"max_message_bytes": 64 * 1024}], indirect=True)
async def test_an_oversize_message_never_reaches_the_index(feed: Feed) -> None:
    big_tokens = list(range(20_000, 20_000 + 2000 * BS))
    big = [stored(list(range(10_000, 12_000)), None, big_tokens)]
    assert len(_batch(big)) > 64 * 1024
    await feed.pub.publish(big)
    # ZMQ cut the connection that carried it (MAXMSGSIZE): publish until the feed is back
    after = feed.sub.stats.batches
    while feed.sub.stats.batches == after:
        await feed.pub.publish([stored([1, 2], None, A)])
        await asyncio.sleep(0.02)
    assert feed.held(big_tokens) == 0
    assert feed.held(A) == 2
    # what ZMQ cannot see (an inproc peer, a replayed message) the subscriber checks itself
    await feed.sub.handle(feed.pub.seq, _batch(big))
    assert feed.sub.stats.rejected == {"oversize": 1} and feed.held(big_tokens) == 0


@pytest.mark.parametrize("feed", [{"log_interval_s": 3600.0}], indirect=True)
async def test_a_flood_of_bad_messages_is_one_log_line_and_a_counter(feed: Feed, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="adapters.kv_events")
    for i in range(30):
        await feed.forge(feed.pub.seq + i, b"\xc1 not a batch")
    await feed.pub.publish([stored([1, 2], None, A)])
    await feed.applied_upto(feed.pub.seq - 1)
    dropped = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert feed.sub.stats.rejected == {"undecodable": 30}
    families = {f.name: f for f in KVEventsCollector([feed.sub], feed.feeder, ["p0"]).collect()}
    [sample] = families["conductor_kv_events_rejected"].samples
    assert sample.labels == {"instance": "p0", "rank": "0", "reason": "undecodable"} and sample.value == 30


def chain(n: int, first_hash: int = 1) -> tuple[list[int], dict[str, Any]]:
    tokens = [(i * 7) % 50_000 for i in range(n * BS)]
    return tokens, stored(list(range(first_hash, first_hash + n)), None, tokens)


@pytest.mark.parametrize("feed", [{"slice_blocks": 500}], indirect=True)
async def test_a_big_batch_is_applied_in_slices_with_the_loop_running_between(feed: Feed) -> None:
    loop = asyncio.get_running_loop()
    turns = [0]
    seen: list[tuple[int, int]] = []  # (blocks, loop turns so far) per call

    async def on_batch(instance: str, batch: EventBatch) -> None:
        seen.append((batch_blocks(batch), turns[0]))
        loop.call_soon(lambda: turns.__setitem__(0, turns[0] + 1))  # runs only if the loop gets a turn
        await feed.feeder.on_batch(instance, batch)

    feed.sub._on_batch = on_batch  # the test's recorder in front of the feeder
    tokens, event = chain(3000)
    removed = {"type": "BlockRemoved", "block_hashes": list(range(1801, 3001)), "medium": "GPU"}
    await feed.pub.publish([event, removed])
    await wait_for(lambda: sum(blocks for blocks, _ in seen) == 4200)  # the batch's last block applied
    sizes = [blocks for blocks, _ in seen]
    assert max(sizes) <= 500 and len(sizes) == 9
    assert [t for _, t in seen] == list(range(9))  # the loop ran between every two slices
    # the index ends exactly as the batch applied whole leaves it
    whole = MemoryIndex()
    await IndexFeeder(whole, SCHEME, translate=True).on_batch("p0", decode_batch(_batch([event, removed])))
    keys = SCHEME.keys(tokens)
    assert feed.index.match_sync(keys).blocks == whole.match_sync(keys).blocks == {"p0": 1800}
