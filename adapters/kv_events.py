"""vLLM KV cache events over ZMQ: one subscriber per instance, with gap repair and bounds on what
a faulty or forged publisher can do to the index.

Wire format (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`):
- PUB messages are three frames: [topic, seq as 8-byte big-endian unsigned, msgpack payload]; seq
  grows by one per batch, from 0 when the publisher starts;
- the payload is an EventBatch (decoded and checked in adapters/kv_event_batch.py);
- the optional ROUTER replay socket takes [b"", start seq] from a DEALER and answers
  [b"", seq, payload] for every buffered batch from start on, then [b"", seq -1, b""].

Catching up: a gateway that starts after its workers (or restarts) has missed every block they
cached before. With a replay endpoint, the subscriber asks for everything still buffered (from seq
0) right after subscribing, so the index starts with what the workers hold, as far back as the
buffer reaches (vLLM's buffer_steps). After a publisher restart, or a gap the replay cannot fill
completely, the index forgets the instance and re-applies the buffered run that ends just before
the live feed resumes.

Bounds (issue 34): a message is only trusted once its batch decodes and checks out; one that does
not (too many frames, too big, not msgpack, implausible fields) is dropped and counted by reason,
with the sequence state untouched, and logged at most once per `log_interval_s`. Messages over
`max_message_bytes` are dropped by ZMQ itself (MAXMSGSIZE) before they are buffered. A sequence
number more than `max_seq_jump` past the last is not taken for a gap at once: vLLM counts up by one
per batch, and its replay buffer holds only the last buffer_steps batches, so such a jump is either
a long outage (the next batch continues from it, and then it is a gap: repaired or resynced) or a
forged message (the live feed goes on from where it was, and the jump is dropped). A batch of more
than `slice_blocks` blocks is applied in slices, the event loop running between them.

Where an instance publishes, and which side binds: adapters/kv_event_sources.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import zmq.asyncio

from adapters.kv_event_batch import (
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    as_event_id,
    batch_blocks,
    decode_batch,
    slice_batch,
)
from adapters.kv_event_sources import (
    END_SEQ,
    EventSource,
    FeedSocket,
    Message,
    offset_endpoint,
    publisher_binds,
    request_replay,
    subscriber_address,
)
from adapters.tasks import cancel_and_wait
from adapters.throttled_log import ThrottledLog
from conductor.core.event_bounds import DEFAULT_EVENT_BOUNDS

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventSource",
    "EventSubscriber",
    "KVEvent",
    "SubscriberStats",
    "as_event_id",
    "decode_batch",
    "offset_endpoint",
    "publisher_binds",
    "subscriber_address",
]

log = logging.getLogger(__name__)


BURST = 32  # a feed with a backlog never waits: after this many messages it lets the loop run (requests, other feeds)
CLOSE_WAIT_S = 5.0  # close()'s wait for the feed's task: a handler that ignores cancellation holds no shutdown forever

Handler = Callable[[str, EventBatch], Awaitable[None]]
ResyncHandler = Callable[[str, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Counters for one instance's feed (one data-parallel rank): batches applied (live and replayed),
    gaps seen live, batches replayed, replay requests, resyncs, the last seq; loop time of the last
    batch; wall clock at start, and the last batch's publish time (the worker's clock) and receipt;
    messages dropped, by reason (frames, oversize, undecodable, invalid, seq_jump)."""

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
    rejected: Mapping[str, int] = field(default_factory=dict)


