"""A lean HTTP/1.1 client for the gateway's upstream legs.

Why not aiohttp or httpx: the gateway's CPU per request is its budget and two upstream calls are
most of it. Measured on this box (benchmarks/bench_gateway.py, benchmarks/bench_http_client.py),
a POST costs several times more CPU with httpx or aiohttp than here, where a keep-alive connection
is an asyncio.Protocol feeding httptools' C parser (llhttp, the parser uvicorn itself uses) and
little else runs per request.

What it does: keep-alive pools per origin with a connection limit and a bounded wait for a free
connection, TCP_NODELAY, optional TLS, Content-Length request bodies, chunked, sized or
close-delimited responses (and bodiless ones: HEAD, 204, 304; 1xx interim answers are skipped),
streamed bodies with flow control, a connect timeout and a read timeout (longest silence), and
bounds on what a faulty server can make it hold (`ResponseLimits`: head bytes, header lines, and a
body read whole; past them the exchange fails with ResponseTooLarge and the connection is dropped).

Request heads are built only from validated parts (`build_head`): a CR or LF smuggled into a
header value can never split the head into a second request, and the framing headers (Host,
Content-Length, Transfer-Encoding) are always the client's own, never a caller's that could
disagree with the body actually written. Responses are parsed by httptools, never by hand.

Re-sending: a request is written at most once. An idle connection is checked right before the
write (closed, half-closed, or with unread bytes or a FIN waiting) and replaced if stale; once the
bytes are handed to the socket, a failure is raised with `sent=True` and never retried here: the
server may have read the request, and running a prefill twice is worse than failing over.

What it does not: proxies, redirects, cookies, compression, HTTP/2, pipelining.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import re
import ssl
import threading
from collections.abc import AsyncIterator, Mapping

from adapters.http1_conn import (
    DEFAULT_LIMITS,
    Connection,
    ConnectionFailed,
    HTTPClientError,
    PoolTimeout,
    ReadTimeout,
    ResponseLimits,
    ResponseTooLarge,
)

__all__ = [
    "DEFAULT_LIMITS",
    "ConnectionFailed",
    "HTTPClientError",
    "InvalidRequest",
    "Pool",
    "PoolTimeout",
    "ReadTimeout",
    "Response",
    "ResponseLimits",
    "ResponseTooLarge",
    "authority",
    "build_head",
]

# ---- request heads: built only from validated parts -------------------------------------------
# RFC 7230 3.2.6: token = 1*tchar
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# origin-form (RFC 7230 5.3.1): an absolute path and optional query, visible ASCII only; any
# space or control character would end the request line early
_TARGET = re.compile(r"/[\x21-\x7e]*")
# field-value may hold VCHAR, obs-text, SP and HTAB; every other control character (CR, LF and NUL
# above all) is refused
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# reg-name, IPv4 or a bracketed IPv6 literal, with an optional port
_AUTHORITY = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=]+)(:[0-9]{1,5})?")
_FRAMING = frozenset({"host", "content-length", "transfer-encoding"})
# methods whose requests carry no body unless one is given: no "Content-Length: 0" for them
_BODILESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})


class InvalidRequest(ValueError):
    """The request cannot be written as well-formed HTTP/1.1; nothing was sent."""


def authority(host: str, port: int, *, tls: bool) -> bytes:
    """The Host header value for an origin: an IPv6 literal goes in brackets, the scheme's default
    port is left out."""
    name = host.split("%", 1)[0]  # an IPv6 zone id names a local interface: it never goes on the wire
    if ":" in name:
        name = f"[{name}]"
    if port != (443 if tls else 80):
        name = f"{name}:{port}"
    try:
        raw = name.encode("ascii")
    except UnicodeEncodeError:
        try:
            raw = name.encode("idna")
        except UnicodeError as exc:
            raise InvalidRequest(f"invalid host name {host!r}: {exc}") from exc
    if not _AUTHORITY.fullmatch(raw):
        raise InvalidRequest(f"invalid host {host!r} for a Host header")
    return raw


@functools.lru_cache(maxsize=256)
def _request_line(method: str, target: str) -> bytes:
    # A gateway sends a handful of (method, path) pairs: validate and encode each once.
    if not _TOKEN.fullmatch(method):
        raise InvalidRequest(f"invalid method {method!r}")
    if not _TARGET.fullmatch(target):
        raise InvalidRequest(f"invalid request target {target!r}: an absolute path of visible ASCII characters")
    return method.encode("ascii") + b" " + target.encode("ascii") + b" HTTP/1.1\r\nHost: "


@functools.lru_cache(maxsize=512)
def _header_name(name: str) -> bytes:
    # Header names repeat from request to request: validate and encode each one once.
    if not _TOKEN.fullmatch(name):
        raise InvalidRequest(f"invalid header name {name!r}")
    if name.lower() in _FRAMING:
        raise InvalidRequest(f"header {name!r} is set by the HTTP client itself")
    return name.encode("ascii")


def _header_value(name: str, value: str) -> bytes:
    if _BAD_VALUE.search(value):
        raise InvalidRequest(f"header {name!r} holds a control character (CR, LF, NUL, ...)")
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"header {name!r} holds a character outside Latin-1") from exc


def build_head(method: str, target: str, host: bytes, headers: Mapping[str, str], body_length: int) -> bytes:
    """The request line and header block, ending in the blank line. `host` comes from
    `authority()`; raises InvalidRequest on any part that is not valid HTTP/1.1."""
    parts = [_request_line(method, target), host, b"\r\n"]
    for name, value in headers.items():
        parts += (_header_name(name), b": ", _header_value(name, value), b"\r\n")
    if body_length or method not in _BODILESS_METHODS:
        parts.append(b"Content-Length: %d\r\n" % body_length)
    parts.append(b"\r\n")
    return b"".join(parts)


class Response:
    """An upstream answer whose body is read with `chunks()` or `read()`. Reading to the end, an
    error, `close()` or dropping the object gives the connection back: to the pool if the answer
    was complete, else closed (so the server sees the client leave)."""

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, pool: Pool, conn: Connection) -> None:
        self._pool = pool
        self._conn: Connection | None = conn
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
        try:
            while (chunk := await conn.next_chunk(coalesce=True)) is not None:
                yield chunk
        finally:  # also when the consumer stops iterating, or the generator is collected
            self.close()

    async def read(self) -> bytes:
        """The whole body; ResponseTooLarge (the connection dropped) past the pool's body limit."""
        conn = self._conn
        if conn is None:
            return b""
        limit = conn.limits.body_bytes
        parts: list[bytes] = []
        size = 0
        try:
            if not conn.complete:  # a body still arriving: a declared length over the limit is refused now
                declared = self.header("content-length")
                if declared.isdigit() and int(declared) > limit:
                    raise ResponseTooLarge(f"upstream response body of {declared} bytes, over {limit}")
            while (chunk := await conn.next_chunk()) is not None:
                size += len(chunk)
                if size > limit:
                    raise ResponseTooLarge(f"upstream response body over {limit} bytes")
                parts.append(chunk)
        except ResponseTooLarge:
            conn.must_close = True
            raise
        finally:
            self.close()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._done(conn)

    def __del__(self) -> None:
        # A response dropped unread must not keep its pool slot for good. The cyclic collector
        # may run this on any thread: the pool is only touched from its loop's.
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop may be closed already at exit
            if threading.get_ident() == self._pool.thread:
                self._pool._done(conn)
            else:
                self._pool.loop.call_soon_threadsafe(self._pool._done, conn)


