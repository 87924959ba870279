"""The gateway's Prometheus metrics, on a registry the app owns (never the global one, so two
gateways in one process, as in tests, keep their own counts). Counters and histograms are updated
on the request path, on the event loop's thread: they are conductor.ops.loop_metrics' lock-free kind;
gauges are set by the background probes and stay prometheus_client's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, Metric

from conductor.ops.loop_metrics import LoopCounter, LoopHistogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._requests(self.registry)
        self._pd(self.registry)
        self._latencies(self.registry)
        self._instances(self.registry)

    def _requests(self, r: CollectorRegistry) -> None:
        """What became of the requests: answered, refused, decided, failed over, cut."""
        self.requests = LoopCounter(
            "conductor_requests", "Requests answered, by route and HTTP status", ["route", "status"], registry=r
        )
        # by model (served names the gateway knows only, so the labels stay bounded); the other
        # families carry no model label, which would multiply their series and break dashboards
        self.model_requests = LoopCounter(
            "conductor_model_requests", "Requests answered, by model served and HTTP status", ["model", "status"], registry=r
        )
        self.rejections = LoopCounter(
            "conductor_rejections", "Requests refused before forwarding, by reason", ["reason"], registry=r
        )
        # priority classes and tenants as the settings name them (priority.classes, auth.tenants), never a client's string
        self.priority_requests = LoopCounter(
            "conductor_priority_requests", "Requests answered, by priority class and HTTP status", ["class", "status"], registry=r
        )
        self.tenant_rejections = LoopCounter(
            "conductor_tenant_rejections",
            "Tenants' requests refused (429, or 503 at the in-flight limit), by tenant and reason",
            ["tenant", "reason"],
            registry=r,
        )
        self.decisions = LoopCounter(
            "conductor_decisions",
            "Routing decisions, by policy and chosen instances",
            ["policy", "prefill", "decode"],
            registry=r,
        )
        self.upstream_errors = LoopCounter(
            "conductor_upstream_errors", "Failed upstream legs, by instance and kind", ["instance", "kind"], registry=r
        )
        self.cancelled = LoopCounter(
            "conductor_client_disconnects", "Requests whose client went away before the answer ended", registry=r
        )
        self.cached_tokens = LoopCounter(
            "conductor_prompt_tokens",
            "Prompt tokens routed, by whether the worker reported them cached",
            ["source"],
            registry=r,
        )

    def _pd(self, r: CollectorRegistry) -> None:
        """Prefix pulls between P/D instances: decode readbacks and prefill-to-prefill pulls."""
        self.readback = LoopCounter(
            "conductor_pd_readback",
            "Decode readbacks (NIXL bidirectional KV transfer): handles recorded from decode "
            "answers, unusable ones, pulls handed to a prefill, handles another request took first, and pulls that failed "
            "(the prefill then computed the prefix itself)",
            ["event"],
            registry=r,
        )
        for event in ("recorded", "unusable", "pulled", "lost", "failed"):
            self.readback.labels(event)
        self.peer_pull = LoopCounter(
            "conductor_pd_peer_pull",
            "Prefill-to-prefill pulls (conductor/routing/peer_pull.py): staging requests whose "
            "holder pinned the prefix (staged), that failed or answered no usable blocks (stage_failed: the prefill "
            "computed the prefix itself), pulls planned and not staged (skipped: below pd.pull_min_tokens, or "
            "predicted to outlast the holder's lease), and staged pulls whose prefill failed to read (failed)",
            ["event"],
            registry=r,
        )
        for event in ("staged", "stage_failed", "skipped", "failed"):
            self.peer_pull.labels(event)
        self.peer_pull_stage = LoopHistogram(
            "conductor_pd_peer_pull_stage_seconds",
            "Staging requests of prefill-to-prefill pulls: sent to the holder to answered (its queue, one token, the pin)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _latencies(self, r: CollectorRegistry) -> None:
        """Latencies at the gateway, and what the policy predicted of them."""
        self.ttft = LoopHistogram(
            "conductor_ttft_seconds", "Time to first token at the gateway (streams)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.predicted_ttft = LoopHistogram(
            "conductor_predicted_ttft_seconds",
            "TTFT the policy predicted for admitted requests",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_leg = LoopHistogram(
            "conductor_prefill_leg_seconds",
            "Prefill leg duration (queue + prefill) by instance",
            ["instance"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = LoopHistogram(
            "conductor_tbt_seconds", "Mean time between tokens of each stream", buckets=_TBT_BUCKETS, registry=r
        )
        self.e2e = LoopHistogram("conductor_request_seconds", "Arrival to last byte", buckets=_LATENCY_BUCKETS, registry=r)
        # requests refused for their TBT that wait for streams to end instead (conductor/routing/waiting_room.py)
        self.hold_time = LoopHistogram(
            "conductor_hold_seconds",
            "Time requests waited at the gateway for streams to end, by how the wait ended",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.held_requests = Gauge("conductor_held_requests", "Requests waiting at the gateway now", registry=r)
        self.decision_time = LoopHistogram(
            "conductor_decision_seconds",
            "Time to analyse a prompt and decide",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
            registry=r,
        )

    def _instances(self, r: CollectorRegistry) -> None:
        """Per instance: health, in-flight load, prediction quality, failovers and ejections."""
        self.instance_healthy = Gauge(
            "conductor_instance_healthy", "1 if the instance answers its health probe", ["instance", "role"], registry=r
        )
        self.queued_prefill_tokens = Gauge(
            "conductor_instance_queued_prefill_tokens",
            "Prefill tokens this gateway has in flight per instance",
            ["instance"],
            registry=r,
        )
        self.running_decodes = Gauge(
            "conductor_instance_running_decodes",
            "Decode streams this gateway has in flight per instance",
            ["instance"],
            registry=r,
        )
        self.prediction_mape = Gauge(
            "conductor_prediction_mape",
            "Mean absolute percentage error of a predictor over its recent window",
            ["component", "instance"],
            registry=r,
        )
        self.prediction_coverage = Gauge(
            "conductor_prediction_p90_coverage",
            "Fraction of actuals at or under the predicted p90 (ideal 0.9)",
            ["component", "instance"],
            registry=r,
        )
        self.prediction_samples = Gauge(
            "conductor_prediction_samples",
            "Observations in a predictor's error window",
            ["component", "instance"],
            registry=r,
        )
        self.failovers = LoopCounter(
            "conductor_failovers",
            "Requests decided again on another instance after a leg failed before any byte "
            "reached the client, by the instance that failed and why",
            ["instance", "reason"],
            registry=r,
        )
        self.ejections = LoopCounter(
            "conductor_instance_ejections",
            "Times an instance was ejected as an outlier (consecutive failures)",
            ["instance"],
            registry=r,
        )
        self.late_prefill_failures = LoopCounter(
            "conductor_late_prefill_failures",
            "Concurrent prefill legs that failed or were cut after their decode had already answered the client in full",
            ["instance"],
            registry=r,
        )


class _Counted(Protocol):
    counts: Counter[str]


class LessonMetrics:
    """conductor_worker_lessons_total{event}: predictor lessons this process sent to its sibling
    worker processes, received and learned from them, dropped (a sibling not there or not keeping
    up) and refused (malformed), read from the lesson share's counts when scraped."""

    EVENTS = ("sent", "received", "dropped", "refused")

    def __init__(self, share: _Counted) -> None:
        self._share = share

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "conductor_worker_lessons",
            "Predictor lessons shared between the gateway's worker processes, by event",
            labels=["event"],
        )
        for event in self.EVENTS:
            family.add_metric([event], self._share.counts[event])
        yield family
