"""Where a vLLM instance publishes its KV events, and which side of each ZMQ socket binds.

Socket direction mirrors vLLM's rule: its PUB binds when the endpoint holds "*" or "::" (or is
ipc/inproc), so we connect (with "*" replaced by the worker's host); otherwise it connects to the
concrete address given, so we must bind there. The replay ROUTER always binds, so we connect.

Also here: the two things done to those sockets besides reading the feed, a replay request, and
reconnecting a SUB socket whose connection ZMQ cut for good (see `reconnect_when_cut`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
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


async def reconnect_when_cut(sub: zmq.asyncio.Socket, address: str, on_cut: Callable[[], None]) -> None:
    """Keep a connecting SUB socket connected; run as a task for its lifetime.

    ZMQ cuts a connection that brings a frame over MAXMSGSIZE and, since that is a protocol error,
    never reconnects it (libzmq's session ends instead of retrying): without this, one oversize
    message would blind the instance for good. A cut for any other reason (the worker restarted) is
    reconnected the same way, which is what ZMQ would have done."""
    monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        while True:
            await monitor.recv_multipart()
            on_cut()
            with contextlib.suppress(zmq.ZMQError):
                sub.disconnect(address)
            sub.connect(address)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        monitor.close(linger=0)
