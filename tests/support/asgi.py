"""What the tests' small ASGI applications all do: answer the lifespan protocol and read a whole
request body."""

from __future__ import annotations

from typing import Any


async def lifespan(receive: Any, send: Any) -> None:
    """Answer startup and shutdown until the server shuts down."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def whole_body(receive: Any) -> bytes:
    """The request's body, every piece of it (a disconnect ends it early)."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body
