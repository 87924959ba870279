"""The upstream HTTP/1.1 client against real, misbehaving servers over real sockets.

Each server is a few lines of asyncio (or, where the client's loop must not run, a thread) that
writes exactly the bytes a test needs. Every test ends with no pool slot held (fixture `pools`).
No assertion is about time: short timeouts only make the failing cases end quickly.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from adapters.http1 import ConnectionFailed, InvalidRequest, Pool, PoolTimeout, ReadTimeout, authority, build_head
from adapters.upstream import Timeouts, Upstream, UpstreamPoolExhausted
from conductor.core.errors import UpstreamError, UpstreamTimeout
from tests.support.ports import free_port

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


class Peer:
    """The server's side of one connection."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server, self.reader, self.writer = server, reader, writer

    async def request(self) -> tuple[bytes, bytes] | None:
        """One whole request (head, body), recorded; None when the client closed."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await self.reader.readexactly(length)
        self.server.requests.append((head, body))
        return head, body

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_client_leaves(self) -> None:
        await self.reader.read()

    def reset(self) -> None:
        """Abortive close: the client gets an RST, not a FIN."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


Handler = Callable[[Peer], Awaitable[None]]


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handler(Peer(self, reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the test is over
        finally:
            writer.close()
            self.tasks.discard(task)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    started: list[tuple[Server, asyncio.Server]] = []

    async def start(handler: Handler, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> Server:
        server = Server(handler)
        srv = await asyncio.start_server(server._handle, host, 0, ssl=tls)
        server.port = srv.sockets[0].getsockname()[1]
        started.append((server, srv))
        return server

    yield start
    for server, srv in started:
        srv.close()
        for task in list(server.tasks):
            task.cancel()
        await asyncio.gather(*server.tasks, return_exceptions=True)


@pytest.fixture
async def pools() -> AsyncIterator[list[Pool]]:
    """Pools made by a test; afterwards none may hold a slot (responses dropped are collected)."""
    made: list[Pool] = []
    yield made
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()
    for _ in range(3):
        await asyncio.sleep(0)
    assert [p.in_use for p in made] == [0] * len(made), "a pool slot leaked"
    for p in made:
        await p.close()


async def keep_alive_ok(peer: Peer) -> None:
    while await peer.request() is not None:
        await peer.send(OK)


def new_pool(pools: list[Pool], port: int, host: str = "127.0.0.1", **kw: object) -> Pool:
    pool = Pool(host, port, **kw)  # type: ignore[arg-type]
    pools.append(pool)
    return pool


async def new_upstream(pools: list[Pool], url: str, timeouts: Timeouts | None = None, **kw: object) -> Upstream:
    up = Upstream("w0", url, timeouts=timeouts or Timeouts(), **kw)  # type: ignore[arg-type]
    await up.start()
    pools += [up.pool, up.probe_pool]
    return up


# ---- failures before anything is sent -------------------------------------------------------------
async def test_refused_connection_says_nothing_was_sent(pools: list[Pool]) -> None:
    port = free_port()
    with pytest.raises(ConnectionFailed) as info:
        await new_pool(pools, port).request("POST", "/v1/completions", {}, b"{}")
    assert info.value.sent is False
    up = await new_upstream(pools, f"http://127.0.0.1:{port}")
    with pytest.raises(UpstreamError) as err:
        await up.post("/v1/completions", b"{}", {})
    assert err.value.maybe_processed is False and err.value.instance == "w0"


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Request-ID": "a\r\nX-Injected: 1"},
        {"X-A": "a\nb"},
        {"X-A": "nul\x00"},
        {"X-A": "bell\x07"},
        {"Bad Name": "x"},
        {"X:Colon": "x"},
        {"": "x"},
        {"Content-Length": "3"},
        {"Host": "evil"},
        {"Transfer-Encoding": "chunked"},
        {"X-A": "snow \u2603"},
    ],
)
async def test_bad_headers_are_refused_before_connecting(
    serve: Callable[..., Awaitable[Server]], pools: list[Pool], headers: dict[str, str]
) -> None:
    server = await serve(keep_alive_ok)
    pool = new_pool(pools, server.port)
    with pytest.raises(InvalidRequest) as info:
        await pool.request("POST", "/", headers, b"{}")
    assert isinstance(info.value, ValueError)
    # refused before connecting: the pool never opened a connection (nothing to wait for), nor holds a slot
    assert pool.opened == 0 and pool.in_use == 0
    assert server.connections == 0 and server.requests == []


def test_request_head_is_built_from_validated_parts() -> None:
    host = authority("127.0.0.1", 8100, tls=False)
    assert build_head("POST", "/v1/x?a=1", host, {"Content-Type": "application/json", "X-T": "a\tb"}, 2) == (
        b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:8100\r\nContent-Type: application/json\r\nX-T: a\tb\r\n"
        b"Content-Length: 2\r\n\r\n"
    )
    assert build_head("GET", "/health", host, {}, 0) == b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8100\r\n\r\n"
    assert build_head("POST", "/", host, {}, 0).endswith(b"Content-Length: 0\r\n\r\n")
    for method, target in [
        ("GET /x HTTP/1.1\r\n", "/"),
        ("GET", "/a b"),
        ("GET", "/a\r\nX: y"),
        ("GET", "x"),
        ("GET", "/\u00e9"),
        ("", "/"),
    ]:
        with pytest.raises(InvalidRequest):
            build_head(method, target, host, {}, 0)
    assert authority("::1", 8100, tls=False) == b"[::1]:8100"
    assert authority("fe80::1%eth0", 80, tls=False) == b"[fe80::1]"
    assert authority("worker.local", 443, tls=True) == b"worker.local"
    assert authority("worker.local", 80, tls=True) == b"worker.local:80"
    with pytest.raises(InvalidRequest):
        authority("a b", 80, tls=False)


# ---- failures after the request was written: never re-sent --------------------------------------
async def test_reset_mid_response(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await asyncio.sleep(0.05)
        peer.reset()

    server = await serve(handler)
    pool = new_pool(pools, server.port)
    response = await pool.request("POST", "/", {}, b"{}")
    assert response.status == 200
    for _ in range(200):  # the reset arrives while nobody reads: the slot comes back anyway
        if pool.in_use == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.in_use == 0
    with pytest.raises(ConnectionFailed) as info:
        await response.read()
    assert info.value.sent is True and info.value.received is True
    assert len(server.requests) == 1


async def test_connection_dying_after_the_write_is_not_retried(
    serve: Callable[..., Awaitable[Server]], pools: list[Pool]
) -> None:
    # The first request is answered on a keep-alive connection; the second is read in full by the
    # server, which then closes without answering. The client must not send it again anywhere.
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(OK)
        await peer.request()

    server = await serve(handler)
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}")
    assert (await up.post("/prefill", b"{}", {})).body == b"hello"
    with pytest.raises(UpstreamError) as err:
        await up.post("/prefill", b'{"n": 2}', {})
    assert err.value.maybe_processed is True
    assert [body for _, body in server.requests] == [b"{}", b'{"n": 2}']  # the second one exactly once
    assert server.connections == 1

    # the same on the bare pool: the error says the request may have been processed
    pool = new_pool(pools, server.port)
    await (await pool.request("POST", "/", {}, b"a")).read()
    with pytest.raises(ConnectionFailed) as info:
        await pool.request("POST", "/", {}, b"b")
    assert info.value.sent is True and info.value.maybe_processed is True and info.value.received is False
    assert [body for _, body in server.requests][2:] == [b"a", b"b"]


async def test_stall_hits_the_read_timeout(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.until_client_leaves()

    server = await serve(handler)
    pool = new_pool(pools, server.port, read_timeout_s=0.2)
    with pytest.raises(ReadTimeout) as info:
        await pool.request("POST", "/", {}, b"{}")
    assert info.value.sent is True
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(read_s=0.2))
    with pytest.raises(UpstreamTimeout) as err:
        await up.post("/", b"{}", {})
    assert err.value.maybe_processed is True and err.value.status == 504


async def test_garbage_status_line_is_a_clear_error(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"FOO BAR\r\n\r\n")
        await peer.until_client_leaves()

    server = await serve(handler)
    with pytest.raises(ConnectionFailed, match="invalid HTTP"):
        await new_pool(pools, server.port).request("GET", "/", {})


async def test_unfinished_chunked_body_times_out_and_frees_the_slot(
    serve: Callable[..., Awaitable[Server]], pools: list[Pool]
) -> None:
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await peer.until_client_leaves()  # never the last chunk, never a close

    server = await serve(handler)
    pool = new_pool(pools, server.port, read_timeout_s=0.5, limit=1)
    response = await pool.request("POST", "/", {}, b"{}")
    chunks = response.chunks()
    assert await chunks.__anext__() == b"first"
    with pytest.raises(ReadTimeout):
        await chunks.__anext__()
    assert pool.in_use == 0  # the slot came back without anyone closing the response
    assert (await (await pool.request("POST", "/", {}, b"{}")).chunks().__anext__()) == b"first"


# ---- what ends a response ---------------------------------------------------------------------------
async def test_interim_100_and_103_are_skipped(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            await asyncio.sleep(0.01)
            await peer.send(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 200 OK\r\n")
            await peer.send(b"Content-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello")

    server = await serve(handler)
    pool = new_pool(pools, server.port)
    for _ in range(2):
        response = await pool.request("POST", "/", {}, b"{}")
        assert response.status == 200
        assert response.header("link") == "" and response.header("content-type") == "text/plain"
        assert await response.read() == b"hello"
    assert pool.opened == 1


async def test_close_delimited_body_is_complete_at_eof(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nabc")
        await asyncio.sleep(0.02)
        await peer.send(b"def")

    server = await serve(handler)
    pool = new_pool(pools, server.port)
    for _ in range(2):
        response = await pool.request("GET", "/", {})
        assert await response.read() == b"abcdef"
        assert pool.idle == 0  # the connection ended with the body: never reused
    assert pool.opened == 2


async def test_sized_body_cut_short_is_an_error(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")

    server = await serve(handler)
    response = await new_pool(pools, server.port).request("GET", "/", {})
    with pytest.raises(ConnectionFailed):
        await response.read()


async def test_head_and_bodiless_statuses_complete(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        while (req := await peer.request()) is not None:
            if req[0].startswith(b"HEAD"):
                await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
            elif b"/204" in req[0]:
                await peer.send(b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n")
            elif b"/304" in req[0]:
                await peer.send(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n")
            else:
                await peer.send(OK)

    server = await serve(handler)
    pool = new_pool(pools, server.port)
    for method, path, status in [
        ("HEAD", "/", 200),
        ("GET", "/", 200),
        ("HEAD", "/", 200),
        ("GET", "/204", 204),
        ("GET", "/304", 304),
        ("HEAD", "/", 200),
        ("GET", "/", 200),
    ]:
        response = await pool.request(method, path, {})
        assert response.status == status
        assert response.header("content-length") in ("1234", "7", "5")
        assert await response.read() == (b"hello" if status == 200 and method == "GET" else b"")
    assert pool.opened == 1  # each answer ended where it should: the connection stayed in step


async def test_error_status_is_relayed_and_connection_reused(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(b'HTTP/1.1 500 Internal Server Error\r\nContent-Length: 16\r\n\r\n{"error":"boom"}')

    server = await serve(handler)
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}")
    for _ in range(3):
        reply = await up.post("/v1/completions", b"{}", {"Content-Type": "application/json"})
        assert reply.status == 500 and reply.body == b'{"error":"boom"}'
    stream = await up.open_stream("/v1/completions", b"{}", {})
    assert stream.status == 500 and b"".join([c async for c in stream.chunks()]) == b'{"error":"boom"}'
    assert up.pool.opened == 1 and len(server.requests) == 4


async def test_streamed_body_with_backpressure(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    pieces = [b"data: %d\n\n" % i for i in range(500)]

    def encoded(some: list[bytes]) -> bytes:
        return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in some)

    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + encoded(pieces[:200]))
            await asyncio.sleep(0.1)  # the rest arrives while the client has stopped reading
            await peer.send(encoded(pieces[200:]) + b"0\r\n\r\n")

    server = await serve(handler)
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(read_s=1.0))
    for attempt in range(2):
        stream = await up.open_stream("/", b"x" * 200_000, {})  # a large body goes out in two writes
        got = []
        async for chunk in stream.chunks():
            got.append(chunk)
            if len(got) == 1 and attempt == 0:
                await asyncio.sleep(1.5)  # a slow reader pauses the socket; that is not upstream silence
        assert b"".join(got) == b"".join(pieces)
    assert up.pool.opened == 1 and len(server.requests[0][1]) == 200_000


async def test_pieces_that_arrived_together_are_relayed_as_one(
    serve: Callable[..., Awaitable[Server]], pools: list[Pool]
) -> None:
    pieces = [b"data: %d\n\n" % i for i in range(33)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)

    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await asyncio.sleep(0.2)  # the head is read first; then the 33 pieces arrive in one write
            await peer.send(framed)
            await asyncio.sleep(0.2)
            await peer.send(b"8\r\nlast one\r\n0\r\n\r\n")

    server = await serve(handler)
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(read_s=5.0))
    stream = await up.open_stream("/", b"{}", {})
    got = [chunk async for chunk in stream.chunks()]
    # what one read delivered is one chunk (nothing waited for the later piece); order and bytes kept
    assert b"".join(got) == b"".join(pieces) + b"last one"
    assert got[-1] == b"last one" and len(got) < len(pieces)


# ---- keep-alive -------------------------------------------------------------------------------------
async def test_server_closing_an_idle_connection_is_noticed(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    closed = asyncio.Event()

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(OK)  # keep-alive, then the server's idle timeout: it closes
        peer.writer.close()
        await peer.writer.wait_closed()
        closed.set()

    server = await serve(handler)
    pool = new_pool(pools, server.port)
    assert await (await pool.request("POST", "/", {}, b"1")).read() == b"hello"
    await closed.wait()
    assert await (await pool.request("POST", "/", {}, b"2")).read() == b"hello"
    assert [body for _, body in server.requests] == [b"1", b"2"] and pool.opened == 2


async def test_stale_connection_is_replaced_before_the_write(pools: list[Pool]) -> None:
    # The server closes the idle connection while the client's loop is blocked, so the FIN waits
    # unread in the socket: the check right before the write must still see it.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received: list[bytes] = []
    close_first = threading.Event()
    first_closed = threading.Event()

    def serve_one(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        received.append(data)
        conn.sendall(OK)
        return data

    def run() -> None:
        with listener:
            first, _ = listener.accept()
            serve_one(first)
            close_first.wait(10)
            first.close()
            first_closed.set()
            second, _ = listener.accept()
            with second:
                serve_one(second)
                second.recv(1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    pool = new_pool(pools, port)
    assert await (await pool.request("GET", "/1", {})).read() == b"hello"
    close_first.set()
    first_closed.wait(10)
    time.sleep(0.05)  # noqa: ASYNC251  (blocking on purpose: the loop must not read the FIN)
    assert await (await pool.request("GET", "/2", {})).read() == b"hello"
    assert pool.stale_dropped == 1 and pool.opened == 2
    assert [r.split(b" ")[1] for r in received] == [b"/1", b"/2"]  # each request reached the server once
    await pool.close()
    await asyncio.to_thread(thread.join, 10)  # the loop must run to close the client's socket


async def test_reuse_works_for_sockets_past_fd_setsize(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    # A busy gateway holds more than 1024 descriptors; the staleness check must not treat every
    # connection with a high fd number as dead (select() cannot watch those).
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        pytest.skip(f"only {soft} file descriptors allowed")
    server = await serve(keep_alive_ok)
    spare = [os.dup(0) for _ in range(1100)]
    try:
        pool = new_pool(pools, server.port)
        for _ in range(3):
            assert await _get(pool, "/") == b"hello"
        assert pool.opened == 1 and pool.stale_dropped == 0
    finally:
        for fd in spare:
            os.close(fd)


# ---- slots --------------------------------------------------------------------------------------------
async def streaming_forever(peer: Peer) -> None:
    while await peer.request() is not None:
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        if b"/short" in peer.server.requests[-1][0]:
            await peer.send(b"0\r\n\r\n")
        else:
            await peer.until_client_leaves()
            return


async def test_dropped_responses_give_their_slot_back(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    server = await serve(streaming_forever)
    pool = new_pool(pools, server.port, limit=1, pool_timeout_s=5.0)

    response = await pool.request("POST", "/", {}, b"{}")
    del response  # dropped unread
    gc.collect()
    assert pool.in_use == 0

    response = await pool.request("POST", "/", {}, b"{}")
    chunks = response.chunks()
    assert await chunks.__anext__() == b"first"
    del chunks, response  # a stream abandoned mid-way
    for _ in range(5):
        await asyncio.sleep(0)
    gc.collect()
    await asyncio.sleep(0)
    assert pool.in_use == 0

    response = await pool.request("POST", "/", {}, b"{}")
    response.close()  # closed without reading
    response = await pool.request("POST", "/short", {}, b"{}")
    assert await response.read() == b"first"
    assert pool.in_use == 0 and pool.idle == 1
    assert len(server.requests) == 4


async def test_waiting_for_a_slot_times_out_clearly(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    server = await serve(streaming_forever)
    pool = new_pool(pools, server.port, limit=1, pool_timeout_s=0.2)
    held = await pool.request("POST", "/", {}, b"{}")
    with pytest.raises(PoolTimeout, match="busy") as info:
        await pool.request("POST", "/", {}, b"{}")
    assert info.value.sent is False
    held.close()

    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(pool_s=0.2), max_connections=1)
    stream = await up.open_stream("/", b"{}", {})
    with pytest.raises(UpstreamPoolExhausted) as err:
        await up.post("/", b"{}", {})
    assert err.value.status == 503 and err.value.code == "upstream_pool_exhausted"
    assert err.value.maybe_processed is False and isinstance(err.value, UpstreamError)
    stream.close()
    assert len(server.requests) == 2  # the refused ones never reached the server


async def test_a_freed_slot_goes_to_the_waiter(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    server = await serve(keep_alive_ok)
    pool = new_pool(pools, server.port, limit=1)
    bodies = await asyncio.gather(*(_get(pool, f"/{i}") for i in range(9)))
    assert bodies == [b"hello"] * 9 and pool.opened == 1


async def _get(pool: Pool, path: str) -> bytes:
    return await (await pool.request("GET", path, {})).read()


async def test_cancelled_requests_free_their_slot(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    arrived = asyncio.Event()

    async def handler(peer: Peer) -> None:
        await peer.request()
        arrived.set()
        await peer.until_client_leaves()

    server = await serve(handler)
    pool = new_pool(pools, server.port, limit=1)
    first = asyncio.create_task(_get(pool, "/a"))
    waiting = asyncio.create_task(_get(pool, "/b"))
    await arrived.wait()
    waiting.cancel()
    first.cancel()
    await asyncio.gather(first, waiting, return_exceptions=True)
    assert pool.in_use == 0 and len(server.requests) == 1


async def test_probes_have_their_own_pool(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        while (req := await peer.request()) is not None:
            if b"/health" in req[0]:
                await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            else:
                await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
                await peer.until_client_leaves()
                return

    server = await serve(handler)
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(pool_s=0.2), max_connections=2)
    streams = [await up.open_stream("/v1/completions", b"{}", {}) for _ in range(2)]  # every main connection
    for _ in range(3):
        assert (await up.get("/health", timeout_s=2.0, probe=True)).status == 200
    with pytest.raises(UpstreamPoolExhausted):
        await up.get("/health", timeout_s=2.0)
    assert up.probe_pool.opened == 1 and up.pool.in_use == 2
    for stream in streams:
        stream.close()


# ---- addresses and TLS ---------------------------------------------------------------------------
async def test_ipv6_literal(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    async def handler(peer: Peer) -> None:
        while (req := await peer.request()) is not None:
            host = next(line for line in req[0].split(b"\r\n") if line.lower().startswith(b"host:"))
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(host), host))

    try:
        server = await serve(handler, host="::1")
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    up = await new_upstream(pools, f"http://[::1]:{server.port}/")
    assert (await up.get("/health")).body == b"Host: [::1]:%d" % server.port


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1: made by the openssl CLI, else by `cryptography`."""
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = shutil.which("openssl")
    if openssl is not None:
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key_file),
                "-out",
                str(cert_file),
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )
        return cert_file, key_file
    x509 = pytest.importorskip("cryptography.x509", reason="neither the openssl CLI nor cryptography is here")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


async def test_https_worker(serve: Callable[..., Awaitable[Server]], pools: list[Pool], tmp_path: Path) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert_file, key_file)
    server = await serve(keep_alive_ok, tls=server_tls)
    trusting = ssl.create_default_context(cafile=str(cert_file))
    for host in ("127.0.0.1", "localhost"):
        up = await new_upstream(pools, f"https://{host}:{server.port}", tls=trusting)
        for _ in range(3):
            assert (await up.post("/v1/completions", b"{}", {})).body == b"hello"
        assert up.pool.opened == 1
    # the system's trust store does not know this certificate: a clean error, nothing sent
    up = await new_upstream(pools, f"https://127.0.0.1:{server.port}")
    with pytest.raises(UpstreamError, match="certificate") as err:
        await up.post("/v1/completions", b"{}", {})
    assert err.value.maybe_processed is False
    assert len(server.requests) == 6


def test_instance_urls_are_checked_in_settings() -> None:
    from conductor.config.settings import load_settings
    from conductor.core.errors import ConfigError

    ok = load_settings(overrides={"mixed": ["https://w.example:8443/", "http://[::1]:8100"]})
    assert [s.url for s in ok.mixed] == ["https://w.example:8443", "http://[::1]:8100"]
    for bad in ["ftp://w:1", "http://", "http://w:99999", "http://w:port", "http://user:pw@w:1", "http://w:1/?q=1"]:
        with pytest.raises(ConfigError, match="instance URL"):
            load_settings(overrides={"mixed": [bad]})


async def test_back_to_back_exchanges_share_one_read_timer(serve: Callable[..., Awaitable[Server]], pools: list[Pool]) -> None:
    """A pooled connection's read timeout is one timer for its life (adapters/lazy_timer.py): each
    exchange moves its deadline on, none schedules a timer of its own (a timer per exchange would
    be a heap entry each, and one left armed per exchange kept re-arming while the connection
    stayed busy)."""
    server = await serve(keep_alive_ok)
    pool = new_pool(pools, server.port, read_timeout_s=30.0)
    loop = asyncio.get_running_loop()
    scheduled: list[object] = []
    real_call_at = loop.call_at

    def counting_call_at(when: float, callback: Callable[..., object], *args: object) -> asyncio.TimerHandle:
        scheduled.append(callback)
        return real_call_at(when, callback, *args)

    loop.call_at = counting_call_at  # type: ignore[method-assign]
    try:
        for _ in range(20):
            response = await pool.request("GET", "/", {})
            assert await response.read() == b"hello"
    finally:
        loop.call_at = real_call_at  # type: ignore[method-assign]
    assert pool.opened == 1 and len(server.requests) == 20
    read_timers = [cb for cb in scheduled if getattr(cb, "__qualname__", "") == "LazyTimer._fire"]
    assert len(read_timers) == 1