class EventSubscriber:
    """Receives one instance's KV events, in order, repairing sequence gaps.

    A gap (a seq more than one past the last) is repaired from the replay socket; failing that,
    `on_resync` (the index forgets the instance). A seq that goes backwards means the publisher
    restarted with an empty cache: also a resync. Catching up, and the bounds: see the module
    docstring.
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
        max_message_bytes: int = DEFAULT_EVENT_BOUNDS["max_message_bytes"],
        max_seq_jump: int = DEFAULT_EVENT_BOUNDS["max_seq_jump"],
        slice_blocks: int = DEFAULT_EVENT_BOUNDS["slice_blocks"],
        log_interval_s: float = DEFAULT_EVENT_BOUNDS["log_interval_s"],
    ) -> None:
        self.source = source
        self._on_batch = on_batch
        self._on_resync = on_resync
        self._ctx = context
        self._replay_timeout_s = replay_timeout_s
        self._catch_up = catch_up
        self._max_message_bytes = max_message_bytes
        self._max_seq_jump = max_seq_jump
        self._slice_blocks = max(1, slice_blocks)
        self._feed: FeedSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._last: int | None = None
        # after a catch-up: live batches up to here were already applied from the replay (they
        # queued on the SUB socket meanwhile); not a restart
        self._replayed_upto: int | None = None
        self._held: tuple[int, EventBatch] | None = None  # a far jump, until the feed goes on from it
        self._batches = self._gaps = self._replayed = self._resyncs = self._replay_requests = 0
        self._rejected: dict[str, int] = {}
        self._last_event_at: float | None = None
        self._started_wall: float | None = None
        self._last_batch_ts: float | None = None
        self._last_received_wall: float | None = None
        self._log = ThrottledLog(log, log_interval_s)
        self.address, self.binds = subscriber_address(source.endpoint, source.worker_host)

    @property
    def _name(self) -> str:
        return self.source.instance + (f" (rank {self.source.rank})" if self.source.rank else "")

    async def start(self) -> None:
        self._feed = FeedSocket(
            self._ctx, self.source.topic, self.address, self._on_cut, binds=self.binds, max_message_bytes=self._max_message_bytes
        )
        self._started_wall = time.time()
        # subscribed first, replay second: whatever is published meanwhile queues on the socket
        if self._catch_up and self.source.replay_endpoint is not None:
            await self.catch_up()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.source.instance}")

    async def close(self) -> None:
        """Stop the feed's task, then close its socket: never while a receive on it is under way.
        Bounded: a task still running after CLOSE_WAIT_S is logged, and stops when it comes back."""
        self._closing = True
        task, self._task = self._task, None
        try:
            if not await cancel_and_wait(task, within_s=CLOSE_WAIT_S):
                log.warning("kv events from %s: the feed did not stop within %.0f s; closing it anyway", self._name, CLOSE_WAIT_S)
        except Exception as exc:  # noqa: BLE001  # the feed had already stopped on an error: closing goes on
            log.warning("kv events from %s: the feed had stopped: %r", self._name, exc)
        finally:
            if self._feed is not None:
                self._feed.close()
                self._feed = None

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
            dict(self._rejected),
        )

    async def catch_up(self) -> int:
        """Apply every batch the worker's replay buffer still holds; the number applied."""
        got = await self._replay_batches(0)
        if not got:
            log.info("kv events from %s: replay buffer empty or unanswered at start-up", self._name)
            return 0
        applied = await self._apply_run(got, None)
        first = self._last - applied + 1 if self._last is not None else 0
        self._replayed_upto = self._last
        log.info(
            "kv events from %s: caught up on %d buffered batches (seq %d..%s)%s",
            self._name,
            applied,
            first,
            self._last,
            "" if first == 0 else "; blocks cached before that are unknown until announced again",
        )
        return applied

    # ---- the live feed ----------------------------------------------------------------------------
    async def _run(self) -> None:
        """Read and apply messages until cancelled; this task is the only one that touches the
        feed's socket while it runs (see FeedSocket)."""
        feed = self._feed
        assert feed is not None
        in_a_row = 0
        while not self._closing:  # a task that outlived close()'s wait stops before touching the socket
            message = feed.read_now()
            if message is None:
                in_a_row = 0
                message = await feed.wait()
                if message is None:
                    continue
            await self._take(message)
            in_a_row += 1
            if in_a_row >= BURST:
                in_a_row = 0
                await asyncio.sleep(0)

    async def _take(self, message: Message) -> None:
        """Apply one message, or drop it (counted) when it is not [topic, 8-byte seq, payload]."""
        count, frames = message
        if count != 3 or len(frames[1]) != 8:
            self._reject("frames", f"{count} frames")
            return
        try:
            await self.handle(int.from_bytes(frames[1], "big"), frames[2])
        except Exception as exc:  # noqa: BLE001  # the index failed (e.g. Redis down): the feed goes on
            self._log.warn("kv events from %s: applying a batch failed: %r", self._name, exc)

    def _on_cut(self) -> None:
        self._log.warn(
            "kv events from %s: connection cut (a message over %d bytes, or the worker left): reconnecting",
            self._name,
            self._max_message_bytes,
        )

    def _reject(self, reason: str, detail: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self._log.warn("kv events from %s: dropped a message (%s: %s)", self._name, reason, detail)

    def _check(self, payload: bytes) -> EventBatch | None:
        """The payload's batch, or None (counted) when it is too big or does not check out."""
        if len(payload) > self._max_message_bytes:
            self._reject("oversize", f"{len(payload)} bytes, over {self._max_message_bytes}")
            return None
        try:
            return decode_batch(payload)
        except BadBatch as exc:
            self._reject(exc.reason, str(exc))
            return None

    async def handle(self, seq: int, payload: bytes) -> None:
        """Check one published message and apply it, after repairing any gap before it; the
        sequence number counts only once the batch decodes and checks out."""
        batch = self._check(payload)
        if batch is None:
            return
        if self._replayed_upto is not None:
            if seq <= self._replayed_upto:
                return  # queued while the catch-up replayed it
            self._replayed_upto = None
        last, held = self._last, self._held
        if last is not None and seq - last > self._max_seq_jump:
            if held is not None and seq == held[0] + 1:  # the feed goes on from the jump: an outage
                self._held = None
                await self._sequence(*held)
            else:
                if held is not None:
                    self._reject("seq_jump", f"seq {held[0]} after {last}, and the feed did not go on from it")
                self._held = (seq, batch)  # not acted on until the next message says which it is
                return
        elif held is not None:
            self._held = None
            self._reject("seq_jump", f"seq {held[0]} after {last}, and the feed went on from {last}")
        await self._sequence(seq, batch)

    async def _sequence(self, seq: int, batch: EventBatch) -> None:
        last = self._last
        if last is None and self._batches == 0 and seq > 0 and self._catch_up and self.source.replay_endpoint is not None:
            # The first batch since start-up, but not the publisher's first: the SUB socket was
            # still joining (ZMQ's slow joiner) when the ones before went out, after the catch-up
            # found the buffer empty. They are lost on the wire but still in the replay buffer.
            self._gaps += 1
            await self._apply_run(await self._replay_batches(0), seq)
        if last is not None:
            if seq == last:
                return  # a duplicate (e.g. overlap between a replay and the live feed)
            if seq < last:
                await self._resync(f"sequence went back from {last} to {seq}: publisher restarted")
                if seq > 0 and self.source.replay_endpoint is not None:
                    await self._apply_run(await self._replay_batches(0), seq)  # the new process's first batches
            elif seq > last + 1:
                self._gaps += 1
                await self._repair(last + 1, seq)
        await self._apply(seq, batch)

    async def _apply(self, seq: int, batch: EventBatch) -> None:
        self._last = seq
        self._batches += 1
        self._last_event_at = asyncio.get_running_loop().time()
        self._last_batch_ts = batch.ts
        self._last_received_wall = time.time()
        if batch_blocks(batch) <= self._slice_blocks:
            await self._on_batch(self.source.instance, batch)
            return
        for i, piece in enumerate(slice_batch(batch, self._slice_blocks)):
            if i:
                await asyncio.sleep(0)  # a turn of the loop: requests and other feeds go on meanwhile
            await self._on_batch(self.source.instance, piece)

    # ---- gaps and replays ---------------------------------------------------------------------------
    async def _apply_run(self, got: Mapping[int, EventBatch], upto: int | None) -> int:
        """Apply the consecutive run of replayed batches that ends right before `upto` (None: the
        newest); older ones, cut off from it by a hole, would leave the index inconsistent."""
        if upto is None:
            if not got:
                return 0
            upto = max(got) + 1
        start = upto
        while start - 1 in got:
            start -= 1
        for s in range(start, upto):
            await self._apply(s, got[s])
        self._replayed += upto - start
        return upto - start

    async def _repair(self, start: int, upto: int) -> None:
        missing = upto - start
        got: dict[int, EventBatch] = {}
        if self.source.replay_endpoint is not None:
            got = {s: b for s, b in (await self._replay_batches(start)).items() if start <= s < upto}
            if len(got) == missing:
                await self._apply_run(got, upto)
                log.info("kv events from %s: replayed %d missed batches", self._name, missing)
                return
        await self._resync(f"missed batches {start}..{upto - 1} and could not replay them")
        await self._apply_run(got, upto)  # the part the buffer still had, when it ends at the live feed

    async def _resync(self, reason: str) -> None:
        self._resyncs += 1
        self._last = None
        log.warning("kv events from %s: resync (%s)", self._name, reason)
        await self._on_resync(self.source.instance, reason)

    async def _replay_batches(self, start: int) -> dict[int, EventBatch]:
        """The replay socket's batches from `start` on, by seq; those that do not check out are left
        out (counted), so they show as holes."""
        got: dict[int, EventBatch] = {}
        for seq, payload in await self._replay(start):
            batch = self._check(payload)
            if batch is not None:
                got[seq] = batch
        return got

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self.source.replay_endpoint is not None
        address, _ = subscriber_address(self.source.replay_endpoint, self.source.worker_host)
        self._replay_requests += 1
        return await request_replay(
            self._ctx,
            address,
            start,
            timeout_s=self._replay_timeout_s,
            max_message_bytes=self._max_message_bytes,
            name=self._name,
        )
