"""The request path for /v1/completions and /v1/chat/completions, as a plain ASGI endpoint.

Plain ASGI rather than a FastAPI route because this is the hot path: it reads the body under a
size limit (413 before reading it all), watches for the client going away (and then cancels every
upstream leg), and writes upstream bytes to the client as they arrive, with nothing in between.
A request the server cuts when its drain grace runs out (SIGTERM) ends with a 503, or with an SSE
error event once its stream has begun, as a worker failure does: `ShuttingDown`, `_cut_by_shutdown`.
Its collaborators (`RequestPath`, conductor/routing/request_path.py) are wired once by the gateway.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal

from adapters.pd.base import Outgoing
from conductor.core.errors import (
    BadRequest,
    ConductorError,
    NoHealthyInstance,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)
from conductor.core.types import Slo
from conductor.kv.analysis import PromptAnalysis, vocabulary_of
from conductor.ops.logs import access_log_on, log_access
from conductor.ops.tracing import NO_SPAN, OPERATIONS, forwarded_trace_context, request_attributes
from conductor.routing.attempt import failover_reason
from conductor.routing.batch_relay import run_batch_attempt
from conductor.routing.batching import split_prompts
from conductor.routing.request_path import RequestPath
from conductor.routing.router import SLO_TBT_HEADER, SLO_TTFT_HEADER, Routed
from conductor.routing.sessions import SessionKeys
from conductor.routing.streams import ClientState
from conductor.server.errors import send_failure
from conductor.server.requests import (
    PASS_THROUGH_KINDS,
    client_request_id,
    estimate_input_tokens,
    max_tokens_of,
    parse_pass_through,
    parse_request,
    read_body,
    resolve_model,
)

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# fields of a client's body that tell a worker where to connect for KV (vLLM's connectors, SGLang's
# bootstrap): set by the gateway's P/D protocol, never taken from a client unless trusted
_KV_STEERING_FIELDS = frozenset(("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"))
# a status's label text, made once rather than per request and metric
_STATUS_TEXT = {status: str(status) for status in range(100, 600)}
# completions and chat are analysed, keyed and split; embeddings and responses are forwarded as
# they are to mixed workers (vLLM serves both there), sized but not keyed
EndpointKind = Literal["completions", "chat", "embeddings", "responses"]


def _client_left(task: asyncio.Task[Any], state: ClientState) -> None:
    """The client went away: cancel the request's task (and with it every upstream leg) unless
    its answer is complete or the request is past the point of caring."""
    if state.watching and not state.response_done:
        state.disconnected = True
        task.cancel()


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], state: ClientState) -> None:
    """The same for a server without the `conductor.on_disconnect` extension: a task that waits
    in receive() for http.disconnect."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_left(task, state)
            return


def _cut_by_shutdown(call: _Call) -> bool:
    """Whether the request's cancellation is the server's drain grace running out: uvicorn cancels
    the requests still in flight then, before the process ends, and leaves their connections open,
    so the answer can still be ended with an error the client understands (written at once: the
    gateway's server writes to the socket as it is sent). A client that left is a 499 as ever. The
    cancellation is taken back: the request ends normally, having told the client why."""
    if call.client.disconnected or call.draining is None or not call.draining():
        return False
    call.task.uncancel()
    return True


# request headers the gateway reads (without tracing: the trace context only to pass it on);
# everything else is passed over undecoded
_READ_HEADERS = frozenset(
    name.encode()
    for name in (
        "authorization", "content-length", "x-request-id", SLO_TTFT_HEADER, SLO_TBT_HEADER, "traceparent", "tracestate",
    )
)  # fmt: skip


