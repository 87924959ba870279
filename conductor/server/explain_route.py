"""`POST /admin/explain`: the decision the gateway would make for a request now, and why, without
sending it anywhere (conductor/routing/explain.py says what is shown and what stays untouched).

The body is an OpenAI completions or chat request, checked as the real endpoint checks it
(conductor/server/requests.py: the size limit, JSON, the fields' types, token ids, the model): a
body with `messages` is a chat request, any other a completions request, unless the query says
`?kind=chat` or `?kind=completions`. The per-request SLO headers (`x-slo-ttft-ms`,
`x-slo-tbt-ms`) count as on the real endpoint, and so does a priority class the request names
(the `priority.header` or a string `priority` in the body: its SLO; no tenant's default, the key being
an admin's). The route is on the admin surface, with the admin API key: the answer shows the fleet's
names, load and cache contents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from conductor.core.errors import BadRequest
from conductor.kv.analysis import RequestKind, vocab_size_of
from conductor.routing.explain import explain
from conductor.routing.request_path import RequestPath
from conductor.routing.router import SLO_TBT_HEADER, SLO_TTFT_HEADER
from conductor.server.requests import json_object, max_tokens_of, parse_request, read_body, resolve_model

EXPLAIN_PATH = "/admin/explain"
_KINDS: tuple[RequestKind, ...] = ("completions", "chat")


def request_kind(query: str | None, body: dict[str, Any]) -> RequestKind:
    """completions or chat: as the query says, else chat when the body has `messages`."""
    if query is None:
        return "chat" if "messages" in body else "completions"
    if query not in _KINDS:
        raise BadRequest(f"kind must be one of {', '.join(_KINDS)}, not {query[:32]!r}", param="kind")
    return cast(RequestKind, query)


def explain_routes(parts: RequestPath, authorize: Callable[[str | None], None]) -> APIRouter:
    """The explainer's route; `authorize`: the admin API's key check (401 / 403)."""
    router = APIRouter(tags=["admin"])

    @router.post(
        EXPLAIN_PATH,
        responses={
            400: {"description": "a malformed request body (as the OpenAI routes answer it)"},
            401: {"description": "no admin key or an unknown one"},
            403: {"description": "the admin API is disabled (no admin key configured)"},
            404: {"description": "an unknown model"},
            413: {"description": "a body over limits.max_body_bytes"},
        },
    )
    async def explain_request(request: Request) -> JSONResponse:
        authorize(request.headers.get("authorization"))
        length = request.headers.get("content-length")
        limit = parts.settings.limits.max_body_bytes
        raw = await read_body(request.receive, int(length) if length and length.isdigit() else None, limit)
        kind = request_kind(request.query_params.get("kind"), json_object(raw))
        body = parse_request(raw, kind, vocab_size=vocab_size_of(parts.analyzer))
        resolve_model(body, parts.known_models(), parts.settings.model_aliases)
        priority = parts.classes.classify(request.headers.get(parts.classes.header), body, None)
        ttft, tbt = request.headers.get(SLO_TTFT_HEADER), request.headers.get(SLO_TBT_HEADER)
        slo = parts.router.slo_for(body["model"], ttft, tbt, priority)
        max_tokens = max_tokens_of(body, parts.settings.default_max_tokens)
        explained = await explain(parts, kind, body, max_tokens, slo)
        return JSONResponse(explained.to_json())

    return router
