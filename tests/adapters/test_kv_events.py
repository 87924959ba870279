"""KV events over real ZMQ sockets, from a publisher written here from vLLM's wire format only."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from adapters.index.base import KVIndex
from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.index.redis import RedisIndex
from adapters.kv_events import EventSource, EventSubscriber, decode_batch, offset_endpoint, subscriber_address
from conductor.core.block_keys import VllmKeys, XxhashKeys
from conductor.core.types import Tier
from conductor.core.vllm_hash import VllmBlockHasher

BS = 16


class WirePublisher:
    """vLLM's ZmqEventPublisher as seen on the wire: PUB [topic, seq, batch] plus a ROUTER replay."""

    def __init__(self, ctx: zmq.asyncio.Context, *, bind: bool, replay: bool, port: int | None = None):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if bind:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            assert port is not None
            self.port = port
            self.pub.connect(f"tcp://127.0.0.1:{port}")
        self.router: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.task = asyncio.create_task(self._serve_replay()) if self.router else None

    async def publish(self, events: list[dict[str, Any]], *, drop: bool = False) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])  # EventBatch [ts, events, dp_rank]
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if not drop:  # a dropped batch is lost on the wire but stays replayable, as in vLLM
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
        self.pub.close(0)
        if self.router:
            self.router.close(0)


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def wait_for(cond: Any, within_s: float = 30.0) -> None:  # generous: a busy box is slow, never wrong
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def connect(pub: WirePublisher, sub: EventSubscriber) -> None:
    """ZMQ subscriptions take a moment: publish empty batches until one arrives."""
    await sub.start()
    deadline = time.monotonic() + 5
    while sub.stats.batches == 0:
        assert time.monotonic() < deadline
        await pub.publish([])
        await asyncio.sleep(0.02)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(3 * BS)]
    return [shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 6) * BS + 5)] for _ in range(n)]


def vllm_events(hasher: VllmBlockHasher, prompt: list[int], seen: set[int]) -> dict[str, Any] | None:
    """What vLLM announces for one request: its newly cached full blocks, chained to the parent."""
    ids = hasher.event_ids(prompt)
    new = [i for i, h in enumerate(ids) if h not in seen]
    if not new:
        return None
    first = new[0]
    seen.update(ids)
    return stored(ids[first:], ids[first - 1] if first else None, prompt[first * BS : len(ids) * BS])


def test_decode_accepts_array_and_map_forms() -> None:
    ev = stored([1, 2], None, list(range(2 * BS)))
    a = decode_batch(msgspec.msgpack.encode([1.5, [ev, {"type": "AllBlocksCleared"}], 0]))
    b = decode_batch(msgspec.msgpack.encode({"ts": 1.5, "events": [ev, {"type": "AllBlocksCleared"}]}))
    # array_like events of older vLLM versions: [tag, fields in declaration order]
    old = ["BlockStored", [1, 2], None, list(range(2 * BS)), BS, None, "GPU"]
    c = decode_batch(msgspec.msgpack.encode([1.5, [old, ["BlockRemoved", [b"\x00" * 24 + (2).to_bytes(8, "big")], "GPU"]]]))
    assert a.events == b.events and a.events[0] == c.events[0]
    assert a.data_parallel_rank == 0 and b.data_parallel_rank is None
    assert c.events[1].block_hashes == (2,)  # type: ignore[union-attr]  # raw digests fold to low 64 bits


