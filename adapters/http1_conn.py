"""One keep-alive HTTP/1.1 connection: an asyncio.Protocol feeding httptools' response parser.

A connection carries one exchange at a time (no pipelining). Its pool (adapters/http1.py) decides
when it is reused; this module knows the wire: what ends a response (length, chunks, EOF, or no
body at all), which responses to skip (1xx), when the server went silent too long, and whether a
failure happened before or after the request's bytes were handed to the socket.

What a faulty worker can make it hold is bounded (`ResponseLimits`): the response head's bytes and
header lines (past either, the exchange fails with ResponseTooLarge and the connection is dropped),
and the body buffered ahead of its reader (the socket pauses past _HIGH_WATER pieces or
_HIGH_WATER_BYTES, each piece at most one socket read). A whole body read at once is bounded where
it is read (adapters/http1.py, `Response.read`).
"""

from __future__ import annotations

import asyncio
import collections
import math
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools

from adapters.lazy_timer import LazyTimer


class HTTPClientError(Exception):
    """Base of the client's errors. `sent`: some byte of the request may have reached the server,
    so it may have been processed; a request is re-sent only when this is False."""

    sent: bool = True

    @property
    def maybe_processed(self) -> bool:
        return self.sent


class ConnectionFailed(HTTPClientError):
    """Could not connect, or the connection broke (or spoke invalid HTTP) before a complete answer."""

    def __init__(self, message: str, *, sent: bool, received: bool = False) -> None:
        super().__init__(message)
        self.sent = sent
        self.received = received  # some response byte arrived


class ReadTimeout(HTTPClientError):
    """The server stayed silent longer than the read timeout, after the request was written."""

    sent = True


class PoolTimeout(HTTPClientError):
    """Every connection of the pool stayed busy for the whole pool timeout; nothing was sent."""

    sent = False


class ResponseTooLarge(ConnectionFailed):
    """The answer's head or body went past the client's limits; the connection is dropped."""

    def __init__(self, message: str) -> None:
        super().__init__(message, sent=True, received=True)


@dataclass(frozen=True, slots=True)
class ResponseLimits:
    """The most a worker's answer may bring. head_bytes: status line and header lines together;
    headers: header lines; body_bytes: a body read whole (not a stream, relayed piece by piece)."""

    head_bytes: int = 64 * 1024
    headers: int = 256
    body_bytes: int = 64 * 1024 * 1024


DEFAULT_LIMITS = ResponseLimits()
_EOF = object()
_HIGH_WATER = 64  # buffered body chunks of a stream before the socket is paused...
_HIGH_WATER_BYTES = 1 << 20  # ...or buffered body bytes


