"""Every request the gateway's HTTP/1.1 server refuses gets a status line and an OpenAI-style error
body before the connection closes (issue 34): a malformed body, a pipeline past its limit, a body
too slow in all, a connection past the cap. A real uvicorn server, clients writing exact bytes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import h11
import pytest

from adapters.http1_server import HttpServerConnection
from adapters.http1_server_limits import ServerLimits
from tests.adapters.test_http1_server import App, closed_or_cut, connect, header, responses
from tests.support.servers import ServerThread
from tests.support.waiting import wait_for


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[App, ServerThread]]:
    app = App()
    limits = getattr(request, "param", ServerLimits())
    server = ServerThread(app, http=HttpServerConnection.with_limits(limits)).start()
    try:
        yield app, server
    finally:
        app.release.set()
        server.stop()


def error_of(resp: h11.Response, body: bytes, status: int) -> dict[str, Any]:
    assert resp.status_code == status
    assert header(resp, b"content-type") == b"application/json" and header(resp, b"connection") == b"close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    "body",
    [b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabc\r\n-1\r\n", b"3\r\nabcXX"],
    ids=["bad-size", "negative-size", "no-crlf-after-data"],
)
def test_a_malformed_chunked_body_gets_a_400(served: Any, body: bytes) -> None:
    app, server = served
    with connect(server) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        [(resp, answer)] = responses(sock, 1)
        assert error_of(resp, answer, 400)["type"] == "invalid_request_error"
        assert closed_or_cut(sock)
    assert wait_for(lambda: "/a:end" in app.order)  # the application saw the client gone and ended
    assert app.bodies[0] in (b"", b"abc")  # what came before the bad bytes; its answer went nowhere


def test_the_requests_before_a_malformed_one_are_answered_first(served: Any) -> None:
    app, server = served
    with connect(server) as sock:
        sock.sendall(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz"
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nnot-a-size\r\n"
        )
        assert wait_for(lambda: app.order == ["/slow:start"])
        app.release.set()
        got = responses(sock, 3)
        assert [r.status_code for r, _ in got] == [200, 200, 400]
        assert got[1][1] == b"echo:z"
        error_of(*got[2], 400)
        assert closed_or_cut(sock)
    assert "/c:start" not in app.order


def test_forty_pipelined_requests_in_one_write_are_each_answered_or_refused(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"".join(b"GET /r%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(40)))
        got = responses(sock, 40)
        assert [r.status_code for r, _ in got] == [200] * 33 + [503]  # one in flight, 32 queued, then no
        assert error_of(*got[-1], 503)["type"] == "service_unavailable"
        assert closed_or_cut(sock)
    assert [b for _, b in got[:33]] == [b"echo:"] * 33


@pytest.mark.parametrize("served", [ServerLimits(body_timeout_s=1.0)], indirect=True)
def test_a_body_trickled_past_its_deadline_gets_a_408(served: Any) -> None:
    app, server = served
    received = b""
    sent = 0
    with connect(server) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        sock.settimeout(0.05)  # paces the client: a byte per 50 ms, never silent, 50 s for the body
        while sent < 1000 and not received:
            try:
                sock.sendall(b"b")
                sent += 1
                received += sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
        sock.settimeout(10)
        received += b"".join(iter(lambda: sock.recv(65536), b""))
    assert sent < 1000  # answered before the body was complete
    assert received.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    assert wait_for(lambda: app.bodies != [])
    assert len(app.bodies[0]) < 1000 and "/a:end" in app.order  # the application saw the client gone


@pytest.mark.parametrize("served", [ServerLimits(max_connections=2)], indirect=True)
def test_a_connection_past_the_cap_gets_a_503(served: Any) -> None:
    _, server = served
    held = [connect(server), connect(server)]
    for sock in held:  # both accepted, and kept alive
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, _)] = responses(sock, 1)
        assert resp.status_code == 200
    with connect(server) as extra:
        extra.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, body)] = responses(extra, 1)
        assert error_of(resp, body, 503)["code"] == "too_many_connections"
        assert closed_or_cut(extra)
    held.pop().close()

    def a_new_connection_is_served() -> bool:  # once the server has seen the close
        with connect(server) as sock:
            sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            return responses(sock, 1)[0][0].status_code == 200

    deadline = time.monotonic() + 30
    while not a_new_connection_is_served():
        assert time.monotonic() < deadline, "the freed connection slot was never reused"
    held[0].close()


def test_malformed_heads_get_an_openai_error_body(served: Any) -> None:
    _, server = served
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        [(resp, body)] = responses(sock, 1)
        error_of(resp, body, 400)
        assert closed_or_cut(sock)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with sock:
        sock.sendall(b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        [(resp, body)] = responses(sock, 1)
        error_of(resp, body, 414)