def test_socket_direction_follows_vllm_rule() -> None:
    assert subscriber_address("tcp://*:5557", "10.0.0.5") == ("tcp://10.0.0.5:5557", False)
    assert subscriber_address("tcp://10.0.0.9:5557", "10.0.0.5") == ("tcp://10.0.0.9:5557", True)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def make_index(backend: str, tag: str) -> KVIndex:
    if backend == "memory":
        return MemoryIndex()
    # generous bounds: this test is about what the index holds, and a starved CI box once took over the
    # 0.5 s request-path default for one lookup
    return RedisIndex(
        "redis://127.0.0.1:6379/0", prefix=f"test:kvevents:{tag}:{time.monotonic_ns()}:", timeout_s=10.0, write_timeout_s=10.0
    )


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
async def test_events_build_the_same_index_as_dispatches(ctx: zmq.asyncio.Context, mode: str, backend: str) -> None:
    hasher = VllmBlockHasher("sha256_cbor", BS, "42")
    scheme = XxhashKeys(BS, seed=7) if mode == "xxhash" else VllmKeys(BS, "sha256_cbor", "42")
    from_events, from_dispatch = make_index(backend, "events"), make_index(backend, "dispatch")
    feeder = IndexFeeder(from_events, scheme, translate=mode == "xxhash")
    pub = WirePublisher(ctx, bind=True, replay=False)
    sub = EventSubscriber(EventSource("p0", f"tcp://*:{pub.port}"), feeder.on_batch, feeder.on_resync, context=ctx)
    try:
        await connect(pub, sub)
        seen: set[int] = set()
        batch = prompts(12, seed=1)
        for p in batch:
            ev = vllm_events(hasher, p, seen)
            if ev:
                await pub.publish([ev])
            await from_dispatch.insert("p0", scheme.keys(p), confirmed=True)
        await wait_for(lambda: feeder.stats.stored >= len(seen))
        assert feeder.stats.unmapped == 0
        for p in batch + prompts(3, seed=2):
            keys = scheme.keys(p)
            assert await from_events.match(keys) == await from_dispatch.match(keys)
        assert (await from_events.match(scheme.keys(batch[0]))).blocks["p0"] == len(batch[0]) // BS
        # BlockRemoved of the last block of prompt 0 shortens its prefix by one block
        last = hasher.event_ids(batch[0])[-1]
        await pub.publish([{"type": "BlockRemoved", "block_hashes": [last], "medium": "GPU"}])
        await wait_for(lambda: feeder.stats.removed == 1)
        assert (await from_events.match(scheme.keys(batch[0]))).blocks["p0"] == len(batch[0]) // BS - 1
        await pub.publish([{"type": "AllBlocksCleared"}])
        deadline = time.monotonic() + 5
        while (await from_events.match(scheme.keys(batch[1]))).blocks:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        await sub.close()
        await pub.close()
        for idx in (from_events, from_dispatch):
            if isinstance(idx, RedisIndex):
                await idx.clear()
            await idx.close()


async def test_subscriber_binds_when_vllm_connects(ctx: zmq.asyncio.Context) -> None:
    index = MemoryIndex()
    feeder = IndexFeeder(index, XxhashKeys(BS), translate=True)
    with socket.socket() as probe:  # a free port for us to bind, as vLLM would be told to connect there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sub = EventSubscriber(EventSource("p1", f"tcp://127.0.0.1:{port}"), feeder.on_batch, feeder.on_resync, context=ctx)
    assert sub.binds
    pub = WirePublisher(ctx, bind=False, replay=False, port=port)
    try:
        await connect(pub, sub)
        await pub.publish([stored([11, 12], None, list(range(2 * BS)), medium="CPU")])
        await wait_for(lambda: feeder.stats.stored == 2)
        m = index.match_sync(XxhashKeys(BS).keys(list(range(2 * BS))))
        assert m.blocks == {"p1": 2} and m.tiers == {"p1": Tier.HOST}
    finally:
        await sub.close()
        await pub.close()


