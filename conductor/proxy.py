"""The request path for /v1/completions and /v1/chat/completions, as a plain ASGI endpoint.

Plain ASGI rather than a FastAPI route because this is the hot path: it reads the body under a
size limit (413 before reading it all), watches for the client going away (and then cancels every
upstream leg), and writes upstream bytes to the client as they arrive, with nothing in between.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from adapters.pd.base import CACHED_TOKENS_RE, Exchange, Outgoing, cached_tokens_of, decode_json
from conductor.analysis import RequestKind
from conductor.core.errors import ConductorError, NoHealthyInstance, Overloaded, UpstreamError
from conductor.core.types import Observation
from conductor.gateway import SLO_TBT_HEADER, SLO_TTFT_HEADER, Gateway, Routed
from conductor.http_errors import render, sse_error
from conductor.requests import check_model, max_tokens_of, parse_request, read_body

log = logging.getLogger("conductor.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_MAX_INTERVALS = 256  # token intervals kept per stream for the TBT fit


class _ClientState:
    __slots__ = ("disconnected", "response_done", "response_started")

    def __init__(self) -> None:
        self.disconnected = False
        self.response_started = False
        self.response_done = False  # after this, uvicorn reports "disconnect" for a normal end


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], state: _ClientState) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if state.response_done:
                return
            state.disconnected = True
            task.cancel()
            return


class CompletionsEndpoint:
    def __init__(self, gateway: Gateway, kind: RequestKind, path: str) -> None:
        self.gateway = gateway
        self.kind = kind
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or os.urandom(12).hex()
        if len(request_id) > 128:
            request_id = request_id[:128]
        state = _ClientState()
        task = asyncio.current_task()
        assert task is not None
        try:
            await self._serve(headers, request_id, receive, send, state, task)
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            # We cancelled ourselves because the client left: that is a normal end.
            task.uncancel()
            self.gateway.metrics.cancelled.inc()
            self.gateway.metrics.requests.labels(self.path, "499").inc()

    async def _serve(
        self, headers: dict[str, str], request_id: str, receive: Receive, send: Send,
        state: _ClientState, task: asyncio.Task[Any],
    ) -> None:
        gw = self.gateway
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        watcher: asyncio.Task[None] | None = None
        status = 200
        try:
            gw.authorize(headers.get("authorization"))
            length = headers.get("content-length")
            raw = await read_body(receive, int(length) if length and length.isdigit() else None,
                                  gw.settings.max_body_bytes)
            body = parse_request(raw, self.kind)
            check_model(body["model"], gw.known_models())
            watcher = asyncio.create_task(_watch_disconnect(receive, task, state))
            slo = gw.slo_for(headers.get(SLO_TTFT_HEADER), headers.get(SLO_TBT_HEADER))
            analysis = await gw.analyzer.analyse(self.kind, body)
            stream = bool(body.get("stream", False))
            if gw.inflight >= gw.settings.max_inflight_requests:
                raise Overloaded(f"the gateway already has {gw.inflight} requests in flight")
            routed = gw.decide(request_id, body["model"], max_tokens_of(body, gw.settings.default_max_tokens),
                               stream, slo, analysis)
            status = await self._forward(routed, body, request_id, stream, send, state, arrived)
        except ConductorError as exc:
            status = await self._fail(exc, send, state)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - never a traceback to the client; render() logs it
            status = await self._fail(exc, send, state)
        finally:
            if watcher is not None:
                watcher.cancel()
        gw.metrics.requests.labels(self.path, str(status)).inc()
        gw.metrics.e2e.observe(loop.time() - arrived)

    async def _fail(self, exc: BaseException, send: Send, state: _ClientState) -> int:
        status, payload, extra = render(exc)
        if state.response_started:  # too late for a status: tell the stream
            await send({"type": "http.response.body", "body": sse_error(exc), "more_body": False})
            return status
        headers = [(b"content-type", b"application/json")]
        headers.extend((k.lower().encode(), v.encode()) for k, v in extra.items())
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        return status

    def _outgoing(self, routed: Routed, body: dict[str, Any], request_id: str, stream: bool) -> Outgoing:
        ids = routed.analysis.forward_token_ids
        if ids is not None and self.kind == "completions" and isinstance(body.get("prompt"), str):
            body = {**body, "prompt": list(ids)}  # tokenized once here; the worker need not again
        headers = {"Content-Type": "application/json", "X-Request-ID": request_id}
        if self.gateway.settings.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.gateway.settings.upstream_api_key}"
        return Outgoing(path=self.path, body=body, headers=headers, request_id=request_id, stream=stream)

    async def _forward(
        self, routed: Routed, body: dict[str, Any], request_id: str, stream: bool,
        send: Send, state: _ClientState, arrived: float,
    ) -> int:
        gw = self.gateway
        gw.inflight += 1
        try:
            return await self._dispatch(routed, body, request_id, stream, send, state, arrived)
        finally:
            gw.inflight -= 1

    async def _dispatch(
        self, routed: Routed, body: dict[str, Any], request_id: str, stream: bool,
        send: Send, state: _ClientState, arrived: float,
    ) -> int:
        gw = self.gateway
        decision = routed.decision
        assert decision.prefill is not None
        states = gw.registry.states
        prefill = states[decision.prefill].target
        decode = states[decision.decode].target if decision.decode else None
        if not gw.protocol.ready(prefill):
            raise NoHealthyInstance(f"prefill instance {prefill.name} is not ready (bootstrap not answered)")
        analysis = routed.analysis
        cached = analysis.cached.get(prefill.name)
        predicted_cached = cached.tokens if cached else 0
        decode_name = decode.name if decode else prefill.name
        joined = gw.registry.states[decode_name]  # the others already decoding there (this replica's)
        batch, resident = len(joined.decodes), sum(d.context_tokens for d in joined.decodes.values())
        gw.registry.add_prefill(prefill.name, request_id, analysis.prompt_tokens - predicted_cached, predicted_cached)
        gw.registry.add_decode(decode_name, request_id, analysis.prompt_tokens, routed.view.max_tokens)
        await gw.analyzer.on_dispatch(analysis, decision)
        loop = asyncio.get_running_loop()
        exchange: Exchange | None = None
        first_token: float | None = None
        intervals: list[float] = []
        tokens = 0
        ok = False
        cached_reported: int | None = None
        try:
            try:
                exchange = await gw.protocol.exchange(self._outgoing(routed, body, request_id, stream), prefill, decode)
            except UpstreamError as exc:
                if not exc.client_fault:
                    gw.metrics.upstream_errors.labels(exc.instance or "", "status" if exc.upstream_status else "transport").inc()
                    if exc.upstream_status is None and exc.instance:
                        gw.registry.report_failure(exc.instance)
                raise
            if exchange.prefill_s is not None:  # sequential prefill (nixl) is over
                gw.registry.end_prefill(prefill.name, request_id)
                gw.registry.mark_decoding(decode_name, request_id)
                gw.metrics.prefill_leg.labels(prefill.name).observe(exchange.prefill_s)
            if exchange.reply is not None:
                reply = exchange.reply
                await exchange.settle()
                if exchange.prefill_failed is not None:
                    raise exchange.prefill_failed
                await send({"type": "http.response.start", "status": reply.status, "headers": [
                    (b"content-type", reply.content_type.encode()), (b"x-request-id", request_id.encode())]})
                state.response_started = state.response_done = True
                await send({"type": "http.response.body", "body": reply.body})
                first_token = loop.time()
                if exchange.prefill_cached_tokens is None and reply.status == 200:
                    try:
                        cached_reported = cached_tokens_of(decode_json(reply.body))
                    except ValueError:
                        cached_reported = None
                ok = reply.status == 200
                status = reply.status
            else:
                assert exchange.stream is not None
                upstream = exchange.stream
                await send({"type": "http.response.start", "status": upstream.status, "headers": [
                    (b"content-type", upstream.content_type.encode()), (b"cache-control", b"no-cache"),
                    (b"x-request-id", request_id.encode())]})
                state.response_started = True
                last = 0.0
                tail = b""
                async for chunk in upstream.chunks():
                    now = loop.time()
                    events = chunk.count(b"data:")
                    if first_token is None:
                        first_token = now
                        gw.registry.end_prefill(prefill.name, request_id)
                        gw.metrics.ttft.observe(now - arrived)
                        # the batch it really joined: streams decoding there now, not those listed
                        # at dispatch (some still in prefill then, some gone by now) -- the TBT fit
                        others = [d for rid, d in joined.decodes.items() if rid != request_id and d.decoding]
                        batch, resident = len(others), sum(d.context_tokens for d in others)
                    elif events and len(intervals) < _MAX_INTERVALS:
                        intervals.append((now - last) / events)
                    last = now
                    tokens += events
                    gw.registry.advance_decode(decode_name, request_id, events)
                    tail = chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await exchange.settle()  # a concurrent prefill leg: its answer, or its failure
                if exchange.prefill_failed is not None:
                    raise exchange.prefill_failed
                state.response_done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                match = CACHED_TOKENS_RE.search(tail)
                cached_reported = int(match.group(1)) if match else None
                ok = True
                status = upstream.status
            if intervals:
                gw.metrics.tbt.observe(sum(intervals) / len(intervals))
            return status
        except BaseException:
            if exchange is not None:
                exchange.abort()
            raise
        finally:
            gw.registry.end_prefill(prefill.name, request_id)
            gw.registry.end_decode(decode_name, request_id)
            reported = exchange.prefill_cached_tokens if exchange and exchange.prefill_cached_tokens is not None \
                else cached_reported
            gw.observe(routed, Observation(
                request_id=request_id,
                prefill=prefill.name,
                decode=decode.name if decode else None,
                prompt_tokens=analysis.prompt_tokens,
                cached_tokens=reported,
                predicted_cached_tokens=predicted_cached,
                queue_and_prefill_s=exchange.prefill_s if exchange else None,
                ttft_s=(first_token - arrived) if (first_token is not None and stream) else None,
                token_intervals_s=tuple(intervals),
                output_tokens=tokens,
                decode_batch=batch,
                decode_resident_kv_tokens=resident,
                ok=ok,
            ))
