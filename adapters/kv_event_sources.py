"""Where a vLLM instance publishes its KV events, and which side of each ZMQ socket binds.

Socket direction mirrors vLLM's rule: its PUB binds when the endpoint holds "*" or "::" (or is
ipc/inproc), so we connect (with "*" replaced by the worker's host); otherwise it connects to the
concrete address given, so we must bind there. The replay ROUTER always binds, so we connect.

Also here: the feed's SUB socket, read a whole message at a time and replaced when ZMQ cuts its
connection (`FeedSocket`), and a replay request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): end of a replay


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


async def request_replay(
    ctx: zmq.asyncio.Context, address: str, start: int, *, timeout_s: float, max_message_bytes: int, name: str
) -> list[tuple[int, bytes]]:
    """(seq, payload) of every batch the replay socket at `address` still buffers from `start` on;
    what came before a silence of `timeout_s` when it does not finish (logged)."""
    # A fresh DEALER per request: a late answer to an abandoned request cannot be mistaken for the
    # answer to the next one.
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(address)
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                return out
            if len(seq_bytes) == 8:
                out.append((int.from_bytes(seq_bytes, "big"), payload))
    except (TimeoutError, zmq.ZMQError) as exc:
        log.warning("kv events from %s: replay from %d failed: %r", name, start, exc)
        return out
    finally:
        sock.close(linger=0)


Message = tuple[int, list[bytes]]  # (how many frames it had, the first three of them)


class FeedSocket:
    """One instance's SUB socket, read by one task a whole message at a time, and replaced when ZMQ
    cut its connection.

    Why whole messages, and a fresh socket rather than disconnect() and connect() on this one:
    libzmq aborts the process (`Assertion failed: !_more (src/fq.cpp:80)`) when a socket ends one of
    its own connections (disconnect()) while it holds the first frame of a message that came over
    it, and a SUB socket holds one whenever a poll found a message queued (ZMQ_EVENTS, which
    zmq.asyncio asks at every turn): engines dying while the gateway read a backlog aborted it so
    (issue 33). Closing a socket is safe whatever it holds, and nothing reads it afterwards.

    Why a reconnect at all: ZMQ cuts a connection that brings a frame over MAXMSGSIZE and, since that
    is a protocol error, never reconnects it (its session ends instead of retrying): without this,
    one oversize message would blind the instance for good. A cut for any other reason (the worker
    left) is reconnected the same way, which is what ZMQ would have done. Whatever the old socket
    still queued is read before it is replaced (a cut is only acted on once `read_now` finds none).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        topic: str,
        address: str,
        on_cut: Callable[[], None],
        *,
        binds: bool,
        max_message_bytes: int,
    ) -> None:
        self._ctx = ctx
        self._on_cut = on_cut
        self._topic = topic.encode()
        self._address = address
        self._binds = binds
        self._max_message_bytes = max_message_bytes
        self._opened = 0
        self.sub, self._monitor, self._cut = self._open()

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket | None, asyncio.Future[list[bytes]] | None]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)  # bigger frames: dropped unbuffered
        if self._binds:
            sub.bind(self._address)  # a publisher cut off for an oversize frame reconnects itself
            return sub, None, None
        sub.connect(self._address)
        # an address of its own: pyzmq's default names the socket's fd, which a closed one's successor may reuse
        self._opened += 1
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED, f"inproc://kv-events-cut-{id(self):x}-{self._opened}")
        return sub, monitor, cast("asyncio.Future[list[bytes]]", monitor.recv_multipart())

    def read_now(self) -> Message | None:
        """The next queued message, without waiting; None when none is queued."""
        try:
            # the plain socket's recv: no Future per call for what is already queued (a backlog)
            first = zmq.Socket.recv(self.sub, zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._rest(first)

    async def wait(self) -> Message | None:
        """The next message, once one comes; None when the connection was cut: then `on_cut` is
        called and the socket (read to its end: call this only when `read_now` found nothing) is
        replaced, or it is cut while waiting (and nothing was read)."""
        if self._cut is not None and self._cut.done():
            self._on_cut()
            self.reconnect()
            return None
        recv = cast("asyncio.Future[bytes]", self.sub.recv())
        if self._cut is None:
            return self._rest(await recv)
        try:
            await asyncio.wait((recv, self._cut), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not recv.done():
                recv.cancel()  # pyzmq drops a cancelled receive before it reads anything
        return None if recv.cancelled() else self._rest(recv.result())

    def _rest(self, first: bytes) -> Message:
        """The rest of the message whose first frame is `first`, read at once: ZMQ queues a message
        whole, so its frames are all there. Frame by frame, keeping three: a message of a million
        frames is never held as a list of them."""
        frames, count = [first], 1
        while self.sub.getsockopt(zmq.RCVMORE):
            try:
                frame = zmq.Socket.recv(self.sub, zmq.NOBLOCK)
            except zmq.Again:  # not a whole message after all: counted as malformed, never waited on
                break
            count += 1
            if count <= 3:
                frames.append(frame)
        return count, frames

    def reconnect(self) -> None:
        """A fresh socket in place of this one, whose connection was cut."""
        self.close()
        self.sub, self._monitor, self._cut = self._open()

    def close(self) -> None:
        """Close the socket (and its monitor); pending receives on them are cancelled."""
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.disable_monitor()
            self._monitor.close(linger=0)
        self.sub.close(linger=0)
