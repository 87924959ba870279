"""One attempt at serving a routed request: account the load, run the P/D exchange, relay the
answer to the client as it arrives, and tell the gateway what happened.

`conductor/server/endpoint.py` owns the request's life (validation, admission, failover between attempts,
the deadline); this module owns one attempt on the instances one decision chose.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

from adapters.pd.base import Exchange, Outgoing, Target, cached_tokens_of, decode_json, open_leg
from adapters.upstream import UpstreamPoolExhausted
from conductor.core.errors import NoHealthyInstance, UpstreamError
from conductor.core.types import Observation, PrefillLeg
from conductor.gateway import Gateway, Routed
from conductor.routing.peer_pull import stage as stage_prefix
from conductor.routing.readback import parse_decode_params, pull_tokens_for

log = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

_MAX_INTERVALS = 256  # token intervals kept per stream for the TBT fit
# a stream's context in the registry grows every this many tokens, not every token: a few tokens of
# lag against contexts of thousands change no prediction, and a registry write per token cost ~2% of
# the gateway's CPU on 32-token streams (profiled)
_ADVANCE_EVERY = 8
# a concurrent prefill leg still running when its decode has answered in full: how long to wait
# for its answer (only to learn from it) before closing it; the client is never kept waiting
PREFILL_SETTLE_S = 5.0
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_DONE = b"data: [DONE]"
_USAGE_ONLY = b'"choices":[]'  # vLLM's final usage chunk (stream_options.include_usage)


class ClientState:
    """What the client has been sent; the disconnect watcher reads it."""

    __slots__ = ("decode", "disconnected", "prefill", "response_done", "response_started", "watching")

    def __init__(self) -> None:
        self.prefill: str | None = None  # where the (last) attempt went: for the access log
        self.decode: str | None = None
        self.disconnected = False
        self.response_started = False
        # the client has the whole answer ([DONE] or the full body): a disconnect now is a normal end
        self.response_done = False
        self.watching = False  # a client that leaves now cancels the request (proxy.py)


@dataclass(slots=True)
class StreamStats:
    """What a relayed SSE stream told: token events, their spacing, the usage chunk."""

    first_token: float | None = None
    last: float = 0.0
    tokens: int = 0
    intervals: list[float] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    done: bool = False

    def see(self, chunk: bytes, now: float) -> int:
        """Account one upstream chunk; returns the token events in it. Most chunks are one token
        event: one count() and two `in` tests, the rest only for the final chunks."""
        n = chunk.count(b"data:")
        if not n:
            return 0
        if b"[DONE]" in chunk:
            self.done = True
            n -= chunk.count(_DONE)
        if b'"usage"' in chunk:  # usage-only final chunk, or continuous usage stats on every chunk
            n -= chunk.count(_USAGE_ONLY)
            completion = _COMPLETION_RE.findall(chunk)
            cached = _CACHED_RE.findall(chunk)
            if completion:
                self.usage_completion_tokens = int(completion[-1])
            if cached:
                self.usage_cached_tokens = int(cached[-1])
            prompt = _PROMPT_RE.findall(chunk)
            if prompt:
                self.usage_prompt_tokens = int(prompt[-1])
        if n > 0:
            if self.first_token is not None and len(self.intervals) < _MAX_INTERVALS:
                self.intervals.append((now - self.last) / n)
            self.last = now
            self.tokens += n
            return n
        return 0


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One attempt's place on the instances: where it went and what the index predicted there."""

    request_id: str
    prefill: Target
    decode: Target | None
    decode_name: str  # where it decodes: the decode instance, or the mixed worker itself
    predicted_cached: int  # leading tokens the prefill instance holds: its cache, or after the pull
    # kv_transfer_params of the decode readback the prefill pulls (the decision's pull), else None
    pull: dict[str, Any] | None = None
    local_cached: int = 0  # what the prefill instance holds itself (predicted_cached without the pull)
    # a prefill-to-prefill pull to stage first (conductor/routing/peer_pull.py): (holder, prefix tokens)
    stage: tuple[str, int] | None = None
    # the decode instance prefills it itself (policies/local_prefill.py): one plain leg, as to a
    # mixed worker, with no kv_transfer_params (a vLLM kv_both engine then computes the prompt)
    local: bool = False

    async def open(self, gw: Gateway, out: Outgoing) -> Exchange:
        """Start the exchange on its instances: the protocol's legs, or the local prefill's one."""
        if self.local:
            return await open_leg(self.prefill, out, out.body)
        return await gw.protocol.exchange(out, self.prefill, self.decode)

    def end(self, gw: Gateway) -> None:
        """Its load leaves the registry (whatever happened)."""
        gw.registry.end_prefill(self.prefill.name, self.request_id)
        gw.registry.end_decode(self.decode_name, self.request_id)

    def succeeded(self, gw: Gateway) -> None:
        """Passive outlier detection: every instance it used served it."""
        gw.registry.report_result(self.prefill.name, True)
        if self.decode is not None:
            gw.registry.report_result(self.decode.name, True)


