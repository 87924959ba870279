"""The gateway's own HTTP/1.1 server protocol (adapters/http1_server.py), run by a real uvicorn
Server on a real socket, against clients that write exactly the bytes a test needs. Responses are
read back with h11 (a maintained parser), never split by hand."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import h11
import pytest

from adapters.http1_server import HttpServerConnection
from tests.support.asgi import lifespan, whole_body
from tests.support.servers import ServerThread
from tests.support.waiting import wait_for


class App:
    """An ASGI app whose answer the request path picks; it records what it saw."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.order: list[str] = []
        self.gone: list[str] = []
        self.release = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        path = scope["path"]
        body = await whole_body(receive)
        self.bodies.append(body)
        self.order.append(path + ":start")
        start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        if path == "/slow":  # answered only when the test says so
            await asyncio.to_thread(self.release.wait)  # set from the test's thread
        if path == "/pieces":
            await send(start)
            for piece in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/fail-before":
            raise RuntimeError("planted failure before the answer")
        elif path == "/fail-after-head":
            await send(start)
            raise RuntimeError("planted failure after the head")
        elif path == "/fail-mid-stream":
            await send(start)
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("planted failure mid-stream")
        elif path == "/bad-header":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-evil", b"a\r\nset-cookie: x")]})
            await send({"type": "http.response.body", "body": b"never"})
        elif path == "/no-content":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/watch":
            scope["extensions"]["conductor.on_disconnect"](lambda: self.gone.append(path))
            await send(start)
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await asyncio.to_thread(self.release.wait)  # set from the test's thread
            await send({"type": "http.response.body", "body": b""})
        else:
            if path == "/watch-done":
                scope["extensions"]["conductor.on_disconnect"](lambda: self.gone.append(path))
            await send(start)
            await send({"type": "http.response.body", "body": b"echo:" + body})
        self.order.append(path + ":end")


@pytest.fixture
def served() -> Iterator[tuple[App, ServerThread]]:
    app = App()
    server = ServerThread(app, http=HttpServerConnection).start()
    try:
        yield app, server
    finally:
        app.release.set()
        server.stop()


def connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def responses(sock: socket.socket, count: int, method: bytes = b"GET") -> list[tuple[h11.Response, bytes]]:
    """`count` responses read off `sock` by h11 (the last one may end the connection)."""
    conn = h11.Connection(h11.CLIENT)
    out: list[tuple[h11.Response, bytes]] = []
    for _ in range(count):
        conn.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))  # keeps h11's states in step
        conn.send(h11.EndOfMessage())
        head: h11.Response | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before the response ended")
        assert head is not None
        out.append((head, body))
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            break
        conn.start_next_cycle()
    return out


def header(response: h11.Response, name: bytes) -> bytes | None:
    return next((v for k, v in response.headers if k == name), None)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_whole_body_is_sent_with_content_length_in_one_write(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, server = served
    writes: list[bytes] = []
    real = HttpServerConnection.write
    monkeypatch.setattr(HttpServerConnection, "write", lambda self, data: (writes.append(data), real(self, data)))
    with connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        [(resp, body)] = responses(sock, 1)
    assert resp.status_code == 200 and body == b"echo:hello"
    assert header(resp, b"content-length") == b"10" and header(resp, b"transfer-encoding") is None
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"echo:hello")


def test_a_body_in_pieces_is_chunked_and_arrives_whole(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"GET /pieces HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, body)] = responses(sock, 1)
    assert header(resp, b"transfer-encoding") == b"chunked" and body == b"one two three"


def test_chunked_request_bodies_and_keep_alive(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        [(_, first)] = responses(sock, 1)
        sock.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz")  # the same connection
        [(_, second)] = responses(sock, 1)
    assert (first, second) == (b"echo:abcde", b"echo:z")


def test_a_large_body_arrives_whole_through_backpressure(served: Any) -> None:
    app, server = served
    payload = bytes(range(256)) * 8192  # 2 MiB: past the high-water mark, so reading pauses
    with connect(server) as sock:
        sock.sendall(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        [(_, body)] = responses(sock, 1)
    assert app.bodies == [payload] and body == b"echo:" + payload


def test_pipelined_requests_are_answered_in_order_one_at_a_time(served: Any) -> None:
    app, server = served
    with connect(server) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        assert wait_for(lambda: app.order == ["/slow:start"])
        app.release.set()
        got = responses(sock, 2)
    assert [b for _, b in got] == [b"echo:", b"echo:"]
    # the app records its end after it sent the answer the client already read: wait for it
    assert wait_for(lambda: len(app.order) == 4)
    assert app.order == ["/slow:start", "/slow:end", "/second:start", "/second:end"]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /a HTTP/1.0\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ],
    ids=["http-1.0", "connection-close"],
)
def test_the_connection_closes_when_the_client_asks(served: Any, request_bytes: bytes) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(request_bytes)
        [(resp, body)] = responses(sock, 1)
        assert header(resp, b"connection") == b"close" and body == b"echo:"
        assert closed(sock)


def test_head_and_no_content_answers_carry_no_body(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, body)] = responses(sock, 1, method=b"HEAD")
        assert resp.status_code == 200 and body == b""
        sock.sendall(b"GET /no-content HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, body)] = responses(sock, 1)
        assert resp.status_code == 204 and body == b"" and header(resp, b"content-length") is None


def test_expect_100_continue_is_answered_before_the_body_is_sent(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
        interim = sock.recv(64)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"abc")
        [(_, body)] = responses(sock, 1)
    assert body == b"echo:abc"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET /a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /a HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 70000 + b"\r\n\r\n", 431),
    ],
    ids=["garbage", "two-lengths", "long-url", "huge-headers"],
)
def test_malformed_requests_get_a_status_and_a_closed_connection(served: Any, request_bytes: bytes, status: int) -> None:
    app, server = served
    with connect(server) as sock:
        sock.sendall(request_bytes)
        [(resp, _)] = responses(sock, 1)
        assert resp.status_code == status
        assert closed(sock)
    assert app.bodies == []  # nothing reached the application


