"""The gateway's HTTP/1.1 server connection: an asyncio.Protocol on httptools' request parser that
runs an ASGI application, given to uvicorn as its `http` protocol class.

uvicorn's Server keeps what it is good at (listening sockets, SO_REUSEPORT workers, the lifespan,
signals, graceful shutdown: it only calls `connection_made`/`connection_lost` and `shutdown()` and
watches `server_state.connections` and `.tasks`). This class replaces uvicorn's per-connection
protocol, which on the gateway's hot path cost more than the routing itself (profiled:
benchmarks/profile_gateway.py, docs/performance.md). What it does differently, and why:

* The response head is written together with the first body piece: a non-streamed answer is one
  `write` (one send system call) instead of two, and a stream's head rides with its first event.
  A body that comes whole in its first message gets a Content-Length, not chunked framing.
* Response headers are checked for CR/LF (response splitting) once over the joined head, not by
  two regular expressions per header.
* No asyncio.Event, flow-control object or dict copy per request: a request waits on one future,
  created only when it has to wait.
* `scope["extensions"]["conductor.on_disconnect"]` registers a callback for a client that goes
  away before its answer is complete, so the gateway needs no task per request blocked in
  `receive()` to find out (it still works that way under any other ASGI server).
  `scope["extensions"]["conductor.draining"]()` tells whether uvicorn began its graceful shutdown:
  a request cancelled then, and not by its client leaving, was cut at the end of the drain grace.

HTTP itself (request line, headers, chunked request bodies, keep-alive rules) is parsed by
httptools (llhttp); nothing here parses bytes by hand. The per-request state and the ASGI
`receive`/`send` pair live in adapters/http1_exchange.py.

What a client can make it hold is bounded, and every request refused gets a status line and an
OpenAI-style error body before a lingering close: see adapters/http1_server_limits.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar, cast

import httptools

from adapters.http1_exchange import ServerExchange, error_response, http_scope, simple_response
from adapters.http1_server_limits import ServerLimits, linger
from adapters.lazy_timer import LazyTimer
from adapters.throttled_log import ThrottledLog

if TYPE_CHECKING:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

log = logging.getLogger(__name__)
_refusals = ThrottledLog(log, 10.0)  # a client sending garbage must not flood the log

MAX_URL_BYTES = 16 * 1024  # longer targets: 414
MAX_HEAD_BYTES = 64 * 1024  # all request header lines together; more: 431
BODY_HIGH_WATER = 256 * 1024  # buffered request body before the socket stops being read


class _StopParsing(Exception):
    """Raised from a parser callback to stop parsing; the status is kept on the connection."""


class HttpServerConnection(asyncio.Protocol):
    """One client connection: parses requests, runs each as an ASGI task, one at a time
    (pipelined requests wait their turn with the socket paused)."""

    limits: ClassVar[ServerLimits] = ServerLimits()

    @classmethod
    def with_limits(cls, limits: ServerLimits) -> type[HttpServerConnection]:
        """This protocol with other limits, to give uvicorn as its `http` class."""
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(
        self, config: Config, server_state: ServerState, app_state: dict[str, Any], _loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        # how long a connection may sit idle, take to send a request head, or go silent mid-body
        # (nginx's keepalive, client_header and client_body timeouts in one): uvicorn's keep-alive
        self.idle_s = float(config.timeout_keep_alive)
        self.limit_concurrency = config.limit_concurrency
        self.root_path = config.root_path
        self.parser = httptools.HttpRequestParser(self)
        try:  # answer the first of several pipelined requests even when the client closed after them
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools < 0.6.3
            pass
        self.transport: asyncio.Transport | None = None
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.exchange: ServerExchange | None = None  # the request being answered
        self.queued: deque[ServerExchange] = deque()  # pipelined requests behind it
        self.write_paused = False
        self.draining = False  # uvicorn called shutdown(): the server stops once the grace is out
        self._drained: asyncio.Future[None] | None = None
        self.read_paused = False
        # the connection's silence (idle keep-alive, a head trickling in, a stalled body): one
        # handle re-used across requests (adapters/lazy_timer.py); the linger's close timer apart
        self._idle = LazyTimer(self.loop, self._timed_out)
        self._linger_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_since = 0.0  # when the head of the request whose body is read came in
        self._final: bytes | None = None  # a refusal, sent once the requests before it are answered
        self._done_reading = False  # refused: the parser is dead, whatever arrives is dropped
        self._head_started = False  # bytes of a request head have arrived, the head is not complete
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._expect_continue = False
        self._parsing: ServerExchange | None = None
        self._refusal: tuple[int, str] | None = None  # why a callback stopped the parser
        self._defaults: list[tuple[bytes, bytes]] | None = None  # uvicorn's Date/Server headers...
        self._default_lines: list[bytes] = []  # ...as header lines (uvicorn renews the list every second)

    # ---- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        self.transport = transport
        if len(self.server_state.connections) >= self.limits.max_connections:
            _refusals.warn("refused a connection: %d open already", self.limits.max_connections)
            message = f"More than {self.limits.max_connections} open connections; try again."
            self.write(error_response(503, message, "too_many_connections", [b"retry-after: 1\r\n"]))
            self._linger()
            return
        self.server_state.connections.add(self)  # type: ignore[arg-type]
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        self._arm_timer()  # a client that connects and sends nothing is not kept

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._idle.stop()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._cancel_body_timer()
        for exchange in (self.exchange, *self.queued):
            if exchange is not None:
                exchange.client_gone()
        self.queued.clear()
        self.resume_writing()
        self.parser = None  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        # a head must be complete within idle_s of the connection's idle start (the timer keeps
        # running: a client trickling a head byte by byte is cut); a body may not go silent longer
        if self._done_reading:
            return
        if self._parsing is not None:
            self._cancel_timer()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no protocol upgrades here (no websockets): the request is answered as plain HTTP
            # and the connection closed after it, since what follows is not HTTP
            target = self._parsing or self.exchange
            if target is not None:
                target.keep_alive = False
        except httptools.HttpParserError:
            self._refuse(*(self._refusal or (400, "Invalid HTTP request received.")))
            return
        if self._parsing is not None:  # more body to come
            if not self._idle.armed:
                self._arm_timer()
            if self._body_timer is None:
                when = self._body_since + self.limits.body_timeout_s
                self._body_timer = self.loop.call_at(when, self._body_timed_out)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; a request still in flight sees the client gone (a lingering close ends)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def is_draining(self) -> bool:
        return self.draining

    async def drain(self) -> None:
        """Until the transport takes writes again (the client reads too slowly)."""
        if self.write_paused:
            if self._drained is None:
                self._drained = self.loop.create_future()
            await self._drained

    # ---- uvicorn's Server calls this on SIGTERM --------------------------------------------------

    def shutdown(self) -> None:
        self.draining = True
        if self.exchange is None or self.exchange.response_complete:
            if self.transport is not None:
                self.transport.close()
        else:
            self.exchange.keep_alive = False

    # ---- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._expect_continue = False
        self._parsing = None
        self._head_started = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            self._refusal = (414, "Request-URI too long.")
            raise _StopParsing

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refusal = (431, "Request header fields too large.")
            raise _StopParsing
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        self._head_started = False
        self._body_since = self.loop.time()
        if self.exchange is not None and len(self.queued) >= self.limits.max_pipelined:
            self._refusal = (503, f"More than {self.limits.max_pipelined} pipelined requests; send it again.")
            raise _StopParsing
        parser = self.parser
        version = parser.get_http_version()
        scope = http_scope(parser, self._url, self._headers, self.server, self.client, self.scheme, self.root_path)
        scope["state"] = self.app_state.copy()
        exchange = ServerExchange(
            self, scope, keep_alive=version != "1.0" and parser.should_keep_alive(), expect_continue=self._expect_continue
        )
        scope["extensions"] = {"conductor.on_disconnect": exchange.on_disconnect, "conductor.draining": self.is_draining}
        self._parsing = exchange
        if self.exchange is None:
            self._start(exchange)
        else:  # pipelined: answered after the one before it, the socket paused meanwhile
            self.queued.append(exchange)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self._parsing
        if exchange is not None and exchange.take_body(body) > BODY_HIGH_WATER:
            self.pause_reading()

    def on_message_complete(self) -> None:
        if self._parsing is not None:
            self._parsing.body_complete()
            self._cancel_timer()
            self._cancel_body_timer()
        self._parsing = None

    # ---- requests --------------------------------------------------------------------------------

    def _start(self, exchange: ServerExchange) -> None:
        self.exchange = exchange
        tasks = self.server_state.tasks
        busy = self.limit_concurrency is not None and (
            len(self.server_state.connections) >= self.limit_concurrency or len(tasks) >= self.limit_concurrency
        )
        task = self.loop.create_task(exchange.run(simple_response(503, "Service Unavailable") if busy else self.app))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def response_complete(self, exchange: ServerExchange) -> None:
        """`exchange` has written its whole answer: on to the next request, or wait for one."""
        self.server_state.total_requests += 1
        transport = self.transport
        if exchange is not self.exchange or transport is None or transport.is_closing():
            return
        self.exchange = None
        if not exchange.keep_alive:
            self._linger() if self._done_reading else transport.close()
            return
        if self.queued:
            self._start(self.queued.popleft())
            if not self.queued:
                self.resume_reading()
        elif self._final is not None:  # the requests before the refused one are answered: now it
            self.write(self._final)
            self._linger()
        else:
            self.resume_reading()
            self._arm_timer()

    def pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.transport is not None and not self.queued:
            self.read_paused = False
            self.transport.resume_reading()

    def default_header_lines(self) -> list[bytes]:
        defaults = self.server_state.default_headers
        if defaults is not self._defaults:
            self._defaults = defaults
            self._default_lines = [b"%s: %s\r\n" % (name, value) for name, value in defaults]
        return self._default_lines

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """A request that cannot be parsed, or is one too many, or too slow: nothing more is parsed;
        it is answered `status` once every request before it is (at once if none is pending), in
        the application's place if it was started already, and the connection closes."""
        _refusals.warn("refused a request from %s: %d %s", self.client, status, message)
        self._done_reading = True
        self._cancel_body_timer()
        refused, self._parsing = self._parsing, None
        if refused is not None and refused.response_complete:  # answered before its body ended (a 413)
            self._linger()
            return
        extra = [b"retry-after: 1\r\n"] if status == 503 else []
        response = error_response(status, message, None, extra)
        if refused is not None and refused is self.exchange:
            if not refused.refuse(response):  # its answer is under way: no status line can go first
                self.close()
            return
        if refused is not None and refused in self.queued:
            self.queued.remove(refused)  # never started: the refusal answers it
        self._final = response
        if self.exchange is None:
            self.write(response)
            self._linger()

    def _linger(self) -> None:
        """Close after the answer is out, reading and dropping what the client still sends for a
        moment (a close with unread bytes would reset the connection, and the reset can destroy
        the answer in the client's buffers before it is read)."""
        self._done_reading = True
        self._idle.stop()
        if self.transport is not None:
            self.read_paused = False
            self._linger_timer = linger(self.transport, self.loop)

    def _arm_timer(self) -> None:
        self._idle.arm(self.loop.time() + self.idle_s)

    def _cancel_timer(self) -> None:
        self._idle.disarm()

    def _timed_out(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.read_paused:  # the silence is ours (a pipelined request waits, or a full body buffer)
            self._arm_timer()
            return
        if self._parsing is not None:  # a body went silent: the application sees the client gone
            self._refuse(408, f"Request body stalled for {self.idle_s:g}s.")
        elif self.exchange is None:
            if self._head_started:
                self._refuse(408, f"Request head not complete within {self.idle_s:g}s.")
            else:
                self.close()  # idle keep-alive connection

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._parsing is None or self.transport is None or self.transport.is_closing():
            return
        if self.read_paused:  # we stopped reading (the application is behind): not the client's time
            self._body_timer = self.loop.call_later(self.idle_s, self._body_timed_out)
            return
        self._refuse(408, f"Request body not complete within {self.limits.body_timeout_s:g}s.")

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None
