"""Reading and checking an OpenAI request body before anything is routed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from conductor.analysis import RequestKind
from conductor.core.errors import BadRequest, ModelNotFound, PayloadTooLarge

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

_decode = msgspec.json.Decoder().decode


async def read_body(receive: Receive, content_length: int | None, limit: int) -> bytes:
    """The whole request body, refusing (413) as soon as it is known to exceed `limit`."""
    if content_length is not None and content_length > limit:
        raise PayloadTooLarge(f"request body of {content_length} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("client went away before the body was read")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def _positive_int(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise BadRequest(f"'{name}' must be a positive integer", param=name)


def parse_request(raw: bytes, kind: RequestKind) -> dict[str, Any]:
    """The JSON object of a completions or chat request, with the fields routing needs checked.
    Fields the gateway does not know are kept as they are, for the workers."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a 'role'", param="messages")
    else:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("'prompt' is required", param="prompt")
        if not isinstance(prompt, str | list):
            raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids", param="prompt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    _positive_int(body, "max_tokens")
    _positive_int(body, "max_completion_tokens")
    return body


def check_model(model: str, known: tuple[str, ...]) -> None:
    if known and model not in known:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


def max_tokens_of(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and value > 0 else default
