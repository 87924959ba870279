"""The gateway's parts, wired once at start-up: settings, instances, policy, prompt analysis,
P/D protocol and metrics. The HTTP layer (conductor/server/endpoint.py, conductor/server/app.py) only calls it."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapters.lesson_share import LessonShare, NoLessonShare
from adapters.load_share import LoadShare, NoLoadShare, RedisLoadShare
from adapters.pd import PDProtocol, make_protocol
from adapters.upstream import Timeouts, UpstreamPool
from conductor.config.settings import Settings
from conductor.core.decision_log import decision_log_record
from conductor.core.errors import BadRequest, ConfigError, NoHealthyInstance, Rejected, Unauthorized
from conductor.core.types import Decision, Observation, Policy, PrefillLeg, PrefillLegObserver, RequestView, Role, Slo
from conductor.fleet.instances import InstanceRegistry
from conductor.fleet.membership import Membership
from conductor.kv.analysis import EstimatingAnalyzer, PromptAnalysis, PromptAnalyzer
from conductor.kv.analyzer import KVAwarenessSettings, KVEventsEndpoint, build_analyzer
from conductor.ops.gc_freeze import GcFreezer
from conductor.ops.metrics import GatewayMetrics, LessonMetrics
from conductor.ops.tracing import Tracing, decision_attributes
from conductor.routing.deadlines import Deadlines
from conductor.routing.peer_pull import peer_sources
from conductor.routing.readback import Offer, ReadbackTable, pull_sources
from policies.base import NO_INSTANCE
from policies.registry import load_policy
from predictors.online import Predictors

log = logging.getLogger(__name__)
decision_log = logging.getLogger("conductor.decisions")

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TBT_HEADER = "x-slo-tbt-ms"


@dataclass(frozen=True, slots=True)
class Routed:
    """A request that passed admission: where it goes and what was predicted."""

    decision: Decision
    analysis: PromptAnalysis
    view: RequestView
    readback: Offer | None = None  # the decode readback offered to the policy (taken if it pulls)


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        policy: Policy | None = None,
        analyzer: PromptAnalyzer | None = None,
        metrics: GatewayMetrics | None = None,
        tracing: Tracing | None = None,
        load_share: LoadShare | None = None,
        lesson_share: LessonShare | None = None,
    ) -> None:
        """load_share: how this process sees other gateway processes' in-flight work (a worker of
        `conductor serve --workers N` gets its shared memory slot); None: what `settings.load_share` says.
        lesson_share: how what the policy's predictors learn reaches the other processes and theirs
        reach this one (adapters/lesson_share.py; a worker of `--workers N` gets its socket)."""
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.tracing = tracing or Tracing.from_settings(
            settings.otlp_traces_endpoint, settings.trace_sample_ratio, settings.service_name
        )
        self.pool = UpstreamPool(
            Timeouts(connect_s=settings.connect_timeout_s, read_s=settings.read_timeout_s),
            settings.max_connections_per_upstream,
        )
        self.registry = InstanceRegistry(settings, self.pool, load_share or _load_share(settings, self.metrics))
        for name in self.registry.states:  # series at 0 from the start, so rate() and alerts see them
            for kind in ("status", "transport"):
                self.metrics.upstream_errors.labels(name, kind)
            self.metrics.ejections.labels(name)
        self.policy = policy or load_policy(settings.policy, settings.policy_options)
        self.lessons = lesson_share or NoLessonShare()
        self._leg_observer = self.policy if isinstance(self.policy, PrefillLegObserver) else None
        # a policy that learns online (kvcache_aware's `predictors`) shares what it learns with the
        # sibling processes and learns what they do; a policy without predictors has nothing to share
        predictors = getattr(self.policy, "predictors", None)
        self._learner = predictors if isinstance(predictors, Predictors) else None
        self._lesson_outbox = None
        if self._learner is not None and not isinstance(self.lessons, NoLessonShare):
            self._lesson_outbox = self._learner.record_lessons()
        self.metrics.registry.register(LessonMetrics(self.lessons))
        self.analyzer = analyzer or _analyzer(settings, self.metrics)
        protocol_name = settings.pd_protocol if settings.disaggregated else "mixed"
        self.protocol: PDProtocol = make_protocol(
            protocol_name, mooncake_schema=settings.mooncake_schema, bootstrap_timeout_s=settings.bootstrap_timeout_s
        )
        if getattr(self.policy, "local", None) is not None and self.protocol.name == "sglang":
            # an SGLang decode server takes requests with a bootstrap room only: it cannot prefill one
            raise ConfigError(
                "local_prefill_tokens (prefills on decode instances) needs decodes that compute a "
                "request without a KV transfer (vLLM nixl or mooncake), not pd_protocol sglang"
            )
        # decode readbacks (NIXL bidirectional KV transfer): only where block keys say which prefix matches
        self.readback = (
            ReadbackTable(ttl_s=settings.pd_readback_ttl_s, max_handles=settings.pd_readback_max_handles)
            if self.protocol.name == "nixl" and settings.pd_readback == "auto" and settings.kv.enabled
            else None
        )
        # prefill-to-prefill pulls (conductor/routing/peer_pull.py): possible where the settings allow them,
        # active from the start ("on") or once a decode has shown the cluster runs bidirectional NIXL
        self.peer_pull = peer_pull_possible(settings)
        if settings.pd_peer_pull == "on" and not self.peer_pull:
            raise ConfigError(
                "pd_peer_pull 'on' needs the gateway's token ids to be the workers' own: a model "
                "tokenizer for kv.tokenizer, or kv.forward_token_ids true"
            )
        self.deadlines = Deadlines(settings.request_timeout_s)  # request_timeout_s, swept (conductor/routing/deadlines.py)
        self._seq = itertools.count()
        self.inflight = 0  # requests between admission and their last byte
        self.api_keys = settings.client_keys()  # read once: a key file is checked at start-up
        self.upstream_key = settings.upstream_key()
        self._default_slo = Slo(ttft_s=settings.slo.ttft_s, tbt_s=settings.slo.tbt_s)
        self.membership = Membership(self)  # instances joining and leaving at run time (DNS, admin API)
        self.gc_freezer = GcFreezer(settings.gc_freeze_interval_s)

    async def start(self) -> None:
        self.deadlines.start()
        await self.pool.start()
        await self.registry.start()
        await self.membership.start()  # the first DNS answer: its instances start with the others below
        prefills = [s.target for s in self.registry.states.values() if s.spec.role in (Role.PREFILL, Role.MIXED)]
        await self.protocol.start(prefills)
        await self.analyzer.start()
        self.membership.watch()
        self.gc_freezer.start()
        if self._learner is not None:
            self.lessons.start(self._learner.learn)
        log.info(
            "gateway ready: %d prefill, %d decode, %d mixed; protocol %s; policy %s",
            len(self.settings.prefill),
            len(self.settings.decode),
            len(self.settings.mixed),
            self.protocol.name,
            self.policy.name,
        )

    async def close(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans still batched
        await self.gc_freezer.close()
        self.lessons.close()
        await self.membership.close()
        await self.analyzer.close()
        await self.deadlines.close()
        close = getattr(self.protocol, "close", None)
        if close is not None:
            await close()
        await self.registry.close()
        await self.pool.close()

    # ---- checks ---------------------------------------------------------------------------
    def authorize(self, authorization: str | None) -> None:
        if not self.api_keys:
            return
        if not authorization or not authorization.startswith("Bearer "):
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if authorization[7:].strip() not in self.api_keys:
            raise Unauthorized("invalid API key")

    def known_models(self) -> tuple[str, ...]:
        return self.settings.models or self.registry.models()

    def ready(self) -> tuple[bool, dict[str, int]]:
        """Ready when enough instances can take requests: healthy, not ejected, and (Mooncake) with
        their bootstrap's engine id known, since no request can be handed over without it."""
        counts = dict.fromkeys((role.value for role in Role), 0)
        for s in self.registry.states.values():
            if s.healthy and (s.spec.role is not Role.PREFILL or self.protocol.ready(s.target)):
                counts[s.spec.role.value] += 1
        if self.settings.disaggregated:
            ok = counts["prefill"] >= self.settings.min_ready_prefill and counts["decode"] >= self.settings.min_ready_decode
        else:
            ok = counts["mixed"] >= 1
        return ok, counts

    # ---- deciding ---------------------------------------------------------------------------
    def slo_for(self, ttft_header: str | None, tbt_header: str | None) -> Slo:
        """The request's SLOs: per-request headers (milliseconds) over the configured defaults."""
        if not ttft_header and not tbt_header:
            return self._default_slo
        ttft = self.settings.slo.ttft_s
        tbt = self.settings.slo.tbt_s
        if ttft_header:
            ttft = _slo_ms(SLO_TTFT_HEADER, ttft_header)
        if tbt_header:
            tbt = _slo_ms(SLO_TBT_HEADER, tbt_header)
        return Slo(ttft_s=ttft, tbt_s=tbt)

    def decide(
        self,
        request_id: str,
        model: str,
        max_tokens: int,
        stream: bool,
        slo: Slo,
        analysis: PromptAnalysis,
        exclude: frozenset[str] = frozenset(),
    ) -> Routed:
        """Ask the policy; `exclude`: instances this request already failed on (a failover)."""
        started = time.perf_counter()
        offer = None
        if self.readback is not None and analysis.block_keys:
            states = self.registry.states
            offer = self.readback.offer(
                analysis.block_keys, lambda name: name not in exclude and name in states and states[name].healthy
            )
        sources = pull_sources(offer, analysis.prompt_tokens, self.settings.block_size)
        queued: frozenset[str] = frozenset()
        if analysis.cached and analysis.token_ids is not None and self.peer_pull_active():
            states = self.registry.states
            peers = peer_sources(
                analysis,
                states,
                lambda name: name not in exclude and self.protocol.ready(states[name].target),
                self.settings.block_size,
                self.settings.pd_pull_min_tokens,
            )
            if peers:
                sources, queued = {**peers, **sources}, frozenset(peers)
        view = RequestView(
            request_id=request_id,
            seq=next(self._seq),
            model=model,
            prompt_tokens=analysis.prompt_tokens,
            max_tokens=max_tokens,
            block_size=self.settings.block_size,
            block_keys=analysis.block_keys,
            cached=analysis.cached,
            store_cached_tokens=analysis.store_cached_tokens,
            slo=slo,
            stream=stream,
            pull_sources=sources,
            queued_pull_sources=queued,
            staging_jumps_queue=bool(queued) and self.settings.pd_peer_pull_priority is not None,
        )
        with self.tracing.child("conductor.decide") if self.tracing else contextlib.nullcontext() as span:
            snapshot = self.registry.snapshot(exclude)
            decision = self.policy.decide(view, snapshot)
            self.policy.on_decided(view, snapshot, decision)
            if span is not None:
                span.set_attributes(decision_attributes(decision, view.prompt_tokens))
        self.metrics.decision_time.observe(time.perf_counter() - started)
        if decision_log.isEnabledFor(logging.INFO):
            decision_log.info("%s", json.dumps(decision_log_record(decision, analysis.prompt_tokens)))
        if decision.rejection is not None:
            rejection = decision.rejection
            self.metrics.rejections.labels(rejection.reason).inc()
            if rejection.reason == NO_INSTANCE:
                raise NoHealthyInstance(rejection.message)
            raise Rejected(
                rejection.message, reason=rejection.reason, retry_after_s=rejection.retry_after_s, retryable=rejection.retryable
            )
        self.metrics.decisions.labels(decision.policy, decision.prefill or "", decision.decode or "").inc()
        if decision.predicted_ttft_s is not None:
            self.metrics.predicted_ttft.observe(decision.predicted_ttft_s)
        return Routed(decision, analysis, view, offer)

    def peer_pull_active(self) -> bool:
        """Whether prefill-to-prefill pulls are offered to the policy now (settings.pd_peer_pull)."""
        if not self.peer_pull:
            return False
        return self.settings.pd_peer_pull == "on" or (self.readback is not None and self.readback.recorded > 0)

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        """Tell a PrefillLegObserver policy a prefill leg as soon as it answered (NIXL, before the
        decode): its prefill model learns it a decode's length sooner than from the Observation."""
        if self._leg_observer is not None:
            self._teach(self._leg_observer.observe_prefill_leg, leg, leg.request_id)

    def observe(self, routed: Routed, observation: Observation) -> None:
        """Feed what happened back to the policy's predictors and the KV index."""
        self._teach(self.policy.observe, observation, observation.request_id)
        try:
            self.analyzer.on_result(routed.analysis, routed.decision, observation)
        except Exception:
            log.exception("prompt analyzer failed on result of %s", observation.request_id)
        if observation.cached_tokens is not None:
            self.metrics.cached_tokens.labels("cached").inc(observation.cached_tokens)
            self.metrics.cached_tokens.labels("computed").inc(max(0, observation.prompt_tokens - observation.cached_tokens))

    def _teach(self, method: Callable[[Any], None], what: object, request_id: str) -> None:
        """Hand the policy what a request taught; then what its predictors learned goes to the
        sibling processes. A policy's learning bug must not fail the request that taught it."""
        try:
            method(what)
        except Exception:
            log.exception("policy %s failed to learn from %s of %s", self.policy.name, type(what).__name__, request_id)
        if self._lesson_outbox:
            self.lessons.publish(self._lesson_outbox)
            self._lesson_outbox.clear()


