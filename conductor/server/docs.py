"""What the gateway's API looks like, served to those who may read it: the OpenAPI document
(`openapi_document`: FastAPI's routes plus the plain ASGI POST routes it cannot see) and /docs, a
page that lists the document's routes.

/docs is self-contained: its script and style are inline and the document rides in the page, so it
loads nothing from anywhere (no CDN, which the Swagger UI page FastAPI ships would load its
assets from, on every view, from a browser that may hold an operator's session); its
Content-Security-Policy forbids every other source, so a description that smuggles markup in
cannot fetch or run anything either (and the page writes text, never HTML, from the document).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from conductor.routing.router import SLO_TBT_HEADER, SLO_TTFT_HEADER
from conductor.server.requests import ChatCompletionRequest, CompletionRequest

OPENAI_ROUTES = (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"))
# forwarded as they are to mixed workers (400 in P/D): vLLM serves both, no KV routing for them
PASS_THROUGH_ROUTES = (("/v1/embeddings", "embeddings"), ("/v1/responses", "responses"))

# ---- the OpenAPI document ----------------------------------------------------------------------

_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_RETRY_HEADERS = {
    "Retry-After": {"description": "seconds to wait before trying again", "schema": {"type": "integer"}},
    "x-should-retry": {
        "description": "whether a retry can succeed (the OpenAI SDKs obey it)",
        "schema": {"type": "string", "enum": ["true", "false"]},
    },
}
_REJECT_HEADERS = {
    **_RETRY_HEADERS,
    "x-conductor-reject-reason": {
        "description": "why: ttft_slo, tbt_slo, capacity, priority_shed or tenant_share (the body's code)",
        "schema": {"type": "string"},
    },
}
_ERRORS = {
    400: (
        "The body is malformed: not JSON, nested too deeply, a field of the wrong type, an empty "
        "prompt, a token id outside the vocabulary, an SLO header that is not a number, or an "
        "unknown priority class (code invalid_priority); or the prompt is longer than the model's "
        "context (code context_length_exceeded)",
        None,
    ),
    401: ("No API key or an unknown one (only when the gateway is configured with keys)", None),
    404: ("The model is not served", None),
    413: ("The body exceeds limits.max_body_bytes", None),
    429: (
        "Admission control: the request is predicted to miss its SLO, its priority class is shed or its "
        "tenant is over its fair share (code and x-conductor-reject-reason: the reason)",
        _REJECT_HEADERS,
    ),
    502: ("A worker failed or answered an error of its own", None),
    503: ("No healthy instance, or the gateway holds limits.max_inflight_requests already", _RETRY_HEADERS),
    504: ("A worker did not answer in time", None),
}
_COMPLETION_SCHEMA = {
    "type": "object",
    "description": "an OpenAI completion object, as the worker wrote it",
    "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "choices": {"type": "array"}},
}


def _slo_header(name: str, what: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": f"this request's {what} SLO in milliseconds, over the configured one",
        "schema": {"type": "number", "exclusiveMinimum": 0},
    }


def _operation(kind: str, schema_ref: str, secured: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "the worker's answer, relayed as it arrives",
            "content": {"application/json": {"schema": _COMPLETION_SCHEMA}, "text/event-stream": {"schema": {"type": "string"}}},
        }
    }
    for status, (description, headers) in _ERRORS.items():
        if status == 401 and not secured:
            continue
        response: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        if headers:
            response["headers"] = headers
        responses[str(status)] = response
    operation: dict[str, Any] = {
        "summary": f"Create a {'chat ' if kind == 'chat' else ''}completion",
        "description": "Validated, routed by the configured policy and forwarded to the workers. Fields "
        "not named in the schema are passed to the workers as they are.",
        "operationId": f"create_{'chat_' if kind == 'chat' else ''}completion",
        "parameters": [_slo_header(SLO_TTFT_HEADER, "time-to-first-token"), _slo_header(SLO_TBT_HEADER, "time-between-tokens")],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": schema_ref}}}},
        "responses": responses,
    }
    if secured:
        operation["security"] = [{"bearer": []}]
    return operation


def openapi_document(app: FastAPI, *, secured: bool) -> dict[str, Any]:
    """FastAPI's document of its own routes, plus the plain ASGI POST routes it cannot see, their
    bodies described by the very models `conductor.server.requests.parse_request` enforces;
    `secured`: client keys are configured (401 documented, a bearer security scheme)."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        routes=app.routes,
        description="OpenAI-compatible, KV-cache-aware gateway in front of vLLM workers",
    )
    refs, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")], ref_template="#/components/schemas/{model}"
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    bodies: dict[str, type[BaseModel]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
    for path, kind in OPENAI_ROUTES:
        ref = refs[(bodies[kind], "validation")]["$ref"]
        doc.setdefault("paths", {}).setdefault(path, {})["post"] = _operation(kind, ref, secured)
    schemas["PassThroughRequest"] = _PASS_THROUGH_SCHEMA
    for path, kind in PASS_THROUGH_ROUTES:
        op = _operation(kind, "#/components/schemas/PassThroughRequest", secured)
        op.update(
            summary=f"Create {'embeddings' if kind == 'embeddings' else 'a response'} (mixed workers)",
            operationId=f"create_{kind}",
            description="Forwarded as it is to a mixed worker chosen by the policy; 400 when the gateway "
            "routes to prefill/decode pairs. Fields other than model and input are the worker's.",
        )
        doc.setdefault("paths", {}).setdefault(path, {})["post"] = op
    return doc


_PASS_THROUGH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "input"],
    "additionalProperties": True,
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}]},
    },
}