@pytest.mark.parametrize("replay", [True, False])
async def test_sequence_gap_is_repaired_by_replay_or_resync(ctx: zmq.asyncio.Context, replay: bool) -> None:
    index = MemoryIndex()
    scheme = XxhashKeys(BS)
    feeder = IndexFeeder(index, scheme, translate=True)
    pub = WirePublisher(ctx, bind=True, replay=replay)
    replay_ep = f"tcp://*:{pub.replay_port}" if replay else None
    sub = EventSubscriber(
        EventSource("p0", f"tcp://*:{pub.port}", replay_endpoint=replay_ep), feeder.on_batch, feeder.on_resync, context=ctx
    )
    a, b, c = (list(range(s, s + 2 * BS)) for s in (0, 1000, 2000))
    try:
        await connect(pub, sub)
        await pub.publish([stored([1, 2], None, a)])
        await pub.publish([stored([3, 4], None, b)], drop=True)  # lost on the wire
        await pub.publish([stored([5, 6], None, c)])
        await wait_for(lambda: index.match_sync(scheme.keys(c)).blocks)
        st = sub.stats
        assert st.gaps == 1
        if replay:
            assert st.replayed == 1 and st.resyncs == 0
            assert index.match_sync(scheme.keys(b)).blocks == {"p0": 2}  # the lost batch, replayed
            assert index.match_sync(scheme.keys(a)).blocks == {"p0": 2}
        else:
            assert st.resyncs == 1
            assert index.match_sync(scheme.keys(b)).blocks == {}  # never seen
            assert index.match_sync(scheme.keys(a)).blocks == {}  # dropped by the resync
    finally:
        await sub.close()
        await pub.close()


def _batch(events: list[dict[str, Any]]) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, 0])


async def test_catch_up_at_start_applies_what_the_worker_buffered(ctx: zmq.asyncio.Context) -> None:
    """The gateway starts after the worker cached blocks: the replay buffer brings them in."""
    index = MemoryIndex()
    scheme = XxhashKeys(BS)
    feeder = IndexFeeder(index, scheme, translate=True)
    pub = WirePublisher(ctx, bind=True, replay=True)
    a, b = list(range(0, 3 * BS)), list(range(5000, 5000 + 2 * BS))
    # published before anyone listens: lost on the wire, kept in the worker's replay buffer
    await pub.publish([stored([1, 2, 3], None, a)])
    await pub.publish([stored([4, 5], None, b)])
    await pub.publish([{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}])
    sub = EventSubscriber(
        EventSource("p0", f"tcp://*:{pub.port}", replay_endpoint=f"tcp://*:{pub.replay_port}"),
        feeder.on_batch,
        feeder.on_resync,
        context=ctx,
    )
    try:
        await sub.start()  # the catch-up is done when start() returns
        assert index.match_sync(scheme.keys(a)).blocks == {"p0": 2}  # the removal replayed in order
        assert index.match_sync(scheme.keys(b)).confirmed_blocks == {"p0": 2}
        st = sub.stats
        assert (st.replayed, st.replay_requests, st.last_seq, st.gaps, st.resyncs) == (3, 1, 2, 0, 0)
        # the live feed goes on from there. A SUB socket may still be joining when the first live
        # batch goes out (ZMQ's slow joiner: a busy box drops it on the wire); then the next batch
        # shows the gap and the replay socket brings it back. Either way it arrives, no restart.
        c = list(range(9000, 9000 + BS))
        await pub.publish([stored([6], None, c)])
        published = 4
        for _ in range(30):
            try:
                await wait_for(lambda: bool(index.match_sync(scheme.keys(c)).blocks), within_s=1.0)
                break
            except AssertionError:
                await pub.publish([{"type": "BlockRemoved", "block_hashes": [999], "medium": "GPU"}])
                published += 1
        await wait_for(lambda: sub.stats.last_seq == published - 1)
        assert index.match_sync(scheme.keys(c)).blocks == {"p0": 1}
        assert sub.stats.resyncs == 0
        assert sub.stats.gaps == 0 or sub.stats.replayed > 3  # in order, or repaired from the replay
        # a batch that queued on the socket during the catch-up is a duplicate, not a restart
        last = sub.stats.last_seq
        assert last is not None
        sub._replayed_upto = last
        await sub.handle(last - 1, _batch([]))
        assert sub.stats.resyncs == 0 and sub.stats.last_seq == last
    finally:
        await sub.close()
        await pub.close()


