"""The gateway's parts, wired once at start-up: settings, instances, policy, prompt analysis,
P/D protocol, metrics, and the request path's pieces built on them (conductor/routing/router.py
decides and observes, pulls.py plans prefix pulls, relay.py serves attempts, membership applies
instances joining and leaving). Nothing here runs per request: the HTTP layer
(conductor/server/endpoint.py, conductor/server/app.py) gets the pieces it calls, not the Gateway.
Besides the wiring it starts and closes them and says when the gateway is ready."""

from __future__ import annotations

import logging
import os
import socket

from adapters.http1 import ResponseLimits
from adapters.lesson_share import LessonShare, NoLessonShare
from adapters.load_share import LoadShare, NoLoadShare, RedisLoadShare
from adapters.pd import PDProtocol, make_protocol
from adapters.redis_lesson_share import RedisLessonShare
from adapters.shm_load_share import SharedMemoryLoadShare
from adapters.upstream import Timeouts, UpstreamPool
from conductor.config.derived import kv_settings
from conductor.config.keys import ApiKeys
from conductor.config.settings import Settings
from conductor.core.capabilities import local_prefill_enabled
from conductor.core.errors import ConfigError
from conductor.core.types import Policy, Role
from conductor.fleet.instances import InstanceRegistry
from conductor.fleet.membership import Membership
from conductor.kv.analysis import EstimatingAnalyzer, PromptAnalyzer, bind_prompt_bound
from conductor.kv.analyzer import build_analyzer
from conductor.kv.prompt_bounds import PromptBound
from conductor.ops.gc_freeze import GcFreezer
from conductor.ops.metrics import GatewayMetrics, LessonMetrics
from conductor.ops.tracing import Tracing
from conductor.routing.adapter_loads import AdapterLoads
from conductor.routing.deadlines import Deadlines
from conductor.routing.priority import Classifier
from conductor.routing.pulls import PullPlanner
from conductor.routing.relay import Relay
from conductor.routing.request_path import InflightLimit, RequestPath
from conductor.routing.router import Router
from conductor.routing.shares import Shares
from conductor.routing.waiting_room import WaitingRoom
from policies.registry import load_policy

