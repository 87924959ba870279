"""The request path for /v1/completions and /v1/chat/completions, as a plain ASGI endpoint.

Plain ASGI rather than a FastAPI route because this is the hot path: it reads the body under a
size limit (413 before reading it all), watches for the client going away (and then cancels every
upstream leg), and writes upstream bytes to the client as they arrive, with nothing in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal

from adapters.pd.base import Outgoing
from conductor.core.errors import (
    BadRequest,
    ConductorError,
    NoHealthyInstance,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)
from conductor.core.types import Slo
from conductor.gateway import SLO_TBT_HEADER, SLO_TTFT_HEADER, Gateway, Routed
from conductor.kv.analysis import PromptAnalysis, vocab_size_of
from conductor.ops.logs import log_access
from conductor.routing.batch_relay import run_batch_attempt
from conductor.routing.batching import split_prompts
from conductor.routing.relay import ClientState, run_attempt
from conductor.server.errors import render, sse_error
from conductor.server.requests import (
    PASS_THROUGH_KINDS,
    check_model,
    estimate_input_tokens,
    max_tokens_of,
    parse_pass_through,
    parse_request,
    read_body,
)

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# fields of a client's body that tell a worker where to connect for KV (vLLM's connectors, SGLang's
# bootstrap): set by the gateway's P/D protocol, never taken from a client unless trusted
_KV_STEERING_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
# completions and chat are analysed, keyed and split; embeddings and responses are forwarded as
# they are to mixed workers (vLLM serves both there), sized but not keyed
EndpointKind = Literal["completions", "chat", "embeddings", "responses"]
_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-ID when it is a plain token (echoed back, logged); else None."""
    if value is None or not _CLIENT_ID_RE.fullmatch(value):
        return None
    return value


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


# request headers the gateway reads (without tracing): everything else is passed over undecoded
_READ_HEADERS = frozenset(
    name.encode() for name in ("authorization", "content-length", "x-request-id", SLO_TTFT_HEADER, SLO_TBT_HEADER)
)


