"""One attempt's place on the instances, what it saw, and its failures classified: shared by the
single relay (conductor/routing/relay.py), the batched one (batch_relay.py) and the endpoint that
fails over between attempts (conductor/server/endpoint.py).

A worker's failure counts against the worker (`count_failure`), may let the request go to
another instance (`failover_reason`), and is told to the client (`for_client`). An UpstreamError's
message is for the gateway's log: it may carry what the transport said, which names the worker's
address ("cannot connect to 10.0.3.7:8100: [Errno 111] ..."). Workers' addresses are not the
client's business, so a client sees the instance's name and the kind of failure only; the
endpoint logs the whole message beside it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from adapters.pd.base import Exchange, Outgoing, PDProtocol, Target, open_leg
from adapters.upstream import UpstreamPoolExhausted
from conductor.core.errors import UpstreamError, UpstreamTimeout
from conductor.core.fast_init import fast_init
from conductor.core.types import Observation
from conductor.fleet.instances import InstanceRegistry
from conductor.ops.metrics import GatewayMetrics
from conductor.ops.tracing import LegSpans
from conductor.routing.pulls import PullPlan
from conductor.routing.router import Routed
from conductor.routing.streams import StreamStats


@fast_init
@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where an attempt went and what it pulls; its load is in the registry until `end`."""

    request_id: str
    prefill: Target
    decode: Target | None
    decode_name: str  # where it decodes: the decode instance, or the mixed worker itself
    pull: PullPlan  # what the prefill holds and pulls (conductor/routing/pulls.py)
    # the decode instance prefills it itself (policies/local_prefill.py): one plain leg, as to a
    # mixed worker, with no kv_transfer_params (a vLLM kv_both engine then computes the prompt)
    local: bool = False

    def open(self, protocol: PDProtocol, out: Outgoing) -> Coroutine[Any, Any, Exchange]:
        """Start the exchange on its instances: the protocol's legs, or one plain leg when the
        decode prefills it itself or the instance is a mixed worker (a mixed pool beside P/D ones).
        The leg's own coroutine, not one wrapped around it: the caller awaits it directly."""
        if self.local or self.decode is None:
            return open_leg(self.prefill, out, out.body)
        return protocol.exchange(out, self.prefill, self.decode)

    def end(self, registry: InstanceRegistry) -> None:
        """Its load leaves the registry (whatever happened)."""
        registry.end_prefill(self.prefill.name, self.request_id)
        registry.end_decode(self.decode_name, self.request_id)

    def succeeded(self, registry: InstanceRegistry) -> None:
        """Passive outlier detection: every instance it used served it."""
        registry.report_result(self.prefill.name, True)
        if self.decode is not None:
            registry.report_result(self.decode.name, True)


