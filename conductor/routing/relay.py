"""One attempt at serving a routed request: account the load, run the P/D exchange, relay the
answer to the client as it arrives, and tell the router what happened.

`conductor/server/endpoint.py` owns the request's life (validation, admission, failover between attempts,
the deadline); `Relay` owns one attempt on the instances one decision chose. Every attempt, single
or batched (conductor/routing/batch_relay.py), runs the same skeleton (`Relay.run`): dispatched
(`Relay.dispatch`: load accounted, pull planned), served, its late legs settled; whatever
happens its load leaves the registry and the router observes it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from adapters.pd.base import Exchange, Outgoing, PDProtocol, cached_tokens_of, decode_json
from conductor.config.settings import Settings
from conductor.core.errors import NoHealthyInstance, UpstreamError
from conductor.core.types import PrefillLeg
from conductor.fleet.instances import InstanceRegistry, InstanceState
from conductor.kv.analysis import PromptAnalyzer
from conductor.ops.metrics import GatewayMetrics
from conductor.ops.tracing import Tracing, usage_attributes
from conductor.routing.adapter_loads import AdapterLoads
from conductor.routing.attempt import Attempt, Dispatch, count_failure
from conductor.routing.pulls import PullPlanner
from conductor.routing.router import Routed, Router
from conductor.routing.streams import ClientState, Send, end_stream, send_whole, start_stream, with_cached_tokens

log = logging.getLogger(__name__)

# a stream's context in the registry grows every this many tokens, not every token: a few tokens of
# lag against contexts of thousands change no prediction, and a registry write per token cost ~2% of
# the gateway's CPU on 32-token streams (profiled)
_ADVANCE_EVERY = 8
# a concurrent prefill leg still running when its decode has answered in full: how long to wait
# for its answer (only to learn from it) before closing it; the client is never kept waiting
PREFILL_SETTLE_S = 5.0


class Relay:
    """Attempts on the instances a decision chose, with the collaborators they need."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: InstanceRegistry,
        protocol: PDProtocol,
        router: Router,
        pulls: PullPlanner,
        analyzer: PromptAnalyzer,
        metrics: GatewayMetrics,
        tracing: Tracing | None,
        adapter_loads: AdapterLoads | None = None,
        freed: Callable[[], None] | None = None,
    ) -> None:
        """adapter_loads: the LoRA adapters loaded on the chosen instances before a request that
        names one goes there (conductor/routing/adapter_loads.py); None: none is ever loaded."""
        self.settings = settings
        self.adapter_loads = adapter_loads
        self.registry = registry
        self.protocol = protocol
        self.router = router
        self.pulls = pulls
        self.analyzer = analyzer
        self.metrics = metrics
        self.tracing = tracing
        self._freed = freed  # told when an attempt's load leaves the registry (waiting_room.py)

    # ---- the skeleton -----------------------------------------------------------------------
    async def dispatch(
        self, routed: Routed, out: Outgoing, client: ClientState, arrived: float, output_tokens: int, *, batched: bool = False
    ) -> Attempt:
        """Check the chosen prefill can take it, plan its pull, then account its load (prefill work,
        a decode stream of `output_tokens` at most) and tell the analyzer; `Relay.run` undoes the
        accounting. A batch's per-prompt legs cannot carry the decision's pull."""
        decision = routed.decision
        assert decision.prefill is not None
        states = self.registry.states
        local = decision.prefilled_on_decode
        prefill = states[decision.prefill].target
        decode = states[decision.decode].target if decision.decode and not local else None
        # a mixed worker (one leg, no decode: a mixed pool beside P/D pools) has no P/D handshake
        if not local and decode is not None and not self.protocol.ready(prefill):
            raise NoHealthyInstance(f"prefill instance {prefill.name} is not ready (bootstrap not answered)")
        client.prefill, client.decode = prefill.name, decode.name if decode else None
        analysis = routed.analysis
        cached = analysis.cached.get(prefill.name)
        plan = self.pulls.plan(decision, routed.view, routed.pulls, cached.tokens if cached else 0, may_pull=not batched)
        request_id = out.request_id
        d = Dispatch(request_id, prefill, decode, decode.name if decode else prefill.name, plan, local)
        predicted = plan.predicted_cached
        legs = None
        if self.tracing is not None:  # each leg's span starts as the protocol sends it
            legs = self.tracing.legs({"prefill": prefill.name, "decode": d.decode_name}, one_leg=decode is None)
            out = replace(out, leg_headers=legs.headers)
        # its end is seen at a streamed first token, or at a sequential (nixl) prefill's answer; a
        # batch's prefills leave together, once every leg has answered (batch_relay.py)
        end_seen = out.stream or (decode is not None and self.protocol.prefill_answers_first and not batched)
        self.registry.add_prefill(prefill.name, request_id, analysis.prompt_tokens - predicted, predicted, end_seen)
        self.registry.add_decode(d.decode_name, request_id, analysis.prompt_tokens, output_tokens)
        await self.analyzer.on_dispatch(analysis, decision)
        return Attempt(routed, out, d, arrived, predicted, batched=batched, legs=legs)

    async def run(self, a: Attempt, serve: Callable[[Attempt], Awaitable[int]]) -> int:
        """Serve a dispatched attempt; the HTTP status sent. Raises UpstreamError when a leg fails
        (before or after bytes reached the client: the caller looks at its ClientState)."""
        try:
            if self.adapter_loads is not None:  # its LoRA adapter loaded where it goes (a batch's too)
                d = a.dispatch
                await self.adapter_loads.ensure(d.request_id, a.routed.view.model, (d.prefill.name, d.decode_name))
            status = await serve(a)
            for exchange in a.exchanges:
                await self._settle(exchange, a.dispatch.prefill.name)
            if a.stats.intervals and not a.batched:
                self.metrics.tbt.observe(sum(a.stats.intervals) / len(a.stats.intervals))
            if a.ok:
                a.dispatch.succeeded(self.registry)
            return status
        except BaseException:
            for exchange in a.exchanges:
                exchange.abort()
            raise
        finally:
            a.dispatch.end(self.registry)
            if self._freed is not None:
                self._freed()
            if self.adapter_loads is not None:
                self.adapter_loads.release(a.dispatch.request_id)
            if self.tracing is not None:
                self._trace(a, self.tracing)
            self.router.observe(a.routed, a.observation())

    def count_failure(self, exc: UpstreamError) -> None:
        count_failure(self.metrics, self.registry, exc)

    def prefill_over(self, d: Dispatch) -> None:
        """The prefill leg answered before the decode started (sequential P/D): its load moves on."""
        self.registry.end_prefill(d.prefill.name, d.request_id)
        self.registry.mark_decoding(d.decode_name, d.request_id)

    def _prefill_answered(self, d: Dispatch, prompt_tokens: int, elapsed_s: float, cached_tokens: int | None) -> None:
        """A sequential prefill leg (nixl) answered: its load moves on and its leg is learned now,
        before the decode leg is even sent (a non-streamed decode answers at its last token)."""
        self.prefill_over(d)
        self.metrics.prefill_leg.labels(d.prefill.name).observe(elapsed_s)
        self.router.observe_prefill_leg(PrefillLeg(d.request_id, d.prefill.name, prompt_tokens, cached_tokens, elapsed_s))

    def _first_token_leg(self, a: Attempt, now: float) -> None:
        """A mixed worker's first token ends its leg (queue, the prompt's chunks, the step that
        samples it): learned now, not at the stream's end, when under a surge it came seconds late.
        Timed from arrival, as the Observation's ttft_s that repeats it: the leg model is the whole
        TTFT prediction on a mixed worker (no decode-leg term takes the gateway's own time before
        the dispatch, as on P/D). Its cached tokens come with the last chunk: not known yet."""
        d, prompt_tokens = a.dispatch, a.routed.analysis.prompt_tokens
        leg_s = now - a.arrived - a.routed.held_s  # from admission: a held request's wait is not the worker's
        self.router.observe_prefill_leg(PrefillLeg(d.request_id, d.prefill.name, prompt_tokens, None, leg_s))

    # ---- one request, one exchange ----------------------------------------------------------
    async def attempt(self, routed: Routed, out: Outgoing, send: Send, client: ClientState, arrived: float) -> int:
        """Serve `routed` on its instances; the HTTP status sent (see `run`)."""
        a = await self.dispatch(routed, out, client, arrived, routed.view.max_tokens)
        return await self.run(a, lambda started: self._serve(started, send, client))

    async def _serve(self, a: Attempt, send: Send, client: ClientState) -> int:
        d = a.dispatch
        if d.pull.pulls:  # else the request goes as it is, holding what dispatch predicted
            a.out, a.predicted_cached = await self.pulls.prepare(d.pull, a.out, a.routed.analysis)
        # where it decodes: the batch it joins is read there at its first token (only a stream's
        # token gaps teach the TBT fit, policies/kvcache_aware/learning.py)
        joined = self.registry.states[d.decode_name]
        if d.decode is not None and not d.local:  # P/D: told as the prefill answers (nixl), not the decode
            # bound to the dispatch, not the attempt: the attempt holds `out` (no reference cycle)
            a.out = replace(a.out, prefill_answered=functools.partial(self._prefill_answered, d, a.routed.analysis.prompt_tokens))
        exchange = await self._open(a)
        a.exchanges.append(exchange)
        if exchange.reply is not None:
            return await self._relay_reply(a, exchange, send, client)
        return await self._relay_stream(a, exchange, joined, send, client)

    async def _open(self, a: Attempt) -> Exchange:
        """The exchange; a prefill that could not read the planned pull computes the prefix itself."""
        d = a.dispatch
        try:
            return await d.open(self.protocol, a.out)
        except UpstreamError as exc:
            if not self.pulls.pull_failed(a.out, exc, d.prefill.name):
                self.count_failure(exc)
                raise
            a.out = self.pulls.fall_back(d.pull, a.out, exc, a.routed.decision.pull_from)
            a.predicted_cached = d.pull.local_cached
        try:
            return await self.protocol.exchange(a.out, d.prefill, d.decode)
        except UpstreamError as again:
            self.count_failure(again)
            raise

    async def _relay_reply(self, a: Attempt, exchange: Exchange, send: Send, client: ClientState) -> int:
        """A non-streamed answer, as the worker wrote it (the decode's readback params taken off)."""
        reply = exchange.reply
        assert reply is not None
        body = reply.body
        if reply.status == 200 and a.dispatch.decode is not None:  # P/D: the prefill's cached tokens
            body = await self.client_usage(a, exchange, body)
        await send_whole(send, client, a.out, reply.status, reply.content_type, body)
        a.stats.first_token = asyncio.get_running_loop().time()
        if reply.status == 200:
            try:
                answer = decode_json(reply.body)
            except ValueError:
                answer = None
            a.cached_reported = cached_tokens_of(answer)
            if exchange.decode_kv_params is not None:
                self.pulls.keep(a.dispatch.decode_name, a.routed.analysis.block_keys, exchange.decode_kv_params)
            usage = answer.get("usage") if isinstance(answer, dict) else None
            if isinstance(usage, dict):
                prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
                a.stats.usage_prompt_tokens = prompt_tokens if type(prompt_tokens) is int else None
                a.stats.usage_completion_tokens = completion_tokens if type(completion_tokens) is int else None
        a.ok = reply.status == 200
        return reply.status

    async def _relay_stream(self, a: Attempt, exchange: Exchange, joined: InstanceState, send: Send, client: ClientState) -> int:
        """A streamed answer, chunk by chunk as it arrives; the registry follows its context."""
        upstream = exchange.stream
        assert upstream is not None
        await start_stream(send, client, a.out, upstream.status, upstream.content_type)
        loop = asyncio.get_running_loop()
        stats, registry, d = a.stats, self.registry, a.dispatch
        request_id, decode_name = d.request_id, d.decode_name
        unaccounted = 0  # tokens relayed and not yet added to the stream's context in the registry
        first_at = 0.0  # the first token's time on the registry's clock (time.monotonic, as its snapshots)
        async for chunk in upstream.chunks():
            now = loop.time()
            events = stats.see(chunk, now)
            if events and stats.first_token is None:
                stats.first_token, first_at = now, time.monotonic()
                registry.end_prefill(d.prefill.name, request_id)
                self.metrics.ttft.observe(now - a.arrived)
                # the batch it really joined: streams decoding there now, not those listed at
                # dispatch (some still in prefill then, some gone by now) -- the TBT fit
                others = [s for rid, s in joined.decodes.items() if rid != request_id and s.decoding]
                a.decode_batch, a.decode_resident = len(others), sum(s.context_tokens for s in others)
                if d.decode is None and not d.local:  # a mixed worker: its first token ends its prefill
                    self._first_token_leg(a, now)
            unaccounted += events
            if unaccounted >= _ADVANCE_EVERY:
                registry.advance_decode(decode_name, request_id, unaccounted, first_at)
                unaccounted = 0
            client.response_done = client.response_done or stats.done
            if b'"cached_tokens"' in chunk:  # the usage: the prefill's cached tokens, not the decode's
                chunk = await self.client_usage(a, exchange, chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if exchange.prefill_failed is not None and not stats.done:
            raise exchange.prefill_failed  # the decode was cut because its KV never came
        await end_stream(send, client)
        a.cached_reported = stats.usage_cached_tokens
        a.ok = True
        return upstream.status

    async def client_usage(self, a: Attempt, exchange: Exchange, data: bytes) -> bytes:
        """`data` (an answer, or a chunk of one) with the usage's cached tokens the prefill leg's.
        A P/D decode computed nothing of the prompt: it counts every prompt token it received over
        the KV transfer as cached, so its figure says 100% on any prompt; the prefill's says what
        its prefix cache (and a pull) saved. A concurrent prefill (mooncake, sglang) still out is
        waited for a bounded time; when the prefill told none, the answer is left as it is."""
        d = a.dispatch
        if d.decode is None or b'"cached_tokens"' not in data:
            return data  # one leg: the worker's own figure is the answer's
        running = [task for task in exchange.pending if not task.done()]
        if exchange.prefill_cached_tokens is None and running:
            await asyncio.wait(running, timeout=min(PREFILL_SETTLE_S, self.settings.timeouts.read_s))
        cached = exchange.prefill_cached_tokens
        return data if cached is None else with_cached_tokens(data, cached)

    # ---- after the answer -------------------------------------------------------------------
    async def _settle(self, exchange: Exchange, prefill: str) -> None:
        """The client has its answer; a concurrent prefill leg still out is waited for a bounded time
        (to learn its timing and cached tokens), then closed. Its failure now harms nobody: counted."""
        if not exchange.pending:
            return
        timeout = min(PREFILL_SETTLE_S, self.settings.timeouts.read_s)
        if not await exchange.settle(timeout) or exchange.prefill_failed is not None:
            self.metrics.late_prefill_failures.labels(prefill).inc()

    @staticmethod
    def _trace(a: Attempt, tracing: Tracing) -> None:
        """Its legs' spans ended (a sequential prefill leg when it answered) and what it served on
        the request's span: tokens in and out, and the TTFT of a stream."""
        if a.legs is not None:
            prefill_s = a.exchanges[0].prefill_s if len(a.exchanges) == 1 else None
            a.legs.end(a.ok, prefill_s)
        stats = a.stats
        prompt_tokens = stats.usage_prompt_tokens or a.routed.analysis.prompt_tokens
        output_tokens = stats.usage_completion_tokens if stats.usage_completion_tokens is not None else stats.tokens
        streamed = a.out.stream and stats.first_token is not None
        ttft_s = stats.first_token - a.arrived if streamed and stats.first_token is not None else None
        tracing.annotate(usage_attributes(prompt_tokens, output_tokens if a.ok else None, ttft_s))
