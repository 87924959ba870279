"""The FastAPI application: the OpenAI routes (plain ASGI endpoints from conductor/proxy.py) and
the operational ones: /v1/models, /health, /ready, /metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Route

from conductor import http_errors
from conductor.gateway import Gateway
from conductor.proxy import CompletionsEndpoint


def create_app(gateway: Gateway) -> FastAPI:
    """An app serving `gateway`; its lifespan starts and stops the gateway's parts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="Conductor", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    http_errors.install(app)
    for path, kind in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat")):
        app.router.routes.append(Route(path, endpoint=CompletionsEndpoint(gateway, kind, path), methods=["POST"]))  # type: ignore[arg-type]

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        gateway.authorize(request.headers.get("authorization"))
        created = int(time.time())
        return JSONResponse({
            "object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "conductor"}
                     for m in gateway.known_models()],
        })

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, counts = gateway.ready()
        return JSONResponse({"ready": ok, "healthy": counts}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        m = gateway.metrics
        for state in gateway.registry.states.values():
            m.instance_healthy.labels(state.name, state.spec.role.value).set(1 if state.healthy else 0)
            m.queued_prefill_tokens.labels(state.name).set(sum(p.new_tokens for p in state.prefills.values()))
            m.running_decodes.labels(state.name).set(len(state.decodes))
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app
