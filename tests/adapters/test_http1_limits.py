"""What a faulty worker can make the upstream client hold (issue 34): a response head past its bytes
or header lines, a non-streamed body past its bytes. Real sockets; the servers write the exact bytes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from adapters.http1 import Pool, ResponseLimits, ResponseTooLarge
from adapters.upstream import Timeouts
from conductor.core.errors import UpstreamError
from conductor.server.errors import render
from tests.adapters.test_http1 import OK, Peer, Server, keep_alive_ok, new_pool, new_upstream, pools, serve

__all__ = ["pools", "serve"]  # fixtures shared with test_http1.py

LIMITS = ResponseLimits(head_bytes=16 * 1024, headers=100, body_bytes=1024 * 1024)
Serve = Callable[..., Awaitable[Server]]


def answering(*responses: bytes) -> Callable[[Peer], Awaitable[None]]:
    """A server that answers its connection's requests with `responses`, in order, then waits."""

    async def handler(peer: Peer) -> None:
        for response in responses:
            if await peer.request() is None:
                return
            await peer.send(response)
        await peer.until_client_leaves()

    return handler


async def refused_and_dropped(pool: Pool, server: Server) -> ResponseTooLarge:
    """The request fails with ResponseTooLarge, and the next request needs a new connection."""
    with pytest.raises(ResponseTooLarge) as caught:
        response = await pool.request("GET", "/", {})
        await response.read()
    assert pool.in_use == 0
    response = await pool.request("GET", "/", {})
    assert await response.read() == b"hello"
    assert pool.opened == 2 and server.connections == 2
    return caught.value


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n" + b"X-Filler: 1\r\n" * 100_000 + b"Content-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 10_000_000 + b"\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 100 Continue\r\n\r\n" * 5000 + OK,  # a flood of interim heads counts too
        # over the byte limit, yet small enough to arrive in one read with the head's end
        b"HTTP/1.1 200 OK\r\nX-Wide: " + b"w" * 9000 + b"\r\nX-Wider: " + b"w" * 9000 + b"\r\n" + OK.split(b"\r\n", 1)[1],
    ],
    ids=["100k-header-lines", "10MB-header-line", "interim-flood", "one-read-over-bytes"],
)
async def test_an_oversize_response_head_fails_the_exchange(serve: Serve, pools: list[Pool], head: bytes) -> None:
    server = await serve(lambda peer: first_then_ok(peer, head))
    pool = new_pool(pools, server.port, limits=LIMITS)
    error = await refused_and_dropped(pool, server)
    assert "head" in str(error) and error.sent


async def first_then_ok(peer: Peer, first: bytes) -> None:
    """The connection's first answer is `first`; a new connection answers OK."""
    if peer.server.connections == 1:
        if await peer.request() is not None:
            await peer.send(first)
        await peer.until_client_leaves()
    else:
        await keep_alive_ok(peer)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 65536,  # refused by its length
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"10000\r\n" + b"y" * 65536 + b"\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"z" * 65536,  # until EOF
    ],
    ids=["sized", "chunked", "close-delimited"],
)
async def test_an_oversize_body_read_whole_fails_and_drops_the_connection(serve: Serve, pools: list[Pool], answer: bytes) -> None:
    async def handler(peer: Peer) -> None:
        if peer.server.connections > 1:
            return await keep_alive_ok(peer)
        if await peer.request() is None:
            return
        await peer.send(answer)
        for _ in range(2000):  # ~130 MB more if the client kept reading; it stops past 1 MiB
            await peer.send(answer[-65536:] if b"chunked" not in answer else b"10000\r\n" + b"y" * 65536 + b"\r\n")

    server = await serve(handler)
    pool = new_pool(pools, server.port, limits=LIMITS)
    error = await refused_and_dropped(pool, server)
    assert "body" in str(error)


async def test_a_stream_is_relayed_past_the_whole_body_limit(serve: Serve, pools: list[Pool]) -> None:
    piece = b"data: " + b"t" * 65530 + b"\n\n"  # 64 KiB events, 3 MiB in all: three times the limit
    framed = b"%x\r\n%s\r\n" % (len(piece), piece)
    server = await serve(answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed * 48 + b"0\r\n\r\n"))
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(read_s=5.0), limits=LIMITS)
    stream = await up.open_stream("/", b"{}", {})
    got = [chunk async for chunk in stream.chunks()]
    assert b"".join(got) == piece * 48
    assert max(len(chunk) for chunk in got) <= 2 * 1024 * 1024  # what is buffered ahead of the reader is bounded


async def test_the_worker_error_is_a_502_with_an_openai_body(serve: Serve, pools: list[Pool]) -> None:
    huge = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n{"
    server = await serve(answering(huge))
    up = await new_upstream(pools, f"http://127.0.0.1:{server.port}", Timeouts(read_s=5.0), limits=LIMITS)
    with pytest.raises(UpstreamError) as caught:
        await up.post("/v1/completions", b"{}", {})
    status, body, _ = render(caught.value)
    error = json.loads(body)["error"]
    assert status == 502 and error["type"] == "upstream_error" and "over" in error["message"]
    await asyncio.sleep(0)
    assert up.pool.in_use == 0 and up.pool.idle == 0  # the connection was dropped, not pooled
