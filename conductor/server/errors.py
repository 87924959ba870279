"""The one place errors become HTTP responses, in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}` with the status the error class names.
A worker's own 4xx body is relayed as it was (it already has that shape: vLLM writes it)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from conductor.core.errors import BadRequest, ConductorError, Overloaded, Rejected, ShuttingDown, UpstreamError
from conductor.routing.attempt import for_client
from conductor.routing.streams import ClientState, Send

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_payload(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def render(exc: BaseException) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) for any exception; unknown ones are logged and become a 500 body
    without internals."""
    if isinstance(exc, UpstreamError) and exc.client_fault and exc.upstream_status is not None:
        body = exc.body or error_payload(exc.message, "invalid_request_error", code=exc.upstream_status)
        if not _is_openai_error(body):
            body = error_payload(body.decode("utf-8", "replace")[:2000], "invalid_request_error")
        return exc.upstream_status, body, {}
    if isinstance(exc, ConductorError):
        return exc.status, error_payload(exc.message, exc.type, exc.param, exc.code), _headers(exc)
    log.error("unexpected error", exc_info=exc)
    return 500, error_payload("internal error in the gateway", "internal_error"), {}


def _headers(exc: ConductorError) -> dict[str, str]:
    """The error's own headers, plus the hint the OpenAI SDKs obey before their status rules:
    a 429 that retrying cannot cure says so (they would retry it twice, slower each time), and an
    overloaded or shutting-down gateway says a retry is welcome."""
    headers = exc.headers()
    if isinstance(exc, Rejected) and not exc.retryable:
        headers = {**headers, "x-should-retry": "false"}
    elif isinstance(exc, (Overloaded, ShuttingDown)):
        headers = {**headers, "x-should-retry": "true"}
    return headers


def _is_openai_error(body: bytes) -> bool:
    try:
        data: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)


def sse_error(exc: BaseException) -> bytes:
    """An error that happens after a stream started: one SSE event, then the end marker."""
    _, body, _ = render(exc)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


def response_for(exc: BaseException) -> Response:
    status, body, headers = render(exc)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def conductor_error_handler(request: Request, exc: Exception) -> Response:
    return response_for(exc)


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    return response_for(BadRequest(str(exc)))


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    body = error_payload(str(exc.detail), _STATUS_TYPES.get(status, "error"), code=status)
    return Response(body, status_code=status, headers=exc.headers, media_type="application/json")


def install(app: Any) -> None:
    app.add_exception_handler(ConductorError, conductor_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, conductor_error_handler)


async def send_failure(exc: BaseException, send: Send, state: ClientState, request_id: str, client_id: str) -> int:
    """Tell the client a request failed, as far as its answer allows: an error response when nothing
    was sent yet, an SSE error event once a stream has begun, nothing after a complete answer.
    The HTTP status the failure stands for."""
    if isinstance(exc, UpstreamError) and exc.instance is not None and not exc.client_fault:
        # a worker failed: the whole story for the log (what the transport said, the worker's
        # address); the client gets the instance's name and the kind of failure only
        log.warning("request %s failed: %s", request_id, exc.message)
        exc = for_client(exc)
    status, payload, extra = render(exc)
    if state.response_done:  # the client has its whole answer: nothing may follow it
        log.warning("request %s failed after its answer was complete: %s", client_id, exc)
        return status
    if state.response_started:  # too late for a status: tell the stream
        state.response_done = True
        await send({"type": "http.response.body", "body": sse_error(exc), "more_body": False})
        return status
    headers = [(b"content-type", b"application/json"), (b"x-request-id", client_id.encode())]
    headers.extend((k.lower().encode(), v.encode()) for k, v in extra.items())
    state.response_started = state.response_done = True
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
    return status
