"""Sharing in-flight load between the worker processes of one gateway, through shared memory.

`conductor serve --workers N` runs N gateway processes on one port (conductor/workers.py). Each
knows exactly the work it dispatched itself; to route as one gateway, each must also see the work
of its siblings, or all N would think the same instance idle and pile onto it. Redis
(adapters/load_share.py) does this across hosts, but its tables are up to `load_sync_interval_s`
(100 ms) old, a window in which a burst over-commits. Processes on one host can do much better:
each publishes its table into its own slot of one shared memory segment every `interval_s` (a few
milliseconds) and reads the others' slots when a policy asks, decoding a slot only when it changed.

Slot layout (little-endian), one per worker process, `slot_bytes` each:
    u64 sequence   odd while the owner writes, even when the slot is consistent (a seqlock);
    f64 heartbeat  wall time of the owner's last publish: a slot not refreshed for `stale_after_s`
                   belongs to a dead process and is ignored (the supervisor also clears it);
    u32 length     bytes of the msgpack table that follows;
    u32 reserved
    table          msgpack of adapters.load_share.LoadTable.

Only the owner writes a slot, so writers never contend; a reader that sees the sequence change
under it (or odd) retries a few times and otherwise keeps the last table it decoded from that slot.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing import shared_memory

import msgspec

from adapters.decision_turn import FdTurn
from adapters.load_share import LoadTable, PrefillEnds, RemoteLoad, merge_tables

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QdII")
HEADER_BYTES = _HEADER.size
DEFAULT_SLOT_BYTES = 1 << 20  # ~40,000 in-flight requests' entries per process
_READ_RETRIES = 8

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def segment_bytes(workers: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    """Size of the segment for `workers` slots."""
    return workers * slot_bytes


def create_segment(workers: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> shared_memory.SharedMemory:
    """A zeroed segment for `workers` slots; the supervisor owns it and unlinks it at exit."""
    shm = shared_memory.SharedMemory(create=True, size=segment_bytes(workers, slot_bytes))
    assert shm.buf is not None
    shm.buf[:] = bytes(shm.size)
    return shm


def attach(name: str) -> shared_memory.SharedMemory:
    """Open the supervisor's segment. Workers are spawned by the supervisor and share its resource
    tracker, whose registry is a set: their attaching registers nothing new, and the segment is
    unlinked once, by the supervisor (Python 3.13+ is told not to track it at all)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg,unused-ignore]
    return shared_memory.SharedMemory(name=name)


