"""What a client can make the gateway's HTTP/1.1 server (adapters/http1_server.py) hold, and how
it says no.

Every request the server refuses gets a status line and an OpenAI-style error body
(adapters/http1_exchange.py, `error_response`) before the connection closes:
* a malformed head or body (a bad chunk size, two Content-Lengths...): 400; a target or header
  block too long: 414, 431;
* a head not complete within uvicorn's timeout_keep_alive of the connection going idle, a body
  silent that long, or not complete within `body_timeout_s` of its head: 408;
* one pipelined request past `max_pipelined`: 503, once the requests before it are answered. The
  parser cannot stop in the middle of a read and go on later, so the rest of the pipeline is left
  unread; an HTTP/1.1 client sends again what a "connection: close" left unanswered;
* a connection past `max_connections`: 503 at once.

The close after a refusal "lingers", as nginx's does: our side is shut for writing, and what the
client still sends is read and dropped for LINGER_S, because a close with unread bytes resets the
connection, and the reset can destroy the answer in the client's buffers before it is read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """max_connections: open client connections per server (the public and the admin one count
    apart). body_timeout_s: from a request's head to the end of its body. max_pipelined: requests
    parsed ahead of the one being answered (one socket read can hold thousands of tiny ones, each
    an exchange in memory)."""

    max_connections: int = 10_000
    body_timeout_s: float = 60.0
    max_pipelined: int = 32


def linger(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> asyncio.TimerHandle | None:
    """Close `transport` once its answer is out: shut for writing now (the buffered answer goes
    first), reading on (the caller drops what comes), closed for good after LINGER_S; the timer,
    None when closed at once (already closing, or TLS: no half-close there)."""
    if transport.is_closing():
        return None
    if not transport.can_write_eof():
        transport.close()
        return None
    transport.write_eof()
    transport.resume_reading()
    return loop.call_later(LINGER_S, transport.close)
