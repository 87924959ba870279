"""One request on a server connection (adapters/http1_server.py): its body as it arrives, the ASGI
`receive`/`send` pair the application is called with, and the response framing.

Framing rules, as HTTP/1.1 wants them: an application's own Content-Length or chunked
Transfer-Encoding is kept; otherwise a body that comes whole in its first `http.response.body`
message gets a Content-Length and one that comes in pieces is sent chunked. HEAD, 1xx, 204 and 304
answers carry no body. The head is held until the first body message so that both go out in one
write.

A request the server refuses (malformed, too slow, one too many) is answered here too, in the
application's place, with an OpenAI-style error body (`error_response`, `ServerExchange.refuse`).
The connection is seen only through `ExchangeOwner`, the few things an exchange asks of it.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol

import httptools

log = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
App = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
_DISCONNECT: dict[str, Any] = {"type": "http.disconnect"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INTERNAL_ERROR = b"Internal Server Error"
_ERROR_TYPES = {503: "service_unavailable", 429: "rate_limit_error"}  # the rest: the client's request


def error_response(status: int, message: str, code: str | None = None, headers: Iterable[bytes] = ()) -> bytes:
    """A whole answer that ends the connection: `status`, an OpenAI-style error body, and any
    extra header lines (each ending in CRLF)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)
    return (STATUS_LINES.get(status) or _status_line(status)) + head + b"".join(headers) + b"\r\n" + body


def http_scope(
    parser: httptools.HttpRequestParser,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    server: tuple[str, int] | None,
    client: tuple[str, int] | None,
    scheme: str,
    root_path: str,
) -> dict[str, Any]:
    """The ASGI scope of the request whose head `parser` just parsed (but its `state`)."""
    url = httptools.parse_url(target)
    raw_path = url.path
    path = raw_path.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": parser.get_http_version(),
        "server": server,
        "client": client,
        "scheme": scheme,
        "method": parser.get_method().decode("ascii"),
        "root_path": root_path,
        "path": root_path + path,
        "raw_path": root_path.encode("ascii") + raw_path,
        "query_string": url.query or b"",
        "headers": headers,
    }


class ExchangeOwner(Protocol):
    """What an exchange needs of its connection (adapters/http1_server.py)."""

    loop: asyncio.AbstractEventLoop
    write_paused: bool

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def resume_reading(self) -> None: ...

    async def drain(self) -> None: ...

    def default_header_lines(self) -> list[bytes]: ...

    def response_complete(self, exchange: ServerExchange) -> None: ...