log = logging.getLogger(__name__)


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
        `conductor serve --workers N` gets its shared memory slot); None: what `settings.load_share.mode` says.
        lesson_share: how what the policy's predictors learn reaches the other processes and theirs
        reach this one (adapters/lesson_share.py; a worker of `--workers N` gets its socket)."""
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.tracing = tracing or Tracing.from_settings(
            settings.tracing.otlp_endpoint, settings.tracing.sample_ratio, settings.tracing.service_name
        )
        limits = settings.limits
        self.pool = UpstreamPool(
            Timeouts(connect_s=settings.timeouts.connect_s, read_s=settings.timeouts.read_s),
            limits.max_connections_per_upstream,
            limits=ResponseLimits(limits.max_upstream_head_bytes, limits.max_upstream_headers, limits.max_upstream_body_bytes),
        )
        if isinstance(load_share, SharedMemoryLoadShare):  # a worker of `--workers N`: its turns too
            load_share.turns = settings.load_share.turns
        self.registry = InstanceRegistry(settings, self.pool, load_share or _load_share(settings, self.metrics))
        for name in self.registry.states:  # series at 0 from the start, so rate() and alerts see them
            for kind in ("status", "transport"):
                self.metrics.upstream_errors.labels(name, kind)
            self.metrics.ejections.labels(name)
        self.policy = policy or load_policy(settings.policy, settings.policy_options)
        self.lessons = lesson_share or _lesson_share(settings, self.registry.load_share, self.metrics)
        self.metrics.registry.register(LessonMetrics(self.lessons))
        # which LoRA adapter a model names (its KV keys), and the ones loaded at run time (lora_adapters)
        self.adapter_loads = AdapterLoads(
            settings.lora_adapters, self.registry, self.metrics.registry, upstream_key=settings.auth.upstream_key()
        )
        self.analyzer = analyzer or _analyzer(settings, self.metrics, self.adapter_loads)
        bind_prompt_bound(self.analyzer, PromptBound(settings.limits.max_prompt_tokens, self.registry.context_length))
        protocol_name = settings.pd.protocol if settings.disaggregated else "mixed"
        self.protocol: PDProtocol = make_protocol(
            protocol_name, mooncake_schema=settings.pd.mooncake_schema, bootstrap_timeout_s=settings.timeouts.bootstrap_s
        )
        if local_prefill_enabled(self.policy) and self.protocol.name == "sglang":
            # an SGLang decode server takes requests with a bootstrap room only: it cannot prefill one
            raise ConfigError(
                "local_prefill_tokens (prefills on decode instances) needs decodes that compute a "
                "request without a KV transfer (vLLM nixl or mooncake), not pd.protocol sglang"
            )
        self.pulls = PullPlanner(settings, self.registry, self.protocol, self.metrics)  # readback, peer pulls
        self.deadlines = Deadlines(settings.timeouts.request_s)  # timeouts.request_s, swept (conductor/routing/deadlines.py)
        self.inflight = InflightLimit(settings.limits.max_inflight_requests)  # admission to last byte
        self.api_keys = settings.auth.client_keys()  # read once: a key file is checked at start-up
        # compared in constant time (conductor/config/keys.py); a tenant's keys answer its name
        self.client_keys = ApiKeys(self.api_keys, owners=settings.auth.key_owners())
        self.upstream_key = settings.auth.upstream_key()
        # instances joining and leaving at run time (DNS, admin API)
        self.membership = Membership(
            settings, registry=self.registry, protocol=self.protocol, analyzer=self.analyzer, metrics=self.metrics
        )
        self._wire_requests()
        self.gc_freezer = GcFreezer(settings.gc_freeze_interval_s)

    def _wire_requests(self) -> None:
        """The request path's pieces, each given exactly the collaborators it needs."""
        self.router = Router(
            self.settings,
            registry=self.registry,
            policy=self.policy,
            analyzer=self.analyzer,
            pulls=self.pulls,
            metrics=self.metrics,
            tracing=self.tracing,
            lessons=self.lessons,
        )
        self.waiting_room = WaitingRoom(self.settings.hold, self.metrics)
        self.relay = Relay(
            self.settings,
            registry=self.registry,
            protocol=self.protocol,
            router=self.router,
            pulls=self.pulls,
            analyzer=self.analyzer,
            metrics=self.metrics,
            tracing=self.tracing,
            adapter_loads=self.adapter_loads if self.settings.lora_adapters else None,
            freed=self.waiting_room.freed,
        )
        self.request_path = RequestPath(
            settings=self.settings,
            authorize=self.authorize,
            known_models=self.known_models,
            analyzer=self.analyzer,
            router=self.router,
            relay=self.relay,
            waiting_room=self.waiting_room,
            deadlines=self.deadlines,
            inflight=self.inflight,
            shares=Shares(self.settings, self.inflight, self.metrics),
            classes=Classifier(self.settings.priority, {n: t.priority for n, t in self.settings.auth.tenants.items()}),
            load_share=self.registry.load_share,
            metrics=self.metrics,
            tracing=self.tracing,
            upstream_key=self.upstream_key,
        )

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
        if self.router.learner is not None:
            self.lessons.start(self.router.learner.learn)
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
        await self.protocol.close()
        await self.registry.close()
        await self.pool.close()

    # ---- checks ---------------------------------------------------------------------------
    def authorize(self, authorization: str | None) -> str | None:
        """401 unless the header carries a client key (when any is configured); its tenant, if any."""
        return self.client_keys.check(authorization)

    def known_models(self) -> frozenset[str]:
        """Configured models, the instances' base models and adapters, aliases: worked out on each
        change (conductor/fleet/model_pools.py), read per request."""
        return self.registry.pools.known

    def ready(self) -> tuple[bool, dict[str, int]]:
        """Ready when enough instances can take requests: healthy, not ejected, and (Mooncake) with
        their bootstrap's engine id known, since no request can be handed over without it."""
        counts = dict.fromkeys((role.value for role in Role), 0)
        for s in self.registry.states.values():
            if s.healthy and (s.spec.role is not Role.PREFILL or self.protocol.ready(s.target)):
                counts[s.spec.role.value] += 1
        if self.settings.disaggregated:
            health = self.settings.health
            ok = counts["prefill"] >= health.min_ready_prefill and counts["decode"] >= health.min_ready_decode
        else:
            ok = counts["mixed"] >= 1
        return ok, counts


def _analyzer(settings: Settings, metrics: GatewayMetrics, adapters: AdapterLoads) -> PromptAnalyzer:
    if not settings.kv.enabled:
        return EstimatingAnalyzer(max_chars_per_token=settings.kv.max_chars_per_token)
    instances = [(spec.name or "", spec.role, spec.url) for spec in settings.instances()]
    return build_analyzer(
        kv_settings(settings),
        instances,
        metrics.registry,
        adapter_for=adapters.adapter_for,
        instance_adapter=adapters.instance_adapter,
    )


def _lesson_share(settings: Settings, load_share: LoadShare, metrics: GatewayMetrics) -> LessonShare:
    """Replicas sharing load through Redis share their predictors' lessons there too (a worker of
    `--workers N` is given its socket's share instead); anything else learns alone."""
    if isinstance(load_share, RedisLoadShare) and settings.share_lessons:
        return RedisLessonShare(
            settings.load_share.redis_url,
            load_share.replica_id,
            prefix=f"{load_share.prefix}lessons:",
            timeout_s=settings.load_share.timeout_s,
            registry=metrics.registry,
        )
    return NoLessonShare()


def _load_share(settings: Settings, metrics: GatewayMetrics | None = None) -> LoadShare:
    """The load share the settings ask for; its breaker's metrics go on `metrics.registry` when given."""
    if settings.load_share.mode == "redis":
        replica = settings.load_share.replica_id or f"{socket.gethostname()}-{os.getpid()}-{id(settings):x}"
        return RedisLoadShare(
            settings.load_share.redis_url,
            replica,
            interval_s=settings.load_share.sync_interval_s,
            timeout_s=settings.load_share.timeout_s,
            failures_to_open=settings.load_share.breaker_failures,
            open_s=settings.load_share.breaker_open_s,
            registry=metrics.registry if metrics is not None else None,
            turns=settings.load_share.turns,
        )
    return NoLoadShare()