async def test_batches_lost_while_the_socket_joins_come_from_the_replay(ctx: zmq.asyncio.Context) -> None:
    """The catch-up found the buffer empty, then the worker published while the SUB socket was still
    joining: the first live batch is not seq 0, so the ones before it are fetched from the replay."""
    index = MemoryIndex()
    scheme = XxhashKeys(BS)
    feeder = IndexFeeder(index, scheme, translate=True)
    pub = WirePublisher(ctx, bind=True, replay=True)
    sub = EventSubscriber(
        EventSource("p0", f"tcp://*:{pub.port}", replay_endpoint=f"tcp://*:{pub.replay_port}"),
        feeder.on_batch,
        feeder.on_resync,
        context=ctx,
    )
    lost, live = list(range(0, 2 * BS)), list(range(4000, 4000 + BS))
    try:
        await sub.start()
        assert sub.stats.replay_requests == 1 and sub.stats.last_seq is None  # nothing buffered yet
        await pub.publish([stored([1, 2], None, lost)], drop=True)  # gone on the wire, kept for replay
        pub.seq += 1
        await sub.handle(1, _batch([stored([3], None, live)]))
        st = sub.stats
        assert (st.gaps, st.replayed, st.replay_requests, st.last_seq, st.resyncs) == (1, 1, 2, 1, 0)
        assert index.match_sync(scheme.keys(lost)).blocks == {"p0": 2}
        assert index.match_sync(scheme.keys(live)).blocks == {"p0": 1}
        await sub.handle(2, _batch([]))  # later batches in order: no more replays
        assert sub.stats.replay_requests == 2
    finally:
        await sub.close()
        await pub.close()


async def test_catch_up_can_be_turned_off_and_survives_a_silent_replay_socket(ctx: zmq.asyncio.Context) -> None:
    index = MemoryIndex()
    feeder = IndexFeeder(index, XxhashKeys(BS), translate=True)
    with socket.socket() as probe:  # a replay endpoint nobody serves: the catch-up times out, start goes on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    src = EventSource("p0", "tcp://*:1", replay_endpoint=f"tcp://*:{dead}")
    quiet = EventSubscriber(src, feeder.on_batch, feeder.on_resync, context=ctx, catch_up=False)
    silent = EventSubscriber(src, feeder.on_batch, feeder.on_resync, context=ctx, replay_timeout_s=0.1)
    try:
        await quiet.start()
        await silent.start()
        assert quiet.stats.replay_requests == 0
        assert silent.stats.replay_requests == 1 and silent.stats.batches == 0 and silent.stats.last_seq is None
    finally:
        await quiet.close()
        await silent.close()


async def test_publisher_restart_refills_from_its_replay_buffer(ctx: zmq.asyncio.Context) -> None:
    index = MemoryIndex()
    scheme = XxhashKeys(BS)
    feeder = IndexFeeder(index, scheme, translate=True)
    pub = WirePublisher(ctx, bind=True, replay=True)
    sub = EventSubscriber(
        EventSource("p0", f"tcp://*:{pub.port}", replay_endpoint=f"tcp://*:{pub.replay_port}"),
        feeder.on_batch,
        feeder.on_resync,
        context=ctx,
        catch_up=False,
    )
    old, new0, new1 = (list(range(s, s + BS)) for s in (0, 3000, 6000))
    try:
        await sub.handle(7, _batch([stored([1], None, old)]))
        # the worker restarted: its buffer now holds seq 0 (missed here) and seq 1 arrives live
        pub.buffer = [(0, _batch([stored([2], None, new0)]))]
        await sub.handle(1, _batch([stored([3], None, new1)]))
        st = sub.stats
        assert st.resyncs == 1 and st.replayed == 1 and st.last_seq == 1
        assert index.match_sync(scheme.keys(old)).blocks == {}  # forgotten: that cache is gone
        assert index.match_sync(scheme.keys(new0)).blocks == {"p0": 1}  # from the new process's buffer
        assert index.match_sync(scheme.keys(new1)).blocks == {"p0": 1}
    finally:
        await sub.close()
        await pub.close()