class ServerExchange:
    """The state of one request and its answer. Owned by its connection; the application task
    touches it only through `receive`, `send` and the disconnect extension."""

    __slots__ = (
        "_bodiless",
        "_chunked",
        "_gone_callbacks",
        "_head",
        "_remaining",
        "_waiter",
        "_written",
        "body",
        "buffered",
        "conn",
        "disconnected",
        "expect_continue",
        "keep_alive",
        "more_body",
        "request_done",
        "response_complete",
        "response_started",
        "scope",
    )

    def __init__(self, conn: ExchangeOwner, scope: dict[str, Any], *, keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []  # received, not yet handed to the application
        self.buffered = 0
        self.more_body = True  # the request's body has not ended yet
        self.request_done = False  # the application has been handed the body's last piece
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._gone_callbacks: list[Callable[[], object]] | None = None
        self._head: list[bytes] | None = None  # the response head, until the first body message
        self._remaining: int | None = None  # Content-Length still to send
        self._chunked = False
        self._bodiless = False
        self._written = False  # some byte of the answer is on the wire

    # ---- from the connection -------------------------------------------------------------------

    def take_body(self, data: bytes) -> int:
        """A piece of the request body; the bytes now buffered (0: discarded, the answer is out)."""
        if self.response_complete or self.disconnected:
            return 0
        self.body.append(data)
        self.buffered += len(data)
        self._wake()
        return self.buffered

    def body_complete(self) -> None:
        self.more_body = False
        self._wake()

    def client_gone(self) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        self._wake()
        callbacks, self._gone_callbacks = self._gone_callbacks, None
        if callbacks and not self.response_complete:
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # one failing callback must not stop the others
                    log.exception("a disconnect callback failed")

    def refuse(self, response: bytes) -> bool:
        """Answer with `response` (a whole one, see `error_response`) in the application's place and
        tell the application the client is gone; False when its own answer has begun already."""
        if self.response_started or self.disconnected:
            return False
        self.keep_alive = False
        self.client_gone()  # the application stops: receive() says disconnect, send() is ignored
        self.response_started = self.response_complete = self._written = True
        self.conn.write(response)
        self.conn.response_complete(self)
        return True

    def on_disconnect(self, callback: Callable[[], object]) -> None:
        """The `conductor.on_disconnect` extension: call `callback` once if the client goes away
        before the answer is complete (at once, on the loop, if it already has)."""
        if self.disconnected:
            if not self.response_complete:
                self.conn.loop.call_soon(callback)
            return
        if self._gone_callbacks is None:
            self._gone_callbacks = []
        self._gone_callbacks.append(callback)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- ASGI ----------------------------------------------------------------------------------

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:  # the connection must end cleanly whatever happened
            log.error("Exception in ASGI application", exc_info=exc)
            if not self._written:
                self._internal_error()  # nothing is on the wire yet: the client gets a 500
            else:
                self.conn.close()
        else:
            if not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                self._internal_error()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self.conn.close()
        finally:
            self._gone_callbacks = None
            # the scope's extensions hold this exchange's bound methods: a reference cycle that only
            # the cyclic collector would free, one per request, and its collections were ~5% of
            # the gateway's CPU at concurrency 64 (benchmarks/profile_gateway.py); broken here
            self.scope.pop("extensions", None)

    async def receive(self) -> Message:
        if self.expect_continue:
            self.expect_continue = False
            if not self.response_started:
                self.conn.write(_CONTINUE)
        while True:
            if self.disconnected or self.response_complete:
                return _DISCONNECT.copy()
            if not self.request_done and (self.body or not self.more_body):
                chunks, self.body, self.buffered = self.body, [], 0
                more = self.more_body
                self.request_done = not more
                self.conn.resume_reading()
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                return {"type": "http.request", "body": data, "more_body": more}
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got {kind!r}.")
            self._start(message["status"], message.get("headers", ()))
        elif self.response_complete or kind != "http.response.body":
            raise RuntimeError(f"Unexpected ASGI message {kind!r} sent after the response was complete or before its body.")
        else:
            self._body(message.get("body", b""), message.get("more_body", False))

    # ---- the response ----------------------------------------------------------------------------

    def _start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.response_started = True
        self.expect_continue = False
        head = [STATUS_LINES.get(status) or _status_line(status)]
        head.extend(self.conn.default_header_lines())
        has_close = False
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"content-length":
                try:
                    self._remaining = int(value)
                except ValueError:
                    raise RuntimeError(f"Invalid Content-Length {value!r}.") from None
            elif lowered == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif lowered == b"connection" and b"close" in value.lower():
                self.keep_alive, has_close = False, True
            head.append(b"%s: %s\r\n" % (name, value))
        if not self.keep_alive and not has_close:
            head.append(b"connection: close\r\n")
        self._bodiless = status < 200 or status in (204, 304) or self.scope["method"] == "HEAD"
        self._head = head

    def _body(self, body: bytes, more: bool) -> None:
        head = self._head
        prefix = b""
        if head is not None:
            self._head = None
            if self._remaining is None and not self._chunked and not self._bodiless:
                if more:
                    self._chunked = True
                    head.append(b"transfer-encoding: chunked\r\n")
                else:
                    head.append(b"content-length: %d\r\n" % len(body))
                    self._remaining = len(body)
            lines = len(head)
            head.append(b"\r\n")
            prefix = b"".join(head)
            # every line ends in exactly one CRLF: a CR or LF inside a header would split the response
            if prefix.count(b"\n") != lines + 1 or prefix.count(b"\r") != lines + 1:
                raise RuntimeError("Invalid HTTP header: CR or LF in a header name or value.")
        if self._bodiless:
            payload = b""
        elif self._chunked:
            payload = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                payload += b"0\r\n\r\n"
        else:
            if self._remaining is not None:
                if len(body) > self._remaining:
                    raise RuntimeError("Response content longer than Content-Length.")
                self._remaining -= len(body)
            payload = body
        data = prefix + payload if prefix else payload
        if data:
            self._written = True
            self.conn.write(data)
        if not more:
            if self._remaining and not self._bodiless:
                raise RuntimeError("Response content shorter than Content-Length.")
            self.response_complete = True
            self._wake()
            self.conn.response_complete(self)

    def _internal_error(self) -> None:
        if self.disconnected or self.response_complete or self._written:
            return
        self.keep_alive = False
        self._remaining, self._chunked = None, False
        self._start(500, ((b"content-type", b"text/plain; charset=utf-8"),))
        self._body(_INTERNAL_ERROR, False)


def simple_response(status: int, text: str) -> App:
    """An ASGI application that answers every request with `status` and an OpenAI-style error body."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error")
    body = json.dumps({"error": {"message": text, "type": kind, "param": None, "code": None}}).encode()

    async def app(
        scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app