def _slo_ms(header: str, value: str) -> float:
    """An SLO header's milliseconds as seconds: a finite positive number, else 400."""
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0 or "_" in value:
        raise BadRequest(f"{header} must be a positive number of milliseconds, got {value[:32]!r}", param=header)
    return ms / 1000.0


def kv_settings(settings: Settings) -> KVAwarenessSettings:
    """The KV-awareness options with what the gateway settings already say filled in: the block size,
    each instance's KV events endpoint, and whether prompts may be forwarded as token ids (only with
    the model's own tokenizer, unless asked: the built-in one's ids mean nothing to a real model)."""
    kv = settings.kv
    events = {
        spec.name: KVEventsEndpoint(endpoint=spec.kv_events_endpoint, replay_endpoint=spec.kv_events_replay_endpoint)
        for spec in settings.instances()
        if spec.kv_events_endpoint and spec.name
    }
    update: dict[str, object] = {"block_size": settings.block_size, "kv_events": {**events, **kv.kv_events}}
    if kv.index == "indexer" and kv.indexer_model is None and settings.models:
        update["indexer_model"] = settings.models[0]  # the indexer checks it against the same `models`
    update["forward_token_ids"] = _forwards_token_ids(kv)
    update["keep_token_ids"] = peer_pull_possible(settings)
    return kv.model_copy(update=update)


