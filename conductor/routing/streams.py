"""What the client has been sent, and what a relayed SSE stream told: shared by every attempt
(conductor/routing/relay.py, batch_relay.py) and the endpoint that owns the request."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from adapters.pd.base import Outgoing

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

_MAX_INTERVALS = 256  # token intervals kept per stream for the TBT fit
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_DONE = b"data: [DONE]"
_USAGE_ONLY = b'"choices":[]'  # vLLM's final usage chunk (stream_options.include_usage)


class ClientState:
    """What the client has been sent; the disconnect watcher reads it."""

    __slots__ = ("decode", "disconnected", "prefill", "response_done", "response_started", "watching")

    def __init__(self) -> None:
        self.prefill: str | None = None  # where the (last) attempt went: for the access log
        self.decode: str | None = None
        self.disconnected = False
        self.response_started = False
        # the client has the whole answer ([DONE] or the full body): a disconnect now is a normal end
        self.response_done = False
        self.watching = False  # a client that leaves now cancels the request (endpoint.py)


@dataclass(slots=True)
class StreamStats:
    """What a relayed SSE stream told: token events, their spacing, the usage chunk."""

    first_token: float | None = None
    last: float = 0.0
    tokens: int = 0
    intervals: list[float] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    done: bool = False

    def see(self, chunk: bytes, now: float) -> int:
        """Account one upstream chunk; returns the token events in it. Most chunks are one token
        event: one count() and two `in` tests, the rest only for the final chunks."""
        n = chunk.count(b"data:")
        if not n:
            return 0
        if b"[DONE]" in chunk:
            self.done = True
            n -= chunk.count(_DONE)
        if b'"usage"' in chunk:  # usage-only final chunk, or continuous usage stats on every chunk
            n -= chunk.count(_USAGE_ONLY)
            completion = _COMPLETION_RE.findall(chunk)
            cached = _CACHED_RE.findall(chunk)
            if completion:
                self.usage_completion_tokens = int(completion[-1])
            if cached:
                self.usage_cached_tokens = int(cached[-1])
            prompt = _PROMPT_RE.findall(chunk)
            if prompt:
                self.usage_prompt_tokens = int(prompt[-1])
        if n > 0:
            if self.first_token is not None and len(self.intervals) < _MAX_INTERVALS:
                self.intervals.append((now - self.last) / n)
            self.last = now
            self.tokens += n
            return n
        return 0


def with_cached_tokens(data: bytes, cached: int) -> bytes:
    """An answer or SSE chunk with every `"cached_tokens": N` it carries set to `cached`. Only a
    key matches: the same words inside generated text are JSON-escaped (`\\"cached_tokens\\"`)."""
    return _CACHED_RE.sub(b'"cached_tokens":%d' % cached, data)


def id_headers(out: Outgoing) -> list[tuple[bytes, bytes]]:
    return [(b"x-request-id", out.client_request_id.encode())]


async def send_whole(send: Send, client: ClientState, out: Outgoing, status: int, content_type: str, body: bytes) -> None:
    """A non-streamed answer, all at once: the client has it whole."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode()), *id_headers(out)],
        }
    )
    client.response_started = client.response_done = True
    await send({"type": "http.response.body", "body": body})


async def start_stream(send: Send, client: ClientState, out: Outgoing, status: int, content_type: str) -> None:
    """The head of a streamed answer; its chunks follow as they arrive."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache"), *id_headers(out)],
        }
    )
    client.response_started = True


async def end_stream(send: Send, client: ClientState) -> None:
    """The end of a streamed answer: the client has all of it."""
    client.response_done = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})
