"""The FastAPI applications: the public one (the OpenAI routes, plain ASGI endpoints from
conductor/server/endpoint.py, plus /v1/models, /health, /ready) and the operational routes: /metrics,
/openapi.json and /docs, on the public port or, with `admin_port` set, only on a second server
bound to that port. Both servers run in one event loop and share the gateway."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Route

from conductor.fleet.membership import admin_routes
from conductor.gateway import SLO_TBT_HEADER, SLO_TTFT_HEADER, Gateway
from conductor.server import errors as http_errors
from conductor.server.endpoint import CompletionsEndpoint
from conductor.server.requests import ChatCompletionRequest, CompletionRequest

OPENAI_ROUTES = (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"))
# forwarded as they are to mixed workers (400 in P/D): vLLM serves both, no KV routing for them
PASS_THROUGH_ROUTES = (("/v1/embeddings", "embeddings"), ("/v1/responses", "responses"))


class FastPath:
    """POSTs to the OpenAI routes go straight to their endpoints; everything else (and the
    lifespan) to the FastAPI app. The middleware stack costs ~30 us a request and the hot path
    needs none of it: it renders its own errors."""

    def __init__(self, app: FastAPI, routes: dict[str, CompletionsEndpoint]) -> None:
        self.app = app
        self.routes = routes
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
_ERRORS = {
    400: (
        "The body is malformed: not JSON, nested too deeply, a field of the wrong type, an empty "
        "prompt, a token id outside the vocabulary, or an SLO header that is not a number",
        None,
    ),
    401: ("No API key or an unknown one (only when the gateway is configured with keys)", None),
    404: ("The model is not served", None),
    413: ("The body exceeds max_body_bytes", None),
    429: ("Admission control: the request is predicted to miss its SLO (code: the reason)", _RETRY_HEADERS),
    502: ("A worker failed or answered an error of its own", None),
    503: ("No healthy instance, or the gateway holds max_inflight_requests already", _RETRY_HEADERS),
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


def openapi_document(app: FastAPI, gateway: Gateway) -> dict[str, Any]:
    """FastAPI's document of its own routes, plus the two plain ASGI POST routes it cannot see,
    their bodies described by the very models `conductor.server.requests.parse_request` enforces."""
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
    secured = bool(gateway.api_keys)
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


def _install_openapi(app: FastAPI, build: Callable[[], dict[str, Any]]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built on first use, then kept, as FastAPI's own is
            app.openapi_schema = build()
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- the routes --------------------------------------------------------------------------------


def _health_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.get("/ready", responses={503: {"description": "not enough healthy instances"}})
    async def ready() -> JSONResponse:
        ok, counts = gateway.ready()
        return JSONResponse({"ready": ok, "healthy": counts}, status_code=200 if ok else 503)

    return router


def _metrics_route(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        m = gateway.metrics
        for state in gateway.registry.states.values():
            m.instance_healthy.labels(state.name, state.spec.role.value).set(1 if state.healthy else 0)
            m.queued_prefill_tokens.labels(state.name).set(sum(p.new_tokens for p in state.prefills.values()))
            m.running_decodes.labels(state.name).set(len(state.decodes))
        error_stats = getattr(gateway.policy, "error_stats", None)  # policies with fitted predictors
        if callable(error_stats):
            for st in error_stats():
                m.prediction_mape.labels(st.component, st.instance).set(st.mape)
                m.prediction_coverage.labels(st.component, st.instance).set(st.p90_coverage)
                m.prediction_samples.labels(st.component, st.instance).set(st.samples)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def create_app(gateway: Gateway) -> FastPath:
    """The public app serving `gateway`; its lifespan starts and stops the gateway's parts. With
    `admin_port` set it has no /metrics, /openapi.json or /docs: see `create_admin_app`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    public_docs = gateway.settings.admin_port is None
    app = FastAPI(
        title="Conductor",
        version="0.1.0",
        lifespan=lifespan,
        redoc_url=None,
        openapi_url="/openapi.json" if public_docs else None,
        docs_url="/docs" if public_docs else None,
    )
    app.state.gateway = gateway
    http_errors.install(app)
    hot: dict[str, CompletionsEndpoint] = {}
    for path, kind in OPENAI_ROUTES + PASS_THROUGH_ROUTES:
        hot[path] = CompletionsEndpoint(gateway, kind, path)  # type: ignore[arg-type]
        # also routed in FastAPI, so other methods on these paths get a 405
        app.router.routes.append(Route(path, endpoint=hot[path], methods=["POST"]))

    @app.get("/v1/models", responses={401: {"description": "no API key or an unknown one"}})
    async def models(request: Request) -> JSONResponse:
        gateway.authorize(request.headers.get("authorization"))
        created = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": created, "owned_by": "conductor"} for m in gateway.known_models()
                ],
            }
        )

    app.include_router(_health_routes(gateway))
    if public_docs:
        app.include_router(_metrics_route(gateway))
        app.include_router(admin_routes(gateway.membership))  # no admin port: the admin API is here
    _install_openapi(app, lambda: openapi_document(app, gateway))
    return FastPath(app, hot)


def create_admin_app(gateway: Gateway, public: FastPath) -> FastAPI:
    """The admin port's app: /metrics, /health, /ready, and /openapi.json and /docs describing
    the public port's API. It has no lifespan: the public app starts and stops the gateway."""
    app = FastAPI(title="Conductor", version="0.1.0", redoc_url=None)
    http_errors.install(app)
    app.include_router(_health_routes(gateway))
    app.include_router(_metrics_route(gateway))
    app.include_router(admin_routes(gateway.membership))
    _install_openapi(app, lambda: openapi_document(public.app, gateway))
    return app


# ---- serving -----------------------------------------------------------------------------------


async def serve_all(servers: list[uvicorn.Server], sockets: list[socket.socket] | None = None) -> None:
    """Serve until every server has stopped; when one stops (a signal, a failed start) the
    others are told to stop too. uvicorn chains its signal handlers, last started first: so
    the first server in `servers` is the last to hear SIGTERM."""
    # `sockets`: already bound listening sockets for the last (public) server, e.g. SO_REUSEPORT ones
    tasks = [asyncio.create_task(server.serve(sockets if server is servers[-1] else None)) for server in servers]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks)


def admin_server(config: uvicorn.Config, gateway: Gateway) -> uvicorn.Server | None:
    """The admin port's server, configured like the public one, or None without `admin_port`."""
    port = gateway.settings.admin_port
    if port is None:
        return None
    public = config.app if isinstance(config.app, FastPath) else create_app(gateway)
    return uvicorn.Server(
        uvicorn.Config(
            create_admin_app(gateway, public),
            host=config.host,
            port=port,
            log_level=config.log_level,
            access_log=False,
            loop=config.loop,
            http=config.http,
            lifespan="off",
        )
    )


def run(config: uvicorn.Config, gateway: Gateway, sockets: list[socket.socket] | None = None) -> None:
    """Run the public server `config` describes and, with `admin_port` set, the admin server beside
    it in the same event loop. The admin server starts first, so on SIGTERM the public one stops
    (and drains) first while /metrics and /ready still answer."""
    servers = [uvicorn.Server(config)]
    admin = admin_server(config, gateway)
    if admin is not None:
        servers.insert(0, admin)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve_all(servers, sockets))