@pytest.mark.parametrize("path", ["/fail-before", "/fail-after-head", "/bad-header"])
def test_an_application_failure_before_any_byte_is_a_500(served: Any, path: str) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, body)] = responses(sock, 1)
        assert resp.status_code == 500 and body == b"Internal Server Error"
        assert b"set-cookie" not in b"".join(k for k, _ in resp.headers)
        assert closed(sock)


def test_an_application_failure_mid_stream_cuts_the_connection(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"GET /fail-mid-stream HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(h11.RemoteProtocolError, match="incomplete chunked read"):  # the client can tell
            responses(sock, 1)


def test_the_disconnect_callback_fires_only_for_an_unfinished_answer(served: Any) -> None:
    app, server = served
    with connect(server) as sock:
        sock.sendall(b"GET /watch-done HTTP/1.1\r\nHost: x\r\n\r\n")
        responses(sock, 1)
    with connect(server) as sock:
        sock.sendall(b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n")
        assert wait_for(lambda: "/watch:start" in app.order)
    assert wait_for(lambda: app.gone == ["/watch"])  # the finished one never fires


@pytest.fixture
def impatient() -> Iterator[tuple[App, ServerThread]]:
    app = App()
    server = ServerThread(app, http=HttpServerConnection, timeout_keep_alive=1).start()
    try:
        yield app, server
    finally:
        app.release.set()
        server.stop()


def test_a_silent_connection_is_closed(impatient: Any) -> None:
    _, server = impatient
    with connect(server) as sock:
        sock.settimeout(10)
        assert closed(sock)  # nothing sent: closed after the idle timeout, without an answer


def test_a_head_trickled_past_the_timeout_gets_408(impatient: Any) -> None:
    app, server = impatient
    received = b""
    with connect(server) as sock:
        sock.settimeout(0.05)  # paces the client: a byte per 50 ms at least, 6 s for the head
        for byte in b"GET /a HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 100 + b"\r\n\r\n":
            try:
                sock.sendall(bytes([byte]))
                received += sock.recv(4096)
            except TimeoutError:
                continue  # no answer yet: each byte keeps the head coming, yet resets no deadline
            except OSError:
                break
            if received:
                break
        if not received:
            sock.settimeout(5)
            received = sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 408 Request Timeout\r\n")  # within 1 s of connecting, not 6
    assert app.bodies == []


def test_a_stalled_body_is_answered_408_and_ends_the_request_as_a_disconnect(impatient: Any) -> None:
    app, server = impatient
    with connect(server) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part")
        [(resp, body)] = responses(sock, 1)  # silence past the timeout mid-body: a 408, then the close
        assert resp.status_code == 408 and json.loads(body)["error"]["type"] == "invalid_request_error"
        assert closed(sock)
    # the app's task runs on the server's thread and may record the body just after the close
    assert wait_for(lambda: app.bodies != [], timeout=10)
    assert app.bodies == [b"only part"]  # the app saw the body end with the client gone


def test_a_flood_of_pipelined_requests_is_answered_up_to_the_limit_then_503(served: Any) -> None:
    app, server = served
    with connect(server) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /q HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
        assert wait_for(lambda: app.order == ["/slow:start"])
        app.release.set()
        got = responses(sock, 200)  # 200 requests queued behind a slow one: over the limit of 32
        assert [r.status_code for r, _ in got] == [200] * 33 + [503]
        assert header(got[-1][0], b"connection") == b"close" and header(got[-1][0], b"retry-after") == b"1"
        assert json.loads(got[-1][1])["error"]["type"] == "service_unavailable"
        assert closed_or_cut(sock)
    assert app.order.count("/q:start") == 32  # those within the limit were answered, the rest never ran
    with connect(server) as sock:  # the server itself is fine
        sock.sendall(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, _)] = responses(sock, 1)
        assert resp.status_code == 200


def closed_or_cut(sock: socket.socket) -> bool:
    """The server closed the connection (whatever it had sent before)."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
