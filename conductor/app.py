"""The FastAPI application: the OpenAI routes (plain ASGI endpoints from conductor/proxy.py) and
the operational ones: /v1/models, /health, /ready, /metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Route

from conductor import http_errors
from conductor.gateway import Gateway
from conductor.proxy import CompletionsEndpoint


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


def create_app(gateway: Gateway) -> FastPath:
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
    hot: dict[str, CompletionsEndpoint] = {}
    for path, kind in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat")):
        hot[path] = CompletionsEndpoint(gateway, kind, path)  # type: ignore[arg-type]
        # also routed in FastAPI, so other methods on these paths get a 405
        app.router.routes.append(Route(path, endpoint=hot[path], methods=["POST"]))

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
        error_stats = getattr(gateway.policy, "error_stats", None)  # policies with fitted predictors
        if callable(error_stats):
            for st in error_stats():
                m.prediction_mape.labels(st.component, st.instance).set(st.mape)
                m.prediction_coverage.labels(st.component, st.instance).set(st.p90_coverage)
                m.prediction_samples.labels(st.component, st.instance).set(st.samples)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return FastPath(app, hot)