def install_openapi(app: FastAPI, build: Callable[[], dict[str, Any]]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built on first use, then kept, as FastAPI's own is
            app.openapi_schema = build()
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- /openapi.json and /docs -------------------------------------------------------------------

_STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:70em;padding:0 1em;color:#222}
h1{font-size:1.5em}.op{border:1px solid #ccc;border-radius:6px;margin:.7em 0;padding:.5em .8em}
.m{display:inline-block;min-width:4.5em;font-weight:bold;text-transform:uppercase}
.p{font-family:monospace;font-size:1.05em}.d{color:#555;margin:.3em 0}
table{border-collapse:collapse;margin:.3em 0}td{padding:.1em .8em .1em 0;vertical-align:top}
pre{background:#f6f6f6;padding:.5em;overflow:auto;font-size:.85em}
"""
_SCRIPT = """
const doc = JSON.parse(document.getElementById("openapi").textContent);
const root = document.getElementById("routes");
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
document.getElementById("title").textContent = doc.info.title + " " + doc.info.version;
document.getElementById("about").textContent = doc.info.description || "";
for (const [path, ops] of Object.entries(doc.paths || {})) {
  for (const [method, op] of Object.entries(ops)) {
    const box = el("div", "op");
    const head = el("div");
    head.append(el("span", "m", method), el("span", "p", path));
    box.append(head, el("div", "", op.summary || ""), el("div", "d", op.description || ""));
    const body = op.requestBody && op.requestBody.content && op.requestBody.content["application/json"];
    if (body) box.append(el("div", "d", "body: " + (body.schema.$ref || "").split("/").pop()));
    const rows = el("table");
    for (const [status, answer] of Object.entries(op.responses || {})) {
      const row = el("tr");
      row.append(el("td", "p", status), el("td", "", answer.description || ""));
      rows.append(row);
    }
    box.append(rows);
    root.append(box);
  }
}
const schemas = el("details");
schemas.append(el("summary", "", "schemas"), el("pre", "", JSON.stringify(doc.components || {}, null, 2)));
root.append(schemas);
"""


def _source_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


# nothing but the inline script and style above; no fetch, no image, no frame, no form
_POLICY = f"default-src 'none'; script-src {_source_hash(_SCRIPT)}; style-src {_source_hash(_STYLE)}; base-uri 'none'"


def docs_page(doc: dict[str, Any]) -> str:
    """/docs: the routes of `doc`, rendered in the page by its inline script."""
    # the document rides in a <script> block, which "</script" or "<!--" in a description could end
    # or derail: every "<" goes as its JSON escape, which JSON.parse reads back as "<"
    data = json.dumps(doc, separators=(",", ":")).replace("<", "\\u003c")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Conductor API</title>'
        f'<style>{_STYLE}</style></head><body><h1 id="title"></h1><p id="about"></p><div id="routes"></div>'
        f'<script type="application/json" id="openapi">{data}</script><script>{_SCRIPT}</script></body></html>'
    )


Guard = Callable[[Request], object]  # raises when the request may not see the route; what it returns is ignored


def docs_routes(document: Callable[[], dict[str, Any]], guard: Guard | None = None) -> APIRouter:
    """GET /openapi.json and GET /docs, each checked by `guard` first (a 401 without the key it
    wants), neither of them in the document itself."""
    router = APIRouter()

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        if guard is not None:
            guard(request)
        return JSONResponse(document())

    @router.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        if guard is not None:
            guard(request)
        return HTMLResponse(docs_page(document()), headers={"Content-Security-Policy": _POLICY})

    return router
