"""Sharing predictor lessons between the worker processes of one gateway (`serve --workers N`).

Each worker learns from the outcomes of the requests it dispatched; predictors/lessons.py says why
its siblings must learn from them too and what a lesson is. Here is how lessons travel: every
worker binds a Unix datagram socket, `slot-<i>.sock`, in a directory the supervisor creates for
the run with mode 0700 (so only this user's processes can reach them) and removes at exit. A
worker's new lessons are gathered for `flush_s` (a few milliseconds), packed with msgpack into
datagrams of at most `MAX_LESSONS` lessons and sent, without blocking, to every sibling's socket.
A sibling that is not there (restarting) or whose receive queue is full loses them, counted as
`dropped`: learning is best effort, later outcomes teach the same, and nothing waits or grows.
Received datagrams are read on the event loop's thread (the one that decides), each lesson checked
(predictors.lessons.checked, through the `learn` callback) before it is learned; a datagram that
does not decode, or a lesson that is refused, is counted and dropped. Between gateway replicas
(`load_share.mode: redis`) lessons go through Redis instead: adapters/redis_lesson_share.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import msgspec

log = logging.getLogger(__name__)

MAX_LESSONS = 256  # per datagram: ~12 KB of msgpack, well under the default socket buffers
_RECV_BYTES = 1 << 16
_READS_PER_WAKE = 64  # datagrams handled per readable callback before the loop runs others
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[list[str | int | float]]).decode

Learn = Callable[[object], None]  # Predictors.learn: raises ValueError for a malformed lesson


class LessonShare(Protocol):
    counts: Counter[str]  # "sent", "received", "dropped", "refused": lessons, for the metrics

    def start(self, learn: Learn) -> None:
        """Begin receiving siblings' lessons into `learn` (called on the running event loop)."""
        ...

    def publish(self, lessons: Iterable[tuple[str | int | float, ...]]) -> None:
        """Send these lessons of this process to its siblings (soon, not necessarily now)."""
        ...

    def close(self) -> None: ...


class NoLessonShare:
    """One process alone: nothing to share."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def start(self, learn: Learn) -> None:
        pass

    def publish(self, lessons: Iterable[tuple[str | int | float, ...]]) -> None:
        pass

    def close(self) -> None:
        pass


class InMemoryLessonHub:
    """Lessons between gateways in one process (tests): `member(i)` is gateway i's share; a
    lesson published by one is learned by every other member on the next loop iteration."""

    def __init__(self) -> None:
        self._members: list[InMemoryLessonShare] = []

    def member(self) -> InMemoryLessonShare:
        share = InMemoryLessonShare(self)
        self._members.append(share)
        return share

    def deliver(self, sender: InMemoryLessonShare, lessons: list[list[str | int | float]]) -> None:
        for member in self._members:
            if member is not sender:
                member.receive(lessons)


class InMemoryLessonShare:
    def __init__(self, hub: InMemoryLessonHub) -> None:
        self.counts: Counter[str] = Counter()
        self._hub = hub
        self._learn: Learn | None = None

    def start(self, learn: Learn) -> None:
        self._learn = learn

    def publish(self, lessons: Iterable[tuple[str | int | float, ...]]) -> None:
        batch = [list(lesson) for lesson in lessons]
        self.counts["sent"] += len(batch)
        asyncio.get_running_loop().call_soon(self._hub.deliver, self, batch)

    def receive(self, lessons: list[list[str | int | float]]) -> None:
        if self._learn is not None:
            learn_all(self._learn, lessons, self.counts)

    def close(self) -> None:
        self._learn = None


def learn_all(learn: Learn, lessons: list[list[str | int | float]], counts: Counter[str]) -> None:
    for lesson in lessons:
        try:
            learn(lesson)
        except ValueError as exc:
            counts["refused"] += 1
            log.debug("refused a sibling's lesson: %s", exc)
        else:
            counts["received"] += 1


def slot_path(directory: str | Path, slot: int) -> Path:
    return Path(directory) / f"slot-{slot}.sock"


class UnixLessonShare:
    """Worker `slot` of `workers`, its siblings' sockets in `directory` (made by the supervisor)."""

    def __init__(self, directory: str | Path, slot: int, workers: int, *, flush_s: float = 0.005) -> None:
        self.counts: Counter[str] = Counter()
        self._path = slot_path(directory, slot)
        self._siblings = [str(slot_path(directory, i)) for i in range(workers) if i != slot]
        self._flush_s = flush_s
        self._outbox: list[list[str | int | float]] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._sock: socket.socket | None = None
        self._learn: Learn | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, learn: Learn) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if self._path.exists():  # left by this slot's previous process, which died
                self._path.unlink()
            sock.bind(str(self._path))
            os.chmod(self._path, 0o600)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock, self._learn = sock, learn
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)

    def publish(self, lessons: Iterable[tuple[str | int | float, ...]]) -> None:
        if self._sock is None or not self._siblings:
            return
        self._outbox.extend(list(lesson) for lesson in lessons)
        if self._flush_handle is None and self._outbox and self._loop is not None:
            self._flush_handle = self._loop.call_later(self._flush_s, self.flush)

    def flush(self) -> None:
        """Send what is gathered now (the timer's callback; tests call it to send at once)."""
        self._flush_handle = None
        outbox, self._outbox = self._outbox, []
        if self._sock is None:
            return
        for start in range(0, len(outbox), MAX_LESSONS):
            batch = outbox[start : start + MAX_LESSONS]
            datagram = _encode(batch)
            for sibling in self._siblings:
                try:
                    self._sock.sendto(datagram, sibling)
                except OSError:  # not bound (restarting), queue full, gone: best effort
                    self.counts["dropped"] += len(batch)
                else:
                    self.counts["sent"] += len(batch)

    def _readable(self) -> None:
        sock, learn = self._sock, self._learn
        if sock is None or learn is None:
            return
        for _ in range(_READS_PER_WAKE):
            try:
                datagram = sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.exception("reading siblings' lessons failed")
                return
            try:
                lessons = _decode(datagram)
            except msgspec.DecodeError:
                self.counts["refused"] += 1
                continue
            learn_all(learn, lessons, self.counts)

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            try:
                self._path.unlink()
            except OSError:
                pass
