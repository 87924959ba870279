"""The FastAPI applications: the public one (the OpenAI routes, plain ASGI endpoints from
conductor/server/endpoint.py, plus /v1/models, /health, /ready) and the operational routes: /metrics,
/openapi.json and /docs (conductor/server/docs.py), on the public port or, with `admin_port` set, only
on a second server bound to that port. Both servers run in one event loop and share the gateway.

On the public port the operational routes are closed like the API: with client keys configured
they take a key too (`operational_keys`), or a Prometheus without credentials could read the
fleet's names, health and load, and anyone the list of routes, from wherever the port is exposed
(an Ingress passes every path). The key they take is an admin key, since /metrics is the operator's
view of every tenant's traffic, not a client's; a client key only where no admin key is configured
(the one credential there is). `auth.public_metrics` leaves /metrics open for a scrape without
credentials. The admin port, a private port by design, stays as it is.
"""

from __future__ import annotations

import asyncio
import socket
import traceback
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Route

from conductor.config.keys import ApiKeys
from conductor.core.capabilities import ReportsPredictionErrors
from conductor.core.errors import ConfigError
from conductor.fleet.membership import admin_routes
from conductor.gateway import Gateway
from conductor.kv.canary_access import canary_detail
from conductor.server import errors as http_errors
from conductor.server.docs import OPENAI_ROUTES, PASS_THROUGH_ROUTES, Guard, docs_routes, install_openapi, openapi_document
from conductor.server.endpoint import CompletionsEndpoint
from conductor.server.explain_route import explain_routes
from conductor.server.status_route import status_routes