async def dispatch(
    gw: Gateway, routed: Routed, request_id: str, client: ClientState, output_tokens: int, *, may_pull: bool = True
) -> Dispatch:
    """Check the chosen prefill can take it, then account its load (prefill work, a decode stream
    of `output_tokens` at most) and tell the analyzer; `Dispatch.end` undoes the accounting.
    `may_pull`: the exchange can carry the decision's pull (a batch's per-prompt legs cannot)."""
    decision = routed.decision
    assert decision.prefill is not None
    states = gw.registry.states
    local = decision.prefilled_on_decode
    prefill = states[decision.prefill].target
    decode = states[decision.decode].target if decision.decode and not local else None
    if not local and not gw.protocol.ready(prefill):
        raise NoHealthyInstance(f"prefill instance {prefill.name} is not ready (bootstrap not answered)")
    client.prefill, client.decode = prefill.name, decode.name if decode else None
    analysis = routed.analysis
    cached = analysis.cached.get(prefill.name)
    local_cached = predicted = cached.tokens if cached else 0
    pull = stage = None
    offer = routed.readback
    source, view = decision.pull_from, routed.view
    min_gain = gw.settings.pd_pull_min_tokens  # vLLM pulls nothing smaller (kv_recompute_threshold)
    if not may_pull or source is None or local:
        pass
    elif offer is not None and gw.readback is not None and source == offer.handle.instance:
        # the policy chose to pull the last turn's KV from that decode: a handle serves once
        size = view.block_size
        tokens = pull_tokens_for(offer, analysis.prompt_tokens, size)
        if tokens - local_cached >= min_gain:  # else vLLM would not pull it: the handle stays for another turn
            handle = gw.readback.take(offer)
            if handle is None:
                gw.metrics.readback.labels("lost").inc()  # another request took it first
            else:
                pull = handle.params(tokens // size, size)
                predicted = max(predicted, tokens)
                gw.metrics.readback.labels("pulled").inc()
    elif source in view.queued_pull_sources and view.pull_sources is not None:
        tokens = view.pull_sources.get(source, 0)
        # the holder keeps a staged prefix for its lease only: the prefill must read it before then
        late = (decision.predicted_ttft_s or 0.0) > gw.settings.pd_peer_pull_lease_s / 2
        if tokens - local_cached < min_gain or late:
            gw.metrics.peer_pull.labels("skipped").inc()
        else:
            stage = (source, tokens)
            predicted = tokens
    d = Dispatch(
        request_id, prefill, decode, decode.name if decode else prefill.name, predicted, pull, local_cached, stage, local
    )
    gw.registry.add_prefill(prefill.name, request_id, analysis.prompt_tokens - predicted, predicted)
    gw.registry.add_decode(d.decode_name, request_id, analysis.prompt_tokens, output_tokens)
    await gw.analyzer.on_dispatch(analysis, decision)
    return d


async def run_attempt(gw: Gateway, routed: Routed, out: Outgoing, send: Send, client: ClientState, arrived: float) -> int:
    """Serve `routed` on its instances; the HTTP status sent. Raises UpstreamError when a leg
    fails (before or after bytes reached the client: the caller looks at `client`)."""
    request_id = out.request_id
    analysis = routed.analysis
    d = await dispatch(gw, routed, request_id, client, routed.view.max_tokens)
    prefill, decode, decode_name, predicted_cached = d.prefill, d.decode, d.decode_name, d.predicted_cached
    if d.pull is not None:
        out = replace(out, pull=d.pull)
    elif d.stage is not None:
        try:
            async with asyncio.timeout(gw.settings.pd_peer_pull_lease_s / 2):
                staged = await stage_prefix(gw, d.stage[0], out, analysis, d.stage[1])
        except TimeoutError:
            gw.metrics.peer_pull.labels("stage_failed").inc()
            log.warning(
                "request %s: staging on %s took over %.1f s; the prefill computes the prefix",
                request_id,
                d.stage[0],
                gw.settings.pd_peer_pull_lease_s / 2,
            )
            staged = None
        if staged is None:
            predicted_cached = d.local_cached
        else:
            out = replace(out, pull=staged)
    joined = gw.registry.states[decode_name]  # the others already decoding there (this replica's)
    others = [a for rid, a in joined.decodes.items() if rid != request_id]
    batch, resident = len(others), sum(a.context_tokens for a in others)
    loop = asyncio.get_running_loop()
    started_ns = time.time_ns()
    exchange: Exchange | None = None
    stats = StreamStats()
    ok = False
    cached_reported: int | None = None
    try:
        try:
            exchange = await d.open(gw, out)
        except UpstreamError as exc:
            if not pull_failed(out, exc, prefill.name):
                count_failure(gw, exc)
                raise
            # the prefill could not read the decode's KV (a NIXL handshake or transfer failure fails
            # the request there, vLLM's default kv_load_failure_policy): not the prefill's fault, and
            # nothing was computed, so the same prefill computes the prefix itself instead
            (gw.metrics.peer_pull if d.stage is not None else gw.metrics.readback).labels("failed").inc()
            log.warning(
                "request %s: %s could not pull the prefix from %s (%s); computing it there instead",
                request_id,
                prefill.name,
                routed.decision.pull_from,
                exc,
            )
            out = replace(out, pull=None)
            predicted_cached = d.local_cached
            try:
                exchange = await gw.protocol.exchange(out, prefill, decode)
            except UpstreamError as again:
                count_failure(gw, again)
                raise
        if exchange.prefill_s is not None:  # sequential prefill (nixl) is over
            gw.registry.end_prefill(prefill.name, request_id)
            gw.registry.mark_decoding(decode_name, request_id)
            gw.metrics.prefill_leg.labels(prefill.name).observe(exchange.prefill_s)
            gw.observe_prefill_leg(
                PrefillLeg(request_id, prefill.name, analysis.prompt_tokens, exchange.prefill_cached_tokens, exchange.prefill_s)
            )
        if exchange.reply is not None:
            reply = exchange.reply
            await send(
                {
                    "type": "http.response.start",
                    "status": reply.status,
                    "headers": [(b"content-type", reply.content_type.encode()), *id_headers(out)],
                }
            )
            client.response_started = client.response_done = True
            await send({"type": "http.response.body", "body": reply.body})
            stats.first_token = loop.time()
            if reply.status == 200:
                try:
                    answer = decode_json(reply.body)
                except ValueError:
                    answer = None
                cached_reported = cached_tokens_of(answer)
                if exchange.decode_kv_params is not None:
                    keep_readback(gw, decode_name, analysis.block_keys, exchange.decode_kv_params)
                usage = answer.get("usage") if isinstance(answer, dict) else None
                prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
                stats.usage_prompt_tokens = prompt_tokens if type(prompt_tokens) is int else None
            ok = reply.status == 200
            status = reply.status
        else:
            assert exchange.stream is not None
            upstream = exchange.stream
            await send(
                {
                    "type": "http.response.start",
                    "status": upstream.status,
                    "headers": [
                        (b"content-type", upstream.content_type.encode()),
                        (b"cache-control", b"no-cache"),
                        *id_headers(out),
                    ],
                }
            )
            client.response_started = True
            unaccounted = 0  # tokens relayed and not yet added to the stream's context in the registry
            async for chunk in upstream.chunks():
                now = loop.time()
                events = stats.see(chunk, now)
                if events and stats.first_token is None:
                    stats.first_token = now
                    gw.registry.end_prefill(prefill.name, request_id)
                    gw.metrics.ttft.observe(now - arrived)
                    # the batch it really joined: streams decoding there now, not those listed at
                    # dispatch (some still in prefill then, some gone by now) -- the TBT fit
                    others = [d for rid, d in joined.decodes.items() if rid != request_id and d.decoding]
                    batch, resident = len(others), sum(d.context_tokens for d in others)
                unaccounted += events
                if unaccounted >= _ADVANCE_EVERY:
                    gw.registry.advance_decode(decode_name, request_id, unaccounted)
                    unaccounted = 0
                client.response_done = client.response_done or stats.done
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if exchange.prefill_failed is not None and not stats.done:
                raise exchange.prefill_failed  # the decode was cut because its KV never came
            client.response_done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            cached_reported = stats.usage_cached_tokens
            ok = True
            status = upstream.status
        await settle_prefill(gw, exchange, prefill.name)
        if stats.intervals:
            gw.metrics.tbt.observe(sum(stats.intervals) / len(stats.intervals))
        if ok:
            d.succeeded(gw)
        return status
    except BaseException:
        if exchange is not None:
            exchange.abort()
        raise
    finally:
        d.end(gw)
        if gw.tracing is not None:
            trace_legs(gw, exchange, started_ns, prefill.name, decode.name if decode else None, ok)
        reported = exchange.prefill_cached_tokens if exchange and exchange.prefill_cached_tokens is not None else cached_reported
        output = stats.usage_completion_tokens if stats.usage_completion_tokens is not None else stats.tokens
        gw.observe(
            routed,
            Observation(
                request_id=request_id,
                prefill=prefill.name,
                decode=decode.name if decode else None,
                prompt_tokens=analysis.prompt_tokens,
                cached_tokens=reported,
                predicted_cached_tokens=predicted_cached,
                queue_and_prefill_s=exchange.prefill_s if exchange else None,
                ttft_s=(stats.first_token - arrived) if (stats.first_token is not None and out.stream) else None,
                token_intervals_s=tuple(stats.intervals),
                output_tokens=output,
                decode_batch=batch,
                decode_resident_kv_tokens=resident,
                ok=ok,
                reported_prompt_tokens=stats.usage_prompt_tokens,  # the worker's count: tells a tokenizer mismatch
            ),
        )


def pull_failed(out: Outgoing, exc: UpstreamError, prefill: str) -> bool:
    """A prefill leg that carried a pull answered 5xx: the pull may be what failed."""
    return out.pull is not None and exc.instance == prefill and (exc.upstream_status or 0) >= 500


def keep_readback(gw: Gateway, decode: str, prompt_keys: tuple[int, ...], params: Any) -> None:
    """File a bidirectional decode's pinned KV for the next turn (conductor/routing/readback.py)."""
    if gw.readback is None or not prompt_keys:
        return
    handle = parse_decode_params(decode, params, len(prompt_keys), gw.readback.now())
    if handle is None:
        gw.metrics.readback.labels("unusable").inc()
        return
    gw.readback.record(prompt_keys, handle)
    gw.metrics.readback.labels("recorded").inc()


def id_headers(out: Outgoing) -> list[tuple[bytes, bytes]]:
    return [(b"x-request-id", out.client_request_id.encode())]


def count_failure(gw: Gateway, exc: UpstreamError) -> None:
    """A leg failed: metrics, and passive outlier detection (a worker's 4xx is the client's fault)."""
    if exc.client_fault or not exc.instance or isinstance(exc, UpstreamPoolExhausted):
        return  # the client's fault, or our own pool to it full: nothing wrong with the worker
    gw.metrics.upstream_errors.labels(exc.instance, "status" if exc.upstream_status else "transport").inc()
    if exc.upstream_status is None and not exc.maybe_processed:
        gw.registry.report_failure(exc.instance)  # could not even connect: like a failed probe
    if gw.registry.report_result(exc.instance, False):
        gw.metrics.ejections.labels(exc.instance).inc()


async def settle_prefill(gw: Gateway, exchange: Exchange, prefill: str) -> None:
    """The client has its answer; a concurrent prefill leg still out is waited for a bounded time
    (to learn its timing and cached tokens), then closed. Its failure now harms nobody: counted."""
    if not exchange.pending:
        return
    timeout = min(PREFILL_SETTLE_S, gw.settings.read_timeout_s)
    if not await exchange.settle(timeout) or exchange.prefill_failed is not None:
        gw.metrics.late_prefill_failures.labels(prefill).inc()


def trace_legs(gw: Gateway, exchange: Exchange | None, started_ns: int, prefill: str, decode: str | None, ok: bool) -> None:
    """The legs as spans, timed from what the exchange measured: sequential (nixl) prefill then
    decode; concurrent (mooncake, sglang) both from dispatch; mixed: one leg."""
    assert gw.tracing is not None
    end = time.time_ns()
    prefill_s = exchange.prefill_s if exchange is not None else None
    prefill_end = started_ns + int(prefill_s * 1e9) if prefill_s is not None else end
    concurrent = gw.protocol.name in ("mooncake", "sglang")
    gw.tracing.leg(
        "conductor.prefill_leg" if decode else "conductor.leg",
        prefill,
        started_ns,
        prefill_end if decode else end,
        {"conductor.ok": ok, "conductor.prefill_s": prefill_s},
    )
    if decode is not None:
        gw.tracing.leg("conductor.decode_leg", decode, started_ns if concurrent else prefill_end, end, {"conductor.ok": ok})
