"""Minimal ASGI plumbing for the emulator's hot path (no framework per request or per chunk)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_encode = msgspec.json.Encoder().encode
JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"


class BodyTooLarge(Exception):
    """The request body exceeds the configured limit."""


def encode_json(obj: Any) -> bytes:
    return _encode(obj)


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes = JSON, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, _encode(obj), JSON, headers)


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when the client disconnected; BodyTooLarge past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: Scope, name: bytes) -> str | None:
    """A request header by lower-case name (ASGI servers lower-case them)."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None