def peer_pull_possible(settings: Settings) -> bool:
    """Whether prefill-to-prefill pulls can be staged at all: NIXL P/D, KV awareness on (block keys
    say who holds what), and the gateway's token ids the workers' own (a model tokenizer, or
    kv.forward_token_ids set): the staging request names the prefix by them."""
    return (
        settings.pd_peer_pull != "off"
        and settings.disaggregated
        and settings.pd_protocol == "nixl"
        and settings.kv.enabled
        and _forwards_token_ids(settings.kv)
    )


def _forwards_token_ids(kv: KVAwarenessSettings) -> bool:
    """kv.forward_token_ids as set, else only with the model's own tokenizer (the built-in one's ids
    mean nothing to a real model)."""
    return kv.forward_token_ids if "forward_token_ids" in kv.model_fields_set else kv.tokenizer != "builtin"


def _analyzer(settings: Settings, metrics: GatewayMetrics) -> PromptAnalyzer:
    if not settings.kv.enabled:
        return EstimatingAnalyzer()
    instances = [(spec.name or "", spec.role, spec.url) for spec in settings.instances()]
    return build_analyzer(kv_settings(settings), instances, metrics.registry)


def _load_share(settings: Settings, metrics: GatewayMetrics | None = None) -> LoadShare:
    """The load share the settings ask for; its breaker's metrics go on `metrics.registry` when given."""
    if settings.load_share == "redis":
        replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{id(settings):x}"
        return RedisLoadShare(
            settings.redis_url,
            replica,
            interval_s=settings.load_sync_interval_s,
            timeout_s=settings.load_share_timeout_s,
            failures_to_open=settings.load_share_breaker_failures,
            open_s=settings.load_share_breaker_open_s,
            registry=metrics.registry if metrics is not None else None,
        )
    return NoLoadShare()