@dataclass(slots=True)
class Attempt:
    """One attempt in progress: what it sent, what came back, what to learn from it."""

    routed: Routed
    out: Outgoing  # as sent: with the pull it carries, if any
    dispatch: Dispatch
    arrived: float  # the request's arrival, on the loop's clock
    predicted_cached: int  # leading tokens the prefill holds when it starts: its cache and the pull
    batched: bool = False  # one exchange per prompt of a batch (batch_relay.py)
    exchanges: list[Exchange] = field(default_factory=list)
    stats: StreamStats = field(default_factory=StreamStats)
    ok: bool = False
    cached_reported: int | None = None  # cached tokens the decode's answer reported
    decode_batch: int = 0  # other streams decoding on its decode instance when it joined
    decode_resident: int = 0  # their context tokens
    legs: LegSpans | None = None  # its legs' spans, with tracing on (conductor/ops/tracing.py)

    def observation(self) -> Observation:
        """What the policy and the analyzer learn from it (conductor/routing/router.py, observe)."""
        if self.batched:
            return self._batch_observation()
        d, stats, analysis = self.dispatch, self.stats, self.routed.analysis
        exchange = self.exchanges[0] if self.exchanges else None
        reported = self.cached_reported
        if exchange is not None and exchange.prefill_cached_tokens is not None:
            reported = exchange.prefill_cached_tokens
        streamed = stats.first_token is not None and self.out.stream
        return Observation(
            request_id=d.request_id,
            prefill=d.prefill.name,
            decode=d.decode.name if d.decode else None,
            prompt_tokens=analysis.prompt_tokens,
            cached_tokens=reported,
            predicted_cached_tokens=self.predicted_cached,
            queue_and_prefill_s=exchange.prefill_s if exchange else None,
            # from its admission, as predicted (a held request's wait is not the instances'; its
            # view's TTFT SLO is what was left of it then)
            ttft_s=stats.first_token - self.arrived - self.routed.held_s if streamed and stats.first_token is not None else None,
            token_intervals_s=tuple(stats.intervals),
            output_tokens=stats.usage_completion_tokens if stats.usage_completion_tokens is not None else stats.tokens,
            decode_batch=self.decode_batch,
            decode_resident_kv_tokens=self.decode_resident,
            ok=self.ok,
            reported_prompt_tokens=stats.usage_prompt_tokens,  # the worker's count: tells a tokenizer mismatch
        )

    def _batch_observation(self) -> Observation:
        prefill_cached = [ex.prefill_cached_tokens for ex in self.exchanges if ex.prefill_cached_tokens is not None]
        prefill_times = [ex.prefill_s for ex in self.exchanges if ex.prefill_s is not None]
        return Observation(
            request_id=self.dispatch.request_id,
            prefill=self.dispatch.prefill.name,
            decode=self.routed.decision.decode,
            prompt_tokens=self.routed.analysis.prompt_tokens,
            cached_tokens=sum(prefill_cached) if prefill_cached else self.cached_reported,
            predicted_cached_tokens=self.predicted_cached,
            # the prompts ran as separate prefills: no single leg time to learn the model from
            queue_and_prefill_s=max(prefill_times) if len(prefill_times) == 1 else None,
            ttft_s=None,
            output_tokens=self.stats.tokens,
            ok=self.ok,
        )


# ---- failures ------------------------------------------------------------------------------
def count_failure(metrics: GatewayMetrics, registry: InstanceRegistry, exc: UpstreamError) -> None:
    """A leg failed: metrics, and passive outlier detection (a worker's 4xx is the client's fault)."""
    if exc.client_fault or not exc.instance or isinstance(exc, UpstreamPoolExhausted):
        return  # the client's fault, or our own pool to it full: nothing wrong with the worker
    metrics.upstream_errors.labels(exc.instance, "status" if exc.upstream_status else "transport").inc()
    if exc.upstream_status is None and not exc.maybe_processed:
        registry.report_failure(exc.instance)  # could not even connect: like a failed probe
    if registry.report_result(exc.instance, False):
        metrics.ejections.labels(exc.instance).inc()


def failover_reason(exc: UpstreamError) -> str | None:
    """Why another instance may be tried, or None when it may not: a worker's 5xx (it did not serve
    the request), or a connection that failed before any byte of the request can have reached the
    worker. Never after a timeout or a reset mid-answer: the work may be running there."""
    if exc.instance is None or exc.client_fault or isinstance(exc, UpstreamTimeout):
        return None
    if exc.upstream_status is not None:
        return "status" if exc.upstream_status >= 500 else None
    return None if exc.maybe_processed else "connect"


def failure_kind(exc: UpstreamError) -> str:
    """The kind of a worker's failure in a few words, with nothing of the transport's own text."""
    if isinstance(exc, UpstreamTimeout):
        return "did not answer in time"
    if isinstance(exc, UpstreamPoolExhausted):
        return "has no free connection"
    if exc.upstream_status is not None:
        return f"answered HTTP {exc.upstream_status}"
    if not exc.maybe_processed:
        return "could not be reached"
    return "failed while answering"  # a connection lost mid-answer, or an answer that is not JSON


def for_client(exc: UpstreamError) -> UpstreamError:
    """A worker's failure as the client may see it: the same class, status and code, a message
    naming the instance and the kind of failure only. A worker's 4xx is relayed as the worker wrote
    it, and an error that names no instance is the gateway's own (its deadline, a batch's merge):
    its message is the gateway's words, kept."""
    if exc.client_fault or exc.instance is None:
        return exc
    public = type(exc)(
        f"{exc.instance} {failure_kind(exc)}",
        upstream_status=exc.upstream_status,
        instance=exc.instance,
        maybe_processed=exc.maybe_processed,
    )
    if exc.param is not None:
        public.param = exc.param
    public.code = exc.code
    return public