class CompletionsEndpoint:
    def __init__(self, gateway: Gateway, kind: EndpointKind, path: str) -> None:
        self.gateway = gateway
        self.kind = kind
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = self.gateway.tracing
        # only the headers the gateway reads are decoded (ASGI servers lower-case the names); with
        # tracing on, all of them: the propagator looks for traceparent, tracestate and baggage
        if tracing is None:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _READ_HEADERS}
        else:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # the gateway's own id keys every internal table and is what workers see; the client's
        # X-Request-ID is only echoed back and logged, so two clients reusing one id collide nowhere
        request_id = os.urandom(12).hex()
        client_id = client_request_id(headers.get("x-request-id")) or request_id
        state = ClientState()
        task = asyncio.current_task()
        assert task is not None
        extensions = scope.get("extensions")
        on_disconnect = extensions.get("conductor.on_disconnect") if extensions else None
        try:
            if tracing is None:
                await self._serve(headers, request_id, client_id, receive, send, state, task, on_disconnect)
            else:
                with tracing.request(headers, self.path, request_id) as span:
                    span.set_attribute("conductor.client_request_id", client_id)
                    await self._serve(headers, request_id, client_id, receive, send, state, task, on_disconnect)
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            # We cancelled ourselves because the client left: that is a normal end.
            task.uncancel()
            self.gateway.metrics.cancelled.inc()
            self.gateway.metrics.requests.labels(self.path, "499").inc()
            log_access(
                path=self.path,
                status=499,
                request_id=request_id,
                client_request_id=client_id,
                prefill=state.prefill,
                decode=state.decode,
            )

    async def _serve(
        self,
        headers: dict[str, str],
        request_id: str,
        client_id: str,
        receive: Receive,
        send: Send,
        state: ClientState,
        task: asyncio.Task[Any],
        on_disconnect: Callable[[Callable[[], None]], None] | None,
    ) -> None:
        gw = self.gateway
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        watcher: asyncio.Task[None] | None = None
        status = 200
        try:
            gw.authorize(headers.get("authorization"))
            length = headers.get("content-length")
            raw = await read_body(receive, int(length) if length and length.isdigit() else None, gw.settings.max_body_bytes)
            if self.kind in PASS_THROUGH_KINDS:
                body = parse_pass_through(raw, self.kind)
                if gw.settings.disaggregated:
                    raise BadRequest(
                        f"{self.path} is served by mixed (non-disaggregated) workers only; "
                        "this gateway routes to prefill/decode pairs"
                    )
            else:
                body = parse_request(raw, self.kind, vocab_size=vocab_size_of(gw.analyzer))  # type: ignore[arg-type]
            check_model(body["model"], gw.known_models())
            state.watching = True
            if on_disconnect is not None:  # the gateway's own server tells; no task needed
                on_disconnect(functools.partial(_client_left, task, state))
            else:
                watcher = asyncio.create_task(_watch_disconnect(receive, task, state))
            slo = gw.slo_for(headers.get(SLO_TTFT_HEADER), headers.get(SLO_TBT_HEADER))
            if self.kind in PASS_THROUGH_KINDS:  # no tokenizer path for these inputs: sized, not keyed
                analysis = PromptAnalysis(prompt_tokens=estimate_input_tokens(body), exact=False)
                max_tokens = (
                    1 if self.kind == "embeddings" else int(body.get("max_output_tokens") or gw.settings.default_max_tokens)
                )
            else:
                with gw.tracing.child("conductor.analyse") if gw.tracing else contextlib.nullcontext() as span:
                    analysis = await gw.analyzer.analyse(self.kind, body)  # type: ignore[arg-type]
                    if span is not None:  # tokenize, block keys, index look-up
                        span.set_attributes(
                            {
                                "conductor.prompt_tokens": analysis.prompt_tokens,
                                "conductor.exact": analysis.exact,
                                "conductor.blocks": len(analysis.block_keys),
                            }
                        )
                max_tokens = max_tokens_of(body, gw.settings.default_max_tokens)
            stream = bool(body.get("stream", False))
            if gw.inflight >= gw.settings.max_inflight_requests:
                raise Overloaded(f"the gateway already has {gw.inflight} requests in flight")
            if gw.settings.load_sync_max_age_s is not None:  # other replicas' load, at most this old
                await gw.registry.load_share.refresh(gw.settings.load_sync_max_age_s)
            routed = gw.decide(request_id, body["model"], max_tokens, stream, slo, analysis)
            out = self._outgoing(routed, body, request_id, client_id, stream)
            status = await self._forward(routed, out, slo, max_tokens, analysis, send, state, arrived, task)
        except ConductorError as exc:
            status = await self._fail(exc, send, state, client_id)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - never a traceback to the client; render() logs it
            status = await self._fail(exc, send, state, client_id)
        finally:
            state.watching = False
            if watcher is not None:
                watcher.cancel()
        elapsed = loop.time() - arrived
        gw.metrics.requests.labels(self.path, str(status)).inc()
        gw.metrics.e2e.observe(elapsed)
        log_access(
            path=self.path,
            status=status,
            duration_ms=round(elapsed * 1000, 2),
            request_id=request_id,
            client_request_id=client_id,
            prefill=state.prefill,
            decode=state.decode,
        )

    async def _fail(self, exc: BaseException, send: Send, state: ClientState, client_id: str) -> int:
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

    def _outgoing(self, routed: Routed, body: dict[str, Any], request_id: str, client_id: str, stream: bool) -> Outgoing:
        gw = self.gateway
        ids = routed.analysis.forward_token_ids
        if ids is not None and self.kind == "completions" and isinstance(body.get("prompt"), str):
            body = {**body, "prompt": list(ids)}  # tokenized once here; the worker need not again
        if not gw.settings.trust_client_kv_transfer_params and any(f in body for f in _KV_STEERING_FIELDS):
            body = {k: v for k, v in body.items() if k not in _KV_STEERING_FIELDS}
        headers = {"Content-Type": "application/json", "X-Request-ID": request_id}
        if gw.tracing is not None:
            gw.tracing.inject(headers)  # the workers' spans join this request's trace
        if gw.upstream_key:
            headers["Authorization"] = f"Bearer {gw.upstream_key}"
        return Outgoing(
            path=self.path, body=body, headers=headers, request_id=request_id, stream=stream, client_request_id=client_id
        )

    async def _forward(
        self,
        routed: Routed,
        out: Outgoing,
        slo: Slo,
        max_tokens: int,
        analysis: PromptAnalysis,
        send: Send,
        state: ClientState,
        arrived: float,
        task: asyncio.Task[Any],
    ) -> int:
        """Attempts on the chosen instances, failing over while nothing reached the client, all
        within the request's deadline."""
        gw = self.gateway
        gw.inflight += 1
        failed: set[str] = set()
        # P/D: each prompt of a batch is its own exchange (see conductor/routing/batch_relay.py)
        batch = split_prompts(out.body) if self.kind == "completions" and gw.settings.disaggregated else None
        deadline = gw.deadlines.enter(task, asyncio.get_running_loop().time())
        try:
            for attempt in range(1, gw.settings.max_attempts + 1):
                try:
                    if batch is not None:
                        return await run_batch_attempt(gw, routed, out, batch, send, state, arrived)
                    return await run_attempt(gw, routed, out, send, state, arrived)
                except UpstreamError as exc:
                    reason = failover_reason(exc)
                    if state.response_started or reason is None or attempt == gw.settings.max_attempts:
                        raise
                    assert exc.instance is not None
                    failed.add(exc.instance)
                    gw.metrics.failovers.labels(exc.instance, reason).inc()
                    log.info(
                        "request %s: %s on %s, deciding again (attempt %d)", out.request_id, reason, exc.instance, attempt + 1
                    )
                    try:
                        routed = gw.decide(
                            out.request_id, out.body["model"], max_tokens, out.stream, slo, analysis, exclude=frozenset(failed)
                        )
                    except NoHealthyInstance:
                        raise exc from None  # no other instance to try: the failure itself is the answer
            raise AssertionError("unreachable: the last attempt returns or raises")
        except asyncio.CancelledError:
            # the sweep cancelled us (conductor/routing/deadlines.py); any other cancellation goes on
            if not deadline.expired or task.uncancel() > 0:
                raise
            raise UpstreamTimeout(
                f"the request did not finish within request_timeout_s ({gw.settings.request_timeout_s:g}s)"
            ) from None
        finally:
            gw.deadlines.leave(deadline)
            gw.inflight -= 1


def failover_reason(exc: UpstreamError) -> str | None:
    """Why another instance may be tried, or None when it may not: a worker's 5xx (it did not serve
    the request), or a connection that failed before any byte of the request can have reached the
    worker. Never after a timeout or a reset mid-answer: the work may be running there."""
    if exc.instance is None or exc.client_fault or isinstance(exc, UpstreamTimeout):
        return None
    if exc.upstream_status is not None:
        return "status" if exc.upstream_status >= 500 else None
    return None if exc.maybe_processed else "connect"