def slot_written(buf: memoryview, slot: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> bool:
    """Whether the slot's owner has published at least once (it got through its start-up)."""
    return bool(_HEADER.unpack_from(buf, slot * slot_bytes)[0])


def clear_slot(buf: memoryview, slot: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
    """Forget a dead worker's table (the supervisor calls this before restarting it)."""
    _HEADER.pack_into(buf, slot * slot_bytes, 0, 0.0, 0, 0)


class SharedMemoryLoadShare:
    """The `LoadShare` of one worker process: slot `slot` of `workers` in the named segment."""

    def __init__(
        self,
        segment: str,
        slot: int,
        workers: int,
        *,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        interval_s: float = 0.005,
        stale_after_s: float = 1.0,
        turns: bool = False,
    ) -> None:
        """turns: the workers decide in turn (adapters/decision_turn.py FdTurn), `refresh` taking it
        (`load_share.turns`; set before `start`)."""
        if not 0 <= slot < workers:
            raise ValueError(f"slot {slot} outside 0..{workers - 1}")
        self.segment, self.slot, self.workers = segment, slot, workers
        self.slot_bytes, self.interval_s, self.stale_after_s = slot_bytes, interval_s, stale_after_s
        self._shm: shared_memory.SharedMemory | None = None
        self._buf = memoryview(b"")
        self._local: Callable[[], LoadTable] = dict
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self._last_payload = b""
        # per other slot: the sequence last decoded and its table; the merged view and the
        # sequences it was built from
        self._tables: dict[int, tuple[int, LoadTable]] = {}
        self._merged: RemoteLoad = {}
        self._merged_from: tuple[int, ...] = ()
        self._merged_at = 0.0
        self._ends = PrefillEnds()
        self.oversized = 0  # publishes that did not fit the slot (the previous table stayed)
        self._soon: asyncio.Handle | None = None  # a publish asked for by changed(), not yet run
        self.turns = turns
        self.turn: FdTurn | None = None  # made at start, on the segment's file

    async def start(self, local: Callable[[], LoadTable]) -> None:
        self._shm = attach(self.segment)
        assert self._shm.buf is not None
        self._buf = self._shm.buf
        if self._shm.size < segment_bytes(self.workers, self.slot_bytes):
            raise ValueError(f"shared memory segment {self.segment} is too small for {self.workers} workers")
        self._local = local
        fd = getattr(self._shm, "_fd", -1)  # CPython's POSIX SharedMemory keeps its file open
        if self.turns and isinstance(fd, int) and fd >= 0:
            self.turn = FdTurn(fd)
        self.publish()
        self._task = asyncio.create_task(self._loop(), name="shm-load-share")

    async def close(self) -> None:
        if self.turn is not None:
            self.turn.give()
            self.turn = None
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
        if self._shm is not None:
            clear_slot(self._buf, self.slot, self.slot_bytes)
            self._merged, self._tables = {}, {}
            self._buf.release()
            self._buf = memoryview(b"")
            self._shm.close()
            self._shm = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.publish()
                # the siblings' tables read on the beat too, not only when deciding: an end is
                # noticed within a beat of happening (PrefillEnds), however rare the decisions
                self.remote()
            except Exception:  # a bug here must not stop the sharing for good
                log.exception("publishing this worker's load failed")

    async def refresh(self, max_age_s: float) -> None:
        # remote() reads the siblings' slots as they are now (each republished every interval_s);
        # with turns, a sibling's decision in progress is waited for, so its dispatch is in them
        turn = self.turn
        if turn is not None and not turn.holding and await turn.take():
            # given back after this step (the decision and its dispatch), once the table is published
            asyncio.get_running_loop().call_soon(self._give_turn)

    def _give_turn(self) -> None:
        if self.turn is None or not self.turn.holding:
            return
        try:
            self.publish()
        except Exception:
            log.exception("publishing this worker's load failed")
        finally:
            self.turn.give()

    def changed(self) -> None:
        # published once the current loop iteration's callbacks have run, not at the next beat: a
        # burst reaches both workers at once, and for up to a beat (longer when the loop lags
        # behind its timers on a busy box) a sibling would see the instance just chosen as idle
        # and choose it too (over-commit, docs/performance.md). The changes of one iteration --
        # under load, many dispatches -- share one publish, so the encode is not paid per request
        if self.turn is not None and self.turn.holding:
            # the decision under the turn has dispatched (its prefill queued): published now and
            # the turn given back, so a sibling waits for the decision only, not this whole
            # iteration (its decode stream, listed next, goes out with the publish below)
            self._give_turn()
        if self._soon is None and self._shm is not None:
            self._soon = asyncio.get_running_loop().call_soon(self._publish_soon)

    def _publish_soon(self) -> None:
        self._soon = None
        try:
            self.publish()
        except Exception:
            log.exception("publishing this worker's load failed")

    def publish(self) -> None:
        """Write this process's table into its slot (the heartbeat alone when the table is unchanged)."""
        buf, base = self._buf, self.slot * self.slot_bytes
        payload = _encode(self._local())
        now = time.time()
        if payload == self._last_payload:  # only the heartbeat moves: no sequence change, no re-decode
            struct.pack_into("<d", buf, base + 8, now)
            return
        if HEADER_BYTES + len(payload) > self.slot_bytes:
            self.oversized += 1
            log.warning(
                "this worker's in-flight table (%d bytes) exceeds its shared memory slot (%d): siblings see the previous one",
                len(payload),
                self.slot_bytes,
            )
            struct.pack_into("<d", buf, base + 8, now)
            return
        self._seq += 2
        _HEADER.pack_into(buf, base, self._seq - 1, now, len(payload), 0)  # odd: writing
        buf[base + HEADER_BYTES : base + HEADER_BYTES + len(payload)] = payload
        _HEADER.pack_into(buf, base, self._seq, now, len(payload), 0)
        self._last_payload = payload

    def _read_slot(self, slot: int, now: float) -> tuple[int, LoadTable] | None:
        """(sequence, table) of another worker's slot; None when empty or its owner stopped beating."""
        buf, base = self._buf, slot * self.slot_bytes
        for _ in range(_READ_RETRIES):
            seq, beat, length, _ = _HEADER.unpack_from(buf, base)
            if seq == 0 or now - beat > self.stale_after_s:
                return None
            if seq & 1:
                continue
            cached = self._tables.get(slot)
            if cached is not None and cached[0] == seq:
                return cached
            if length > self.slot_bytes - HEADER_BYTES:
                return None
            raw = bytes(buf[base + HEADER_BYTES : base + HEADER_BYTES + length])
            if _HEADER.unpack_from(buf, base)[0] != seq:  # rewritten while we copied
                continue
            try:
                table: LoadTable = _decode(raw)
            except msgspec.DecodeError:
                return None
            self._tables[slot] = (seq, table)
            return seq, table
        return self._tables.get(slot)  # the owner kept writing: its last consistent table

    def remote(self) -> RemoteLoad:
        if self._shm is None:
            return {}
        now = time.time()
        seqs: list[int] = []
        tables: list[LoadTable] = []
        for slot in range(self.workers):
            if slot == self.slot:
                continue
            got = self._read_slot(slot, now)
            if got is None:
                self._tables.pop(slot, None)
                seqs.append(0)
                continue
            seqs.append(got[0])
            if got[1]:
                tables.append(got[1])
        key = tuple(seqs)
        # rebuilt when a sibling's table changed, and every interval: a queue's head keeps ageing
        # while its table stands still, and its age is what the policy reads
        if key != self._merged_from or now - self._merged_at > self.interval_s:
            self._merged = merge_tables(tables, now)
            self._merged_from, self._merged_at = key, now
            self._ends.update(tables, time.monotonic())
        return self._merged

    def prefill_ends(self) -> Mapping[str, float]:
        return self._ends.ended_at