class Connection(asyncio.Protocol):
    """Owned by one request while `busy`; otherwise idle in its pool or closed."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        read_timeout_s: float,
        on_lost: Callable[[Connection], None],
        limits: ResponseLimits = DEFAULT_LIMITS,
    ) -> None:
        self.loop = loop
        self.read_timeout_s = read_timeout_s
        self.limits = limits
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self._poll: select.poll | None = None  # asks the kernel whether an idle socket has news
        self.parser = httptools.HttpResponseParser(self)
        self.made: asyncio.Future[None] = loop.create_future()  # uvloop may call connection_made late
        self.closed = False  # transport closed by us or lost
        self.eof = False  # the server closed its side
        self.busy = False  # a request holds it (and a pool slot)
        self.idle_since = 0.0
        self._fresh_parser = False
        # one read timer for the connection's life: an exchange arms it, a handle armed by the one
        # before still serves (adapters/lazy_timer.py)
        self._timer = LazyTimer(loop, self._read_timed_out, self._read_deadline)
        self._reset(bodiless=False)

    def _reset(self, *, bodiless: bool) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done: asyncio.Future[None] = self.loop.create_future()
        self.body: collections.deque[Any] = collections.deque()
        self._buffered = 0  # bytes in `body`
        # the head's bytes: those of reads that left it incomplete, and of the read being fed then
        # (on_headers_complete sums its lines only when these could pass the limit)
        self._head_fed = self._feeding = 0
        self._lines_left = self.limits.headers  # less one per interim answer (100, 103...)
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.failed = False
        self.keep_alive = False
        self.must_close = False  # the server broke the protocol: never reuse
        self.received = False
        self.paused = False
        self._bodiless = bodiless  # a HEAD request: the answer ends with its headers
        self._informational = False
        self._last_rx = 0.0  # when the current exchange last heard from the server (loop time)

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not (self.closed or self.eof or self.must_close)

    def stale(self, idle_cutoff: float) -> bool:
        """An idle connection that must not carry a request: closed, half-closed, idle too long, or
        with bytes (or a FIN) already waiting that the loop has not read yet. Checked right before
        writing, because after the write a failure can no longer prove the server saw nothing."""
        if self.closed or self.eof or self.idle_since < idle_cutoff:
            return True
        if self.transport is None or self.transport.is_closing():
            return True
        try:
            if self._poll is not None:
                return bool(self._poll.poll(0))  # POLLIN, or POLLHUP / POLLERR (always reported)
            if self.fd >= 0:  # no poll() on this platform; select() is limited to low fds
                return bool(select.select((self.fd,), (), (), 0)[0])
        except (OSError, ValueError):
            return True
        return False

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        if not self.made.done():
            self.made.set_result(None)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if hasattr(select, "poll"):  # poll(), not select(): a gateway's fds run past FD_SETSIZE
                self._poll = select.poll()
                self._poll.register(self.fd, select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            # Bytes nobody asked for (or after the answer ended): the stream is out of step.
            self.must_close = True
            if not self.busy:
                self.close()
            return
        self.received = True
        self._last_rx = self.loop.time()
        heading = not self.headers_done.done()
        if heading:
            self._feeding = len(data)
        try:
            self.parser.feed_data(data)
            if self.body:
                self._queued()
            elif heading and not self.headers_done.done():
                self._head_fed += len(data)
                if self._head_fed > self.limits.head_bytes:
                    raise ResponseTooLarge(f"upstream response head over {self.limits.head_bytes} bytes")
        except ResponseTooLarge as exc:
            self._fail(exc)
            self.close()
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionFailed("upstream switched protocols unasked", sent=True, received=True))
            self.close()
        except httptools.HttpParserError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, ResponseTooLarge):  # raised by on_header, wrapped by httptools
                self._fail(cause)
            else:
                self._fail(ConnectionFailed(f"invalid HTTP from upstream: {exc}", sent=True, received=True))
            self.close()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._end_at_eof()
        return None  # close the transport: we never write after the server has finished

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.fd = -1
        self._poll = None
        if exc is None:
            self._end_at_eof()
        if self.busy and not self.complete:
            why = exc or "EOF"
            self._fail(ConnectionFailed(f"connection closed by upstream ({why})", sent=True, received=self.received))
        self._cancel_timer()
        self._on_lost(self)

    def _end_at_eof(self) -> None:
        # A response with neither Content-Length nor chunked framing ends where the connection does.
        if self.busy and self.headers_done.done() and not self.complete and not self.failed and self._until_close():
            self.keep_alive = False
            self.on_message_complete()

    def _until_close(self) -> bool:
        if self.status in (204, 304) or self._bodiless:
            return False
        coding: bytes | None = None
        sized = False
        for name, value in self.headers:
            if name == b"transfer-encoding":
                coding = value
            elif name == b"content-length":
                sized = True
        if coding is not None:
            return not coding.rstrip().lower().endswith(b"chunked")
        return not sized

    # ---- httptools callbacks --------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        headers.append((name.lower(), value))
        if len(headers) > self._lines_left:  # bytes are checked once, at the head's end
            raise ResponseTooLarge(f"upstream response head over {self.limits.headers} header lines")

    def on_headers_complete(self) -> None:
        # the head's bytes: reads that left it incomplete were counted as they came (data_received);
        # its lines are summed only when it ended in a read that could take it past the limit
        limit = self.limits.head_bytes
        if self._head_fed + self._feeding > limit and sum(len(n) + len(v) + 4 for n, v in self.headers) > limit:
            raise ResponseTooLarge(f"upstream response head over {limit} bytes")
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # 100 Continue, 103 Early Hints...: interim answers; llhttp goes on to the final one.
            self._informational = True
            self._lines_left -= 1  # each counts as a line: a flood of them is bounded too
            if len(self.headers) > self._lines_left:
                raise ResponseTooLarge(f"upstream response head over {self.limits.headers} lines (interim answers)")
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if self._bodiless:
            # llhttp does not know the request was HEAD and would wait for Content-Length bytes
            # that never come: the answer ends here, and the next exchange gets a fresh parser.
            self._fresh_parser = True
            self.keep_alive = self.parser.get_http_version() == "1.1" and not any(
                n == b"connection" and b"close" in v.lower() for n, v in self.headers
            )
            self.on_message_complete()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.complete:
            self.must_close = True  # a body after a HEAD answer: the server is out of step
            return
        if body:  # per chunk (a read of a stream holds dozens): the reader is woken once per read
            self.body.append(body)
            self._buffered += len(body)

    def _queued(self) -> None:
        """A read queued body: wake the reader; past the high-water mark (by a read at most), pause."""
        self._wake()
        crowded = self._buffered > _HIGH_WATER_BYTES or len(self.body) > _HIGH_WATER
        if crowded and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            self.headers = []
            return
        if self.complete:
            return
        self.complete = True
        # the read timer stays armed: an idle connection's timer finds nothing to time and lapses,
        # and the pooled connection's next exchange finds it still armed (see _arm_timer)
        self.body.append(_EOF)
        self._wake()

    # ---- timers and failure -----------------------------------------------------------------
    def _arm_timer(self) -> None:
        # An exchange begins: its silence is timed from now (adapters/lazy_timer.py). A handle still
        # armed from an earlier exchange on this connection serves: a connection kept busy by
        # back-to-back requests arms one timer per timeout, not a timer and a cancel per request,
        # and data_received only notes the time, far cheaper than moving a timer per chunk.
        self._last_rx = now = self.loop.time()
        if self.read_timeout_s > 0:
            self._timer.arm(now + self.read_timeout_s)

    def _cancel_timer(self) -> None:
        self._timer.stop()

    def _read_deadline(self) -> float:
        """The read deadline in force when the timer fires: none once the answer is over."""
        if self.complete or self.failed or not self.busy:
            return math.inf
        if self.paused:  # we stopped reading, not the server: its silence does not count
            self._last_rx = self.loop.time()
        return self._last_rx + self.read_timeout_s

    def _read_timed_out(self) -> None:
        self._fail(ReadTimeout(f"no data from upstream for {self.read_timeout_s:g} s"))
        self.close()

    def _fail(self, exc: HTTPClientError) -> None:
        self._cancel_timer()
        if self.complete or self.failed:
            return
        self.failed = True
        self.must_close = True
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # mark retrieved: the caller may have gone already
        else:
            self.body.append(exc)
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    # ---- one exchange -------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, *, bodiless: bool) -> None:
        """Write one request. Raises ConnectionFailed(sent=False) if the connection is already
        gone, so that nothing is written into a dead socket."""
        if self.transport is None or self.closed or self.eof or self.transport.is_closing():
            raise ConnectionFailed("connection closed before the request was written", sent=False)
        if self._fresh_parser:
            self.parser = httptools.HttpResponseParser(self)
            self._fresh_parser = False
        self._reset(bodiless=bodiless)
        self._arm_timer()
        if len(body) < 65536:
            self.transport.write(head + body)
        else:  # no copy of a large body just to prepend the head
            self.transport.write(head)
            self.transport.write(body)

    async def next_chunk(self, coalesce: bool = False) -> bytes | None:
        """The next piece of the body, None at its end. `coalesce`: every piece already received,
        as one (a relay then writes once what arrived at once: a fast 32-token stream is one or two
        writes downstream, not 33; nothing waits for more)."""
        while not self.body:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        queue = self.body
        item = queue.popleft()
        if type(item) is bytes:
            if coalesce and queue and type(queue[0]) is bytes:
                parts = [item]
                while queue and type(queue[0]) is bytes:  # stop before the end or a failure
                    parts.append(queue.popleft())
                item = b"".join(parts)
            self._buffered -= len(item)
        if self.paused and len(queue) < _HIGH_WATER // 2 and self._buffered < _HIGH_WATER_BYTES // 2:
            self.resume()  # paused at the high-water mark: on again once half of it has drained
        if type(item) is bytes:
            return item
        if item is _EOF:
            return None
        raise item  # a failure: the only other thing queued

    def resume(self) -> None:
        """Back to reading before going idle, so an idle connection still notices the server leave."""
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
