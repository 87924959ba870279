"""A lean HTTP/1.1 client for the gateway's upstream legs.

Why not aiohttp or httpx: the gateway's CPU per request is its budget and two upstream calls are
most of it. Measured on this box (benchmarks/bench_gateway.py, benchmarks/bench_http_client.py),
a POST costs about 510 us of CPU with httpx, 150 us with aiohttp and a fraction of that here,
where a keep-alive connection is an asyncio.Protocol feeding httptools' C parser (the parser
uvicorn itself uses) and nothing else runs per request.

What it does: keep-alive pools per origin with a connection limit, TCP_NODELAY, Content-Length
request bodies, chunked or sized or close-delimited responses, streamed bodies with flow control,
a connect timeout and a read timeout (longest silence), and one retry of a request that failed on
a reused idle connection before any response byte arrived (the server closed it meanwhile).
What it does not: TLS to workers, proxies, redirects, cookies, compression, HTTP/2.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httptools


class ConnectionFailed(Exception):
    """The connection failed or closed before a complete answer."""

    def __init__(self, message: str, *, received: bool = False) -> None:
        super().__init__(message)
        self.received = received  # any response byte seen: then the request may have run


class ReadTimeout(Exception):
    """The server stayed silent longer than the read timeout."""


_EOF = object()
_HIGH_WATER = 64  # buffered body chunks of a stream before the socket is paused


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.made: asyncio.Future[None] = pool.loop.create_future()  # uvloop may call connection_made late
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done: asyncio.Future[None] = self.pool.loop.create_future()
        self.body: collections.deque[Any] = collections.deque()
        self.body_event = asyncio.Event()
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        if not self.made.done():
            self.made.set_result(None)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received = True
        self._arm_timer()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionFailed(f"invalid HTTP from upstream: {exc}", received=True))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if not self.complete:
            self._fail(ConnectionFailed(f"connection closed by upstream ({exc or 'EOF'})", received=self.received))

    # ---- httptools callbacks --------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.body_event.set()
        if len(self.body) > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self._cancel_timer()
        self.body.append(_EOF)
        self.body_event.set()

    # ---- timers and failure -----------------------------------------------------------------
    def _arm_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.pool.loop.call_later(self.pool.read_timeout_s, self._on_timeout)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timeout(self) -> None:
        self._fail(ReadTimeout(f"no data from upstream for {self.pool.read_timeout_s:g} s"))
        self.close()

    def _fail(self, exc: Exception) -> None:
        self._cancel_timer()
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # mark retrieved: a caller may have gone already
        elif not self.complete:
            self.body.append(exc)
            self.body_event.set()

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.pool._forget(self)

    # ---- one exchange -------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self._arm_timer()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end."""
        while not self.body:
            self.body_event.clear()
            await self.body_event.wait()
        item = self.body.popleft()
        if self.paused and len(self.body) < _HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        if item is _EOF:
            return None
        if isinstance(item, Exception):
            raise item
        return item


class Response:
    """An upstream answer whose body is read with `chunks()` or `read()`; always `close()` or read
    to the end (which returns the connection to its pool)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: str, default: str = "") -> str:
        key = name.lower().encode()
        for k, v in self.headers:
            if k == key:
                return v.decode("latin-1")
        return default

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        while True:
            try:
                chunk = await conn.next_chunk()
            except BaseException:
                self.close()
                raise
            if chunk is None:
                break
            yield chunk
        self._finish(conn)

    async def read(self) -> bytes:
        parts = [c async for c in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _finish(self, conn: _Connection) -> None:
        self._conn = None
        if conn.complete and conn.keep_alive and not conn.closed:
            conn.pool._release(conn)
        else:
            conn.close()
            conn.pool._slot_free()

    def close(self) -> None:
        """Abandon the answer: the connection is closed, so the server sees the client leave."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if conn.complete and conn.keep_alive and not conn.closed:
                conn.pool._release(conn)
            else:
                conn.close()
                conn.pool._slot_free()


class Pool:
    """Keep-alive connections to one origin (host, port)."""

    def __init__(
        self, host: str, port: int, *, limit: int = 256, connect_timeout_s: float = 5.0,
        read_timeout_s: float = 120.0, idle_timeout_s: float = 4.0,
    ) -> None:
        self.host, self.port = host, port
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # Workers behind uvicorn close idle connections after 5 s: drop ours before that race.
        self.idle_timeout_s = idle_timeout_s
        self.loop = asyncio.get_running_loop()
        self._idle: collections.deque[_Connection] = collections.deque()
        self._slots = asyncio.Semaphore(limit)
        self._host_header = f"{host}:{port}".encode()
        self.opened = 0  # connections ever opened (tests check pooling with it)

    async def _acquire(self) -> _Connection:
        await self._slots.acquire()
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or now - conn.idle_since > self.idle_timeout_s:
                conn.close()
                continue
            conn.reused = True
            return conn
        try:
            _, protocol = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), self.host, self.port),
                self.connect_timeout_s,
            )
        except TimeoutError as exc:
            self._slots.release()
            raise ConnectionFailed(f"connect to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            self._slots.release()
            raise ConnectionFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self._slots.release()
            raise
        self.opened += 1
        assert isinstance(protocol, _Connection)
        if protocol.transport is None:
            await protocol.made
        return protocol

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._slots.release()

    def _slot_free(self) -> None:
        self._slots.release()

    def _forget(self, conn: _Connection) -> None:
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def _head(self, method: str, path: str, headers: Mapping[str, str], length: int) -> bytes:
        lines = [f"{method} {path} HTTP/1.1\r\n".encode(), b"Host: ", self._host_header, b"\r\n"]
        for k, v in headers.items():
            lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        if method != "GET" or length:
            lines.append(b"Content-Length: %d\r\n" % length)
        lines.append(b"\r\n")
        return b"".join(lines)

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"") -> Response:
        head = self._head(method, path, headers, len(body))
        for attempt in (0, 1):
            conn = await self._acquire()
            conn.send(head, body)
            try:
                await conn.headers_done
            except ConnectionFailed as exc:
                conn.close()
                self._slot_free()
                if attempt == 0 and conn.reused and not exc.received:
                    continue  # a stale keep-alive connection: the server never saw this request
                raise
            except BaseException:
                conn.close()
                self._slot_free()
                raise
            return Response(conn)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
