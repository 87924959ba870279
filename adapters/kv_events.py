"""vLLM KV cache events over ZMQ: decoding, and one subscriber per instance with gap repair.

Wire format (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`):
- PUB messages are three frames: [topic, seq as 8-byte big-endian unsigned, msgpack payload];
- the payload is an EventBatch: an array [ts, events, data_parallel_rank] (a map with those names
  in some vLLM versions: both are accepted);
- each event is a msgpack map tagged by "type" (BlockStored, BlockRemoved, AllBlocksCleared), or in
  older versions an array whose first element is that tag and the rest the fields in order;
- block hashes are ints (low 64 bits of the digest) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0,
  raw digests: those are folded to the same low 64 bits here;
- the optional ROUTER replay socket takes [b"", start seq] from a DEALER and answers
  [b"", seq, payload] for every buffered batch from start on, then [b"", seq -1, b""].

Catching up: a gateway that starts after its workers (or restarts) has missed every block they
cached before. With a replay endpoint, the subscriber asks for everything still buffered (from seq
0) right after subscribing, so the index starts with what the workers hold, as far back as the
buffer reaches (vLLM's buffer_steps). After a publisher restart, or a gap the replay cannot fill
completely, the index forgets the instance and re-applies the buffered run that ends just before
the live feed resumes.

Socket direction mirrors vLLM's rule: its PUB binds when the endpoint holds "*" or "::" (or is
ipc/inproc), so we connect (with "*" replaced by the worker's host); otherwise it connects to the
concrete address given, so we must bind there. The replay ROUTER always binds, so we connect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from adapters.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_LOW64 = (1 << 64) - 1
END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): end of a replay
# field order of the array-encoded (array_like) event structs of older vLLM versions
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def as_event_id(h: int | bytes) -> int:
    """A block hash as the 64-bit int vLLM sends by default (raw digests folded to their low bits)."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h, "big") & _LOW64
    return int(h) & _LOW64


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks a worker just cached (one request's new blocks, in chain order).

    block_hashes: vLLM's hash of each block (low 64 bits). parent_block_hash: hash of the block
    before the first one, None at the start of a prompt. token_ids: all blocks' tokens, concatenated.
    medium: "GPU" or "CPU" (offloaded), None means GPU. lora_name/extra_keys: what else went into
    vLLM's hash; blocks that carry them cannot be keyed from token ids alone.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks a worker evicted from `medium`."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache (reset, or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: when, what, and from which data-parallel rank."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return {k: raw.get(k) for k in names}
    return {k: (raw[i + 1] if i + 1 < len(raw) else None) for i, k in enumerate(names)}


def _decode_event(raw: Any) -> KVEvent | None:
    tag = raw.get("type") if isinstance(raw, Mapping) else (raw[0] if raw else None)
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        parent = f["parent_block_hash"]
        extra = f["extra_keys"]
        return BlockStored(
            block_hashes=tuple(as_event_id(h) for h in f["block_hashes"] or ()),
            parent_block_hash=None if parent is None else as_event_id(parent),
            token_ids=tuple(f["token_ids"] or ()),
            block_size=int(f["block_size"] or 0),
            medium=f["medium"],
            lora_name=f["lora_name"],
            extra_keys=None if extra is None else tuple(extra),
            group_idx=f["group_idx"],
        )
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved(tuple(as_event_id(h) for h in f["block_hashes"] or ()), f["medium"], f["group_idx"])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer event type: ignored, not fatal


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack EventBatch payload (array or map form)."""
    raw = msgspec.msgpack.decode(payload)
    if isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts", 0.0), raw.get("events", ()), raw.get("data_parallel_rank")
    else:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    decoded = tuple(e for e in (_decode_event(r) for r in events) if e is not None)
    return EventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank)


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one instance publishes.

    instance: the instance id events are attributed to.
    endpoint: the endpoint exactly as given to vLLM's --kv-events-config.
    worker_host: host to put in place of "*" when vLLM binds (from the instance URL).
    replay_endpoint: vLLM's replay_endpoint, or None when it has none.
    topic: vLLM's topic ("" subscribes to all).
    rank: the data-parallel rank publishing there (its own sequence numbers).
    """

    instance: str
    endpoint: str
    worker_host: str = "127.0.0.1"
    replay_endpoint: str | None = None
    topic: str = ""
    rank: int = 0

    @staticmethod
    def for_instance(
        instance: str, url: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "", rank: int = 0
    ) -> EventSource:
        return EventSource(instance, endpoint, urlsplit(url).hostname or "127.0.0.1", replay_endpoint, topic, rank)


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Where data-parallel rank r publishes: vLLM adds r to a tcp port, or "_dp{r}" to inproc/ipc."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def publisher_binds(endpoint: str) -> bool:
    """vLLM's own rule for its PUB socket."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_address(endpoint: str, worker_host: str) -> tuple[str, bool]:
    """(address, bind?) for our side of `endpoint` as configured on the worker."""
    if publisher_binds(endpoint):
        host = f"[{worker_host}]" if ":" in worker_host else worker_host
        return endpoint.replace("[::]", host).replace("*", host), False
    return endpoint, True


Handler = Callable[[str, EventBatch], Awaitable[None]]
ResyncHandler = Callable[[str, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Counters for one instance's feed (one data-parallel rank): batches applied (live and replayed),
    gaps seen live, batches replayed, replay requests, resyncs, the last seq; loop time of the last
    batch; wall clock at start, and the last batch's publish time (the worker's clock) and receipt."""

    batches: int
    gaps: int
    replayed: int
    resyncs: int
    last_seq: int | None
    last_event_at: float | None
    replay_requests: int = 0
    started_wall: float | None = None
    last_batch_ts: float | None = None
    last_received_wall: float | None = None


class EventSubscriber:
    """Receives one instance's KV events, in order, repairing sequence gaps.

    A gap (a seq more than one past the last) is repaired from the replay socket; failing that,
    `on_resync` (the index forgets the instance). A seq that goes backwards means the publisher
    restarted with an empty cache: also a resync. Catching up: see the module docstring.
    """

    def __init__(
        self,
        source: EventSource,
        on_batch: Handler,
        on_resync: ResyncHandler,
        *,
        context: zmq.asyncio.Context,
        replay_timeout_s: float = 1.0,
        catch_up: bool = True,
    ) -> None:
        self.source = source
        self._on_batch = on_batch
        self._on_resync = on_resync
        self._ctx = context
        self._replay_timeout_s = replay_timeout_s
        self._catch_up = catch_up
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._last: int | None = None
        # after a catch-up: live batches up to here were already applied from the replay (they
        # queued on the SUB socket meanwhile); not a restart
        self._replayed_upto: int | None = None
        self._batches = self._gaps = self._replayed = self._resyncs = self._replay_requests = 0
        self._last_event_at: float | None = None
        self._started_wall: float | None = None
        self._last_batch_ts: float | None = None
        self._last_received_wall: float | None = None
        self.address, self.binds = subscriber_address(source.endpoint, source.worker_host)

    async def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        if self.binds:
            sub.bind(self.address)
        else:
            sub.connect(self.address)
        self._sub = sub
        self._started_wall = time.time()
        # subscribed first, replay second: whatever is published meanwhile queues on the socket
        if self._catch_up and self.source.replay_endpoint is not None:
            await self.catch_up()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.source.instance}")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    @property
    def stats(self) -> SubscriberStats:
        return SubscriberStats(
            self._batches,
            self._gaps,
            self._replayed,
            self._resyncs,
            self._last,
            self._last_event_at,
            self._replay_requests,
            self._started_wall,
            self._last_batch_ts,
            self._last_received_wall,
        )

    async def catch_up(self) -> int:
        """Apply every batch the worker's replay buffer still holds; the number applied."""
        got = await self._replay(0)
        if not got:
            log.info("kv events from %s: replay buffer empty or unanswered at start-up", self.source.instance)
            return 0
        applied = await self._apply_run(got, None)
        first = self._last - applied + 1 if self._last is not None else 0
        self._replayed_upto = self._last
        log.info(
            "kv events from %s: caught up on %d buffered batches (seq %d..%s)%s",
            self.source.instance,
            applied,
            first,
            self._last,
            "" if first == 0 else "; blocks cached before that are unknown until announced again",
        )
        return applied

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("kv events from %s: malformed message with %d frames", self.source.instance, len(frames))
                continue
            try:
                await self.handle(int.from_bytes(frames[1], "big"), frames[2])
            except Exception:  # one bad batch must not end the feed
                log.exception("kv events from %s: batch failed", self.source.instance)

    async def handle(self, seq: int, payload: bytes) -> None:
        """Apply one published batch, after repairing any gap before it."""
        if self._replayed_upto is not None:
            if seq <= self._replayed_upto:
                return  # queued while the catch-up replayed it
            self._replayed_upto = None
        last = self._last
        if last is None and self._batches == 0 and seq > 0 and self._catch_up and self.source.replay_endpoint is not None:
            # The first batch since start-up, but not the publisher's first: the SUB socket was
            # still joining (ZMQ's slow joiner) when the ones before went out, after the catch-up
            # found the buffer empty. They are lost on the wire but still in the replay buffer.
            self._gaps += 1
            await self._apply_run(await self._replay(0), seq)
        if last is not None:
            if seq == last:
                return  # a duplicate (e.g. overlap between a replay and the live feed)
            if seq < last:
                await self._resync(f"sequence went back from {last} to {seq}: publisher restarted")
                if seq > 0 and self.source.replay_endpoint is not None:
                    await self._apply_run(await self._replay(0), seq)  # the new process's first batches
            elif seq > last + 1:
                self._gaps += 1
                await self._repair(last + 1, seq)
        await self._apply(seq, payload)

    async def _apply(self, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        self._last = seq
        self._batches += 1
        self._last_event_at = asyncio.get_running_loop().time()
        self._last_batch_ts = batch.ts
        self._last_received_wall = time.time()
        await self._on_batch(self.source.instance, batch)

    async def _apply_run(self, got: list[tuple[int, bytes]], upto: int | None) -> int:
        """Apply the consecutive run of replayed batches that ends right before `upto` (None: the
        newest); older ones, cut off from it by a hole, would leave the index inconsistent."""
        by_seq = dict(got)
        if upto is None:
            if not by_seq:
                return 0
            upto = max(by_seq) + 1
        start = upto
        while start - 1 in by_seq:
            start -= 1
        for s in range(start, upto):
            await self._apply(s, by_seq[s])
        self._replayed += upto - start
        return upto - start

    async def _repair(self, start: int, upto: int) -> None:
        missing = upto - start
        got: list[tuple[int, bytes]] = []
        if self.source.replay_endpoint is not None:
            got = [(s, p) for s, p in await self._replay(start) if start <= s < upto]
            if len(got) == missing:
                await self._apply_run(got, upto)
                log.info("kv events from %s: replayed %d missed batches", self.source.instance, missing)
                return
        await self._resync(f"missed batches {start}..{upto - 1} and could not replay them")
        await self._apply_run(got, upto)  # the part the buffer still had, when it ends at the live feed

    async def _resync(self, reason: str) -> None:
        self._resyncs += 1
        self._last = None
        log.warning("kv events from %s: resync (%s)", self.source.instance, reason)
        await self._on_resync(self.source.instance, reason)

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self.source.replay_endpoint is not None
        address, _ = subscriber_address(self.source.replay_endpoint, self.source.worker_host)
        self._replay_requests += 1
        # A fresh DEALER per request: a late answer to an abandoned request cannot be mistaken
        # for the answer to the next one.
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(address)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self._replay_timeout_s)
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_bytes, "big"), payload))
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("kv events from %s: replay from %d failed: %r", self.source.instance, start, exc)
            return out
        finally:
            sock.close(linger=0)