async def test_unrepairable_gap_keeps_the_buffered_run_that_reaches_the_live_feed(ctx: zmq.asyncio.Context) -> None:
    index = MemoryIndex()
    scheme = XxhashKeys(BS)
    feeder = IndexFeeder(index, scheme, translate=True)
    pub = WirePublisher(ctx, bind=True, replay=True)
    sub = EventSubscriber(
        EventSource("p0", f"tcp://*:{pub.port}", replay_endpoint=f"tcp://*:{pub.replay_port}"),
        feeder.on_batch,
        feeder.on_resync,
        context=ctx,
        catch_up=False,
    )
    first, lost, kept, live = (list(range(s, s + BS)) for s in (0, 2000, 4000, 8000))
    try:
        await sub.handle(0, _batch([stored([1], None, first)]))
        # seq 1 has left the worker's buffer; seq 2 is still there; seq 3 arrives live
        pub.buffer = [(2, _batch([stored([3], None, kept)]))]
        await sub.handle(3, _batch([stored([4], None, live)]))
        st = sub.stats
        assert (st.gaps, st.resyncs, st.replayed, st.last_seq) == (1, 1, 1, 3)
        assert index.match_sync(scheme.keys(first)).blocks == {}
        assert index.match_sync(scheme.keys(lost)).blocks == {}
        assert index.match_sync(scheme.keys(kept)).blocks == {"p0": 1}
        assert index.match_sync(scheme.keys(live)).blocks == {"p0": 1}
    finally:
        await sub.close()
        await pub.close()


async def test_feeder_checks_worker_hashes_and_counts_orphans_per_instance() -> None:
    """vllm key mode: the gateway recomputes a prompt's first block hash from the event's token ids."""
    right = VllmBlockHasher("sha256_cbor", BS, "42")
    wrong = VllmBlockHasher("sha256_cbor", BS, "43")  # a worker started with another PYTHONHASHSEED
    feeder = IndexFeeder(MemoryIndex(), VllmKeys(BS, "sha256_cbor", "42"), translate=False)
    tokens = list(range(3 * BS))
    ids = right.event_ids(tokens)
    await feeder.on_batch("good", decode_batch(_batch([stored(ids, None, tokens)])))
    bad = wrong.event_ids(tokens)
    await feeder.on_batch("bad", decode_batch(_batch([stored(bad, None, tokens)])))
    # a child whose parent this gateway never saw stored: the worker cached the prefix before
    await feeder.on_batch("good", decode_batch(_batch([stored([99], 12345, list(range(BS)))])))
    good, mismatched = feeder.instance("good"), feeder.instance("bad")
    assert (good.hash_checked, good.hash_mismatched, good.stored, good.orphans) == (1, 0, 4, 1)
    assert (mismatched.hash_checked, mismatched.hash_mismatched) == (1, 1)
    assert mismatched.last_mismatch == (bad[0], ids[0])
    # a child of a known block is no orphan
    await feeder.on_batch("good", decode_batch(_batch([stored([100], ids[-1], list(range(BS)))])))
    assert good.orphans == 1
    # xxhash mode: children of unknown parents are the unmapped ones
    translating = IndexFeeder(MemoryIndex(), XxhashKeys(BS), translate=True)
    await translating.on_batch("p", decode_batch(_batch([stored([5, 6], 77, list(range(2 * BS)))])))
    assert translating.instance("p").orphans == 2 and translating.stats.unmapped == 2
    odd = {**stored([7], None, list(range(BS))), "block_size": 32}
    await translating.on_batch("p", decode_batch(_batch([odd])))
    assert translating.instance("p").block_size_mismatched == 1