class _Call:
    """One request on its way through the endpoint."""

    __slots__ = (
        "arrived", "client", "client_id", "draining", "headers", "model", "priority", "request_id", "session", "span", "task",
        "tenant",
    )  # fmt: skip

    def __init__(self, headers: dict[str, str], task: asyncio.Task[Any]) -> None:
        self.headers = headers
        # the gateway's own id keys every internal table and is what workers see; the client's
        # X-Request-ID is only echoed back and logged, so two clients reusing one id collide nowhere
        self.request_id = os.urandom(12).hex()
        self.client_id = client_request_id(headers.get("x-request-id")) or self.request_id
        self.client = ClientState()
        self.task = task
        self.arrived = 0.0
        self.span: Any = None  # the request's span, with tracing on
        self.draining: Callable[[], bool] | None = None  # the server's `conductor.draining` extension
        self.model: str | None = None  # the served model, once its name is known to the gateway
        self.tenant: str | None = None  # its key's tenant (auth.tenants), once authorized
        self.priority: str | None = None  # its priority class (priority.classes), once read
        self.session: int | None = None  # its session's hashed key (conductor/routing/sessions.py), once read


class CompletionsEndpoint:
    def __init__(self, parts: RequestPath, kind: EndpointKind, path: str) -> None:
        self.parts = parts
        self._vocab_size = vocabulary_of(parts.analyzer)  # resolved once, read per request
        self.kind = kind
        self.path = path
        self._sessions = SessionKeys(parts.settings.sessions)  # + the class and session headers, where configured:
        self._read_headers = self._sessions.read_headers(parts.classes.read_headers(_READ_HEADERS))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = self.parts.tracing
        # only the headers the gateway reads are decoded (ASGI servers lower-case the names); with
        # tracing on, all of them: the propagator looks for traceparent, tracestate and baggage
        if tracing is None:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in self._read_headers}
        else:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        task = asyncio.current_task()
        assert task is not None
        call = _Call(headers, task)
        extensions = scope.get("extensions")
        on_disconnect = extensions.get("conductor.on_disconnect") if extensions else None
        call.draining = extensions.get("conductor.draining") if extensions else None
        if tracing is None:
            try:
                await self._serve(call, receive, send, on_disconnect)
            except asyncio.CancelledError:
                if not call.client.disconnected:
                    raise
                self._left(call)
            return
        server = scope.get("server")  # (host, port); (path, None) on a unix socket
        address = (str(server[0]), int(server[1])) if server and server[1] is not None else None
        with tracing.request(headers, self.path, call.request_id, operation=OPERATIONS[self.kind], server=address) as span:
            span.set_attribute("conductor.client_request_id", call.client_id)
            call.span = span
            tracing.request_ended(span, await self._call(call, receive, send, on_disconnect))

    async def _call(
        self, call: _Call, receive: Receive, send: Send, on_disconnect: Callable[[Callable[[], None]], None] | None
    ) -> int:
        """Serve the call; the HTTP status it ended with (499: the client left)."""
        try:
            return await self._serve(call, receive, send, on_disconnect)
        except asyncio.CancelledError:
            if not call.client.disconnected:
                raise
            return self._left(call)

    def _left(self, call: _Call) -> int:
        """We cancelled ourselves because the client left: that is a normal end (499)."""
        call.task.uncancel()
        self.parts.metrics.cancelled.inc()
        self._count(call, 499)
        if access_log_on():
            log_access(
                path=self.path,
                status=499,
                request_id=call.request_id,
                client_request_id=call.client_id,
                prefill=call.client.prefill,
                decode=call.client.decode,
            )
        return 499

    async def _serve(
        self, call: _Call, receive: Receive, send: Send, on_disconnect: Callable[[Callable[[], None]], None] | None
    ) -> int:
        loop = asyncio.get_running_loop()
        call.arrived = loop.time()
        watcher: asyncio.Task[None] | None = None
        status = 200
        try:
            body = await self._read(call, receive)
            if call.span is not None:
                call.span.set_attributes(request_attributes(body))
            call.client.watching = True
            if on_disconnect is not None:  # the gateway's own server tells; no task needed
                on_disconnect(functools.partial(_client_left, call.task, call.client))
            else:
                watcher = asyncio.create_task(_watch_disconnect(receive, call.task, call.client))
            status = await self._route(call, body, send)
        except ConductorError as exc:
            status = await send_failure(exc, send, call.client, call.request_id, call.client_id)
        except asyncio.CancelledError:
            if not _cut_by_shutdown(call):
                raise
            grace = self.parts.settings.timeouts.drain_grace_s
            message = (
                f"the gateway is shutting down and its drain grace ({grace:g}s) ran out before "
                "the answer was complete; send the request again"
            )
            status = await send_failure(ShuttingDown(message), send, call.client, call.request_id, call.client_id)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - never a traceback to the client; render() logs it
            status = await send_failure(exc, send, call.client, call.request_id, call.client_id)
        finally:
            call.client.watching = False
            if watcher is not None:
                watcher.cancel()
        elapsed = loop.time() - call.arrived
        self._count(call, status)
        self.parts.metrics.e2e.observe(elapsed)
        if access_log_on():
            log_access(
                path=self.path,
                status=status,
                duration_ms=round(elapsed * 1000, 2),
                request_id=call.request_id,
                client_request_id=call.client_id,
                prefill=call.client.prefill,
                decode=call.client.decode,
            )
        return status

    def _count(self, call: _Call, status: int) -> None:
        """The answer's status by route, and by model and class where known (never a client's string)."""
        metrics = self.parts.metrics
        text = _STATUS_TEXT.get(status) or str(status)
        metrics.requests.labels(self.path, text).inc()
        if call.model is not None:
            metrics.model_requests.labels(call.model, text).inc()
        if call.priority is not None:
            metrics.priority_requests.labels(call.priority, text).inc()

    async def _read(self, call: _Call, receive: Receive) -> dict[str, Any]:
        """The client's body, authorized (its tenant), read under the size limit and validated; its
        model and priority class (conductor/routing/priority.py) resolved."""
        parts = self.parts
        call.tenant = parts.authorize(call.headers.get("authorization"))
        length = call.headers.get("content-length")
        limit = parts.settings.limits.max_body_bytes
        raw = await read_body(receive, int(length) if length and length.isdigit() else None, limit)
        if self.kind in PASS_THROUGH_KINDS:
            body = parse_pass_through(raw, self.kind)
            if parts.settings.disaggregated:
                raise BadRequest(
                    f"{self.path} is served by mixed (non-disaggregated) workers only; "
                    "this gateway routes to prefill/decode pairs"
                )
        else:
            body = parse_request(raw, self.kind, vocab_size=self._vocab_size())  # type: ignore[arg-type]
        # an alias becomes the served name here, before the analyzer, the router or a worker reads it
        call.model = resolve_model(body, parts.known_models(), parts.settings.model_aliases)
        call.priority = parts.classes.classify(call.headers.get(parts.classes.header), body, call.tenant)
        call.session = self._sessions.session_of(call.headers.get(self._sessions.header), body, call.tenant)
        return body

    async def _analyse(self, body: dict[str, Any]) -> tuple[PromptAnalysis, int]:
        """The prompt's analysis (tokens, block keys, who holds them) and its output budget."""
        parts = self.parts
        if self.kind in PASS_THROUGH_KINDS:  # no tokenizer path for these inputs: sized, not keyed
            analysis = PromptAnalysis(prompt_tokens=estimate_input_tokens(body), exact=False)
            default = parts.settings.default_max_tokens
            return analysis, 1 if self.kind == "embeddings" else int(body.get("max_output_tokens") or default)
        with parts.tracing.child("conductor.analyse") if parts.tracing else NO_SPAN as span:
            analysis = await parts.analyzer.analyse(self.kind, body)  # type: ignore[arg-type]
            if span is not None:  # tokenize, block keys, index look-up
                span.set_attributes(
                    {
                        "conductor.prompt_tokens": analysis.prompt_tokens,
                        "conductor.exact": analysis.exact,
                        "conductor.blocks": len(analysis.block_keys),
                    }
                )
        return analysis, max_tokens_of(body, parts.settings.default_max_tokens)

    async def _route(self, call: _Call, body: dict[str, Any], send: Send) -> int:
        """Admit, decide and forward; the HTTP status sent. The in-flight slot is taken (as class and
        tenant allow: conductor/routing/shares.py) before anything else is awaited, held to the last byte."""
        parts = self.parts
        ttft, tbt = call.headers.get(SLO_TTFT_HEADER), call.headers.get(SLO_TBT_HEADER)
        slo = parts.router.slo_for(body["model"], ttft, tbt, call.priority)
        analysis, max_tokens = await self._analyse(body)
        stream = bool(body.get("stream", False))
        parts.shares.enter(call.priority, call.tenant)
        try:
            max_age_s = parts.settings.load_share.sync_max_age_s
            if max_age_s is not None:  # other replicas' load, at most this old
                await parts.load_share.refresh(max_age_s)

            def decide(s: Slo, may_hold: bool) -> Routed | None:
                return parts.router.decide(
                    call.request_id, body["model"], max_tokens, stream, s, analysis, priority=call.priority,
                    tenant=call.tenant, session=call.session, may_hold=may_hold)  # fmt: skip

            routed = await parts.waiting_room.admit(decide, slo)
            out = self._outgoing(routed, body, call, stream)
            return await self._forward(call, routed, out, slo, send)
        finally:
            parts.shares.leave(call.tenant)

    def _outgoing(self, routed: Routed, body: dict[str, Any], call: _Call, stream: bool) -> Outgoing:
        parts = self.parts
        ids = routed.analysis.forward_token_ids
        if ids is not None and self.kind == "completions" and isinstance(body.get("prompt"), str):
            body = {**body, "prompt": list(ids)}  # tokenized once here; the worker need not again
        if not _KV_STEERING_FIELDS.isdisjoint(body) and not parts.settings.pd.trust_client_kv_transfer_params:
            body = {k: v for k, v in body.items() if k not in _KV_STEERING_FIELDS}
        body, engine_priority = parts.classes.engine_priority(call.priority, body)  # the client's `priority` out
        headers = {"Content-Type": "application/json", "X-Request-ID": call.request_id}
        if parts.tracing is not None:
            parts.tracing.inject(headers)  # the workers' spans join this request's trace
        elif "traceparent" in call.headers:  # not tracing: the client's own trace goes on, checked
            headers.update(forwarded_trace_context(call.headers))
        if parts.upstream_key:
            headers["Authorization"] = f"Bearer {parts.upstream_key}"
        return Outgoing(
            path=self.path,
            body=body,
            headers=headers,
            request_id=call.request_id,
            stream=stream,
            client_request_id=call.client_id,
            engine_priority=engine_priority,
        )

    async def _forward(self, call: _Call, routed: Routed, out: Outgoing, slo: Slo, send: Send) -> int:
        """Attempts on the chosen instances, failing over while nothing reached the client, all
        within the request's deadline."""
        parts = self.parts
        attempts = parts.settings.limits.max_attempts
        failed: set[str] = set()
        # P/D: each prompt of a batch is its own exchange (see conductor/routing/batch_relay.py)
        batch = split_prompts(out.body) if self.kind == "completions" and parts.settings.disaggregated else None
        deadline = parts.deadlines.enter(call.task, asyncio.get_running_loop().time())
        try:
            for attempt in range(1, attempts + 1):
                try:
                    if batch is not None:
                        return await run_batch_attempt(parts.relay, routed, out, batch, send, call.client, call.arrived)
                    return await parts.relay.attempt(routed, out, send, call.client, call.arrived)
                except UpstreamError as exc:
                    reason = failover_reason(exc)
                    if call.client.response_started or reason is None or attempt == attempts:
                        raise
                    assert exc.instance is not None
                    failed.add(exc.instance)
                    parts.metrics.failovers.labels(exc.instance, reason).inc()
                    log.info(
                        "request %s: %s on %s (%s), deciding again (attempt %d)",
                        out.request_id,
                        reason,
                        exc.instance,
                        exc.message,
                        attempt + 1,
                    )
                    try:
                        routed = parts.router.decide_again(routed, out.stream, slo, frozenset(failed))
                    except NoHealthyInstance:
                        raise exc from None  # no other instance to try: the failure itself is the answer
            raise AssertionError("unreachable: the last attempt returns or raises")
        except asyncio.CancelledError:
            # the sweep cancelled us (conductor/routing/deadlines.py); any other cancellation goes on
            if not deadline.expired or call.task.uncancel() > 0:
                raise
            raise UpstreamTimeout(
                f"the request did not finish within timeouts.request_s ({parts.settings.timeouts.request_s:g}s)"
            ) from None
        finally:
            parts.deadlines.leave(deadline)