class FastPath:
    """POSTs to the OpenAI routes go straight to their endpoints; everything else to the FastAPI
    app. The middleware stack costs ~30 us a request and the hot path needs none of it: it renders
    its own errors. The lifespan is answered here: it starts and stops the gateway's parts."""

    def __init__(self, app: FastAPI, routes: dict[str, CompletionsEndpoint], gateway: Gateway) -> None:
        self.app = app
        self.routes = routes
        self.state = app.state
        self.gateway = gateway
        self.startup_error: ConfigError | None = None  # why the gateway could not start, when it could not
        self.quiet_startup_errors = False  # set by `run`, which raises startup_error for the CLI to print

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self.app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        """The ASGI lifespan protocol. A ConfigError while starting (a KV events port another process
        holds, say) fails the start with its own one-line message, not a traceback: it is the
        operator's setting, not a bug; anything else fails it with the traceback."""
        await receive()  # lifespan.startup
        try:
            await self.gateway.start()
        except ConfigError as exc:
            self.startup_error = exc
            await send({"type": "lifespan.startup.failed", "message": "" if self.quiet_startup_errors else exc.message})
            return
        except BaseException:
            await send({"type": "lifespan.startup.failed", "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await self.gateway.close()
        except BaseException:
            await send({"type": "lifespan.shutdown.failed", "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.shutdown.complete"})


# ---- the routes --------------------------------------------------------------------------------


def _health_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.get("/ready", responses={503: {"description": "not enough healthy instances"}})
    async def ready() -> JSONResponse:
        ok, counts = gateway.ready()
        body: dict[str, Any] = {"ready": ok, "healthy": counts}
        canary = canary_detail(gateway.analyzer)  # instances kept out of KV-aware placement, and why
        if canary is not None:
            body["kv_canary"] = canary
        return JSONResponse(body, status_code=200 if ok else 503)

    return router


def _metrics_route(gateway: Gateway, guard: Guard | None = None) -> APIRouter:
    router = APIRouter()

    @router.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        if guard is not None:
            guard(request)
        m = gateway.metrics
        for state in gateway.registry.states.values():
            m.instance_healthy.labels(state.name, state.spec.role.value).set(1 if state.healthy else 0)
            m.queued_prefill_tokens.labels(state.name).set(sum(p.new_tokens for p in state.prefills.values()))
            m.running_decodes.labels(state.name).set(len(state.decodes))
        if isinstance(gateway.policy, ReportsPredictionErrors):  # policies with fitted predictors
            for st in gateway.policy.error_stats():
                m.prediction_mape.labels(st.component, st.instance).set(st.mape)
                m.prediction_coverage.labels(st.component, st.instance).set(st.p90_coverage)
                m.prediction_samples.labels(st.component, st.instance).set(st.samples)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def operational_keys(gateway: Gateway) -> ApiKeys:
    """The keys /metrics, /openapi.json and /docs take on the public port: none without client keys
    (the API is open, so is what describes it); else the admin keys, or the client keys when no admin
    key is set (see the module docstring)."""
    if not gateway.api_keys:
        return ApiKeys(())
    admin = gateway.settings.auth.admin_keys()
    return ApiKeys(admin, what="admin API key") if admin else ApiKeys(gateway.api_keys)


def _guard(keys: ApiKeys) -> Guard | None:
    if not keys:
        return None
    return lambda request: keys.check(request.headers.get("authorization"))


def create_app(gateway: Gateway) -> FastPath:
    """The public app serving `gateway`; its lifespan starts and stops the gateway's parts. With
    `admin_port` set it has no /metrics, /openapi.json or /docs: see `create_admin_app`."""
    public_ops = gateway.settings.admin_port is None
    app = FastAPI(title="Conductor", version="0.1.0", redoc_url=None, openapi_url=None, docs_url=None)
    app.state.gateway = gateway
    http_errors.install(app)
    hot: dict[str, CompletionsEndpoint] = {}
    for path, kind in OPENAI_ROUTES + PASS_THROUGH_ROUTES:
        hot[path] = CompletionsEndpoint(gateway.request_path, kind, path)  # type: ignore[arg-type]
        # also routed in FastAPI, so other methods on these paths get a 405
        app.router.routes.append(Route(path, endpoint=hot[path], methods=["POST"]))

    @app.get("/v1/models", responses={401: {"description": "no API key or an unknown one"}})
    async def models(request: Request) -> JSONResponse:
        gateway.authorize(request.headers.get("authorization"))
        # the workers' cards passed on (owned_by, root, parent, max_model_len, ...), adapters and
        # aliases among them: conductor/fleet/model_cards.py
        return JSONResponse(gateway.registry.model_list())

    app.include_router(_health_routes(gateway))
    install_openapi(app, lambda: openapi_document(app, secured=bool(gateway.api_keys)))
    if public_ops:
        guard = _guard(operational_keys(gateway))
        app.include_router(_metrics_route(gateway, None if gateway.settings.auth.public_metrics else guard))
        app.include_router(docs_routes(app.openapi, guard))
        app.include_router(admin_routes(gateway.membership))  # no admin port: the admin API is here
        app.include_router(explain_routes(gateway.request_path, gateway.membership.authorize))
        app.include_router(status_routes(gateway.request_path, gateway.membership, gateway.membership.authorize))
    return FastPath(app, hot, gateway)


def create_admin_app(gateway: Gateway, public: FastPath) -> FastAPI:
    """The admin port's app: /metrics, /health, /ready, and /openapi.json and /docs describing
    the public port's API. It has no lifespan: the public app starts and stops the gateway."""
    app = FastAPI(title="Conductor", version="0.1.0", redoc_url=None, openapi_url=None, docs_url=None)
    http_errors.install(app)
    app.include_router(_health_routes(gateway))
    app.include_router(_metrics_route(gateway))
    app.include_router(admin_routes(gateway.membership))
    app.include_router(explain_routes(gateway.request_path, gateway.membership.authorize))
    app.include_router(status_routes(gateway.request_path, gateway.membership, gateway.membership.authorize))
    install_openapi(app, lambda: openapi_document(public.app, secured=bool(gateway.api_keys)))
    app.include_router(docs_routes(app.openapi))
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
    (and drains) first while /metrics and /ready still answer. A ConfigError that stopped the
    gateway from starting is raised once both have stopped."""
    servers = [uvicorn.Server(config)]
    admin = admin_server(config, gateway)
    if admin is not None:
        servers.insert(0, admin)
    public = config.app if isinstance(config.app, FastPath) else None
    if public is not None:
        public.quiet_startup_errors = True  # raised below, for `conductor serve` to print as one line
    try:
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(serve_all(servers, sockets))
    except SystemExit:  # uvicorn exits so when the start-up failed
        if public is None or public.startup_error is None:
            raise
    if public is not None and public.startup_error is not None:
        raise public.startup_error