class Pool:
    """Keep-alive connections to one origin (host, port), at most `limit` at once."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limit: int = 256,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 120.0,
        idle_timeout_s: float = 4.0,
        pool_timeout_s: float | None = None,
        tls: ssl.SSLContext | None = None,
        limits: ResponseLimits = DEFAULT_LIMITS,
    ) -> None:
        self.host, self.port = host, port
        self.limits = limits
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        # Workers behind uvicorn close idle connections after 5 s: drop ours before that race.
        self.idle_timeout_s = idle_timeout_s
        # How long a request waits for a free connection before it fails (503, not a hang).
        self.pool_timeout_s = connect_timeout_s if pool_timeout_s is None else pool_timeout_s
        self.tls = tls
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()  # the loop's thread
        self._authority = authority(host, port, tls=tls is not None)
        self._idle: collections.deque[Connection] = collections.deque()
        self._in_use = 0  # slots held: busy connections, and requests still connecting
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        self.opened = 0  # connections ever opened (tests check pooling with it)
        self.stale_dropped = 0  # idle connections found dead right before a write and replaced

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def idle(self) -> int:
        return len(self._idle)

    # ---- slots ---------------------------------------------------------------------------------
    async def _take_slot(self) -> None:
        fut = self.loop.create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.pool_timeout_s):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self._give_slot()  # handed over just as we gave up: pass it on
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise PoolTimeout(
                    f"all {self.limit} connections to {self.host}:{self.port} stayed busy for {self.pool_timeout_s:g} s"
                ) from None
            raise

    def _give_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the oldest waiter
                return
        self._in_use -= 1

    def _done(self, conn: Connection) -> None:
        """The request holding `conn` is over: idle it if it can carry another, else close it."""
        if not conn.busy:
            return
        conn.busy = False
        if conn.reusable and not self._closed:
            conn.resume()
            conn.idle_since = self.loop.time()
            self._idle.append(conn)
        else:
            conn.close()
        self._give_slot()

    def _lost(self, conn: Connection) -> None:
        # The transport is gone: a busy connection frees its slot now, whoever still holds the
        # Response (its buffered bytes or error stay readable).
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)
        if conn.busy:
            conn.busy = False
            self._give_slot()

    # ---- connections ------------------------------------------------------------------------------
    async def _acquire(self) -> Connection:
        if self._in_use < self.limit and not self._waiters:
            self._in_use += 1
        else:
            await self._take_slot()
        try:
            conn = self._take_idle()
            if conn is None:
                conn = await self._connect()
        except BaseException:
            self._give_slot()
            raise
        conn.busy = True
        return conn

    def _take_idle(self) -> Connection | None:
        cutoff = self.loop.time() - self.idle_timeout_s
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be stale
            if not conn.stale(cutoff):
                return conn
            self.stale_dropped += 1
            conn.close()
        return None

    async def _connect(self) -> Connection:
        where = f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await self.loop.create_connection(
                    lambda: Connection(self.loop, self.read_timeout_s, self._lost, self.limits),
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host.split("%", 1)[0] if self.tls is not None else None,
                )
                assert isinstance(protocol, Connection)
                if protocol.transport is None:
                    await protocol.made
        except TimeoutError as exc:
            raise ConnectionFailed(f"connect to {where} timed out", sent=False) from exc
        except OSError as exc:  # refused, unreachable, TLS handshake or certificate failure
            raise ConnectionFailed(f"cannot connect to {where}: {exc}", sent=False) from exc
        self.opened += 1
        return protocol

    # ---- requests ---------------------------------------------------------------------------------
    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"") -> Response:
        """Send one request and wait for the final answer's headers. Raises InvalidRequest (a
        ValueError) before sending anything malformed, PoolTimeout, ConnectionFailed (see its
        `sent`) or ReadTimeout."""
        head = build_head(method, path, self._authority, headers, len(body))
        conn = await self._acquire()
        try:
            conn.send(head, body, bodiless=method == "HEAD")
            await conn.headers_done
        except BaseException:
            conn.must_close = True
            self._done(conn)
            raise
        return Response(self, conn)

    async def close(self) -> None:
        """Close the idle connections; busy ones close when their responses end."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
