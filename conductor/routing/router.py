"""Deciding where a request goes, and learning from how it went.

`Router.decide` turns a prompt's analysis into the policy's view of the request (with the pulls
it may choose, conductor/routing/pulls.py), asks the policy, logs and counts the decision, and
raises the rejection's error when there is one; `propose` is its first half alone, the decision
the policy would make now with nothing acted upon (what conductor/routing/explain.py shows).
A request for model M is decided among the instances that serve M only (conductor/fleet/model_pools.py):
the others are passed to the policy as excluded, as a failover's failed instances are.
`observe` and `observe_prefill_leg` hand what a request taught back to the policy and the prompt
analyzer; what the policy's predictors learn then goes to the sibling processes of
`conductor serve --workers N`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from adapters.lesson_share import LessonShare, NoLessonShare
from conductor.config.pools import pool_slos
from conductor.config.settings import Settings
from conductor.core.capabilities import ClassAware, OnlineLearner, online_learner
from conductor.core.classes import ClassRules
from conductor.core.errors import BadRequest, NoHealthyInstance, Rejected
from conductor.core.fast_init import fast_init
from conductor.core.types import (
    ClusterSnapshot,
    Decision,
    Observation,
    Policy,
    PrefillLeg,
    PrefillLegObserver,
    RequestView,
    Slo,
)
from conductor.fleet.instances import InstanceRegistry
from conductor.kv.analysis import PromptAnalysis, PromptAnalyzer
from conductor.ops.logs import log_decision
from conductor.ops.metrics import GatewayMetrics
from conductor.ops.status import GatewayStatus
from conductor.ops.tracing import Tracing, decision_attributes
from conductor.routing.pulls import PullOffer, PullPlanner
from policies.admission import holdable
from policies.base import NO_INSTANCE

log = logging.getLogger(__name__)
decision_log = logging.getLogger("conductor.decisions")

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TBT_HEADER = "x-slo-tbt-ms"


@fast_init
@dataclass(frozen=True, slots=True)
class Routed:
    """A request that passed admission: where it goes and what was predicted."""

    decision: Decision
    analysis: PromptAnalysis
    view: RequestView
    pulls: PullOffer  # the pulls offered to the policy (one is carried out if the decision pulls)
    held_s: float = 0.0  # how long it waited at the gateway before this decision (waiting_room.py)


@fast_init
@dataclass(frozen=True, slots=True)
class Proposal:
    """The policy's decision for a request and what it was decided on, not yet acted upon."""

    decision: Decision
    view: RequestView
    snapshot: ClusterSnapshot
    pulls: PullOffer


class Router:
    """The policy's side of the gateway: decide, and observe what happened."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: InstanceRegistry,
        policy: Policy,
        analyzer: PromptAnalyzer,
        pulls: PullPlanner,
        metrics: GatewayMetrics,
        tracing: Tracing | None,
        lessons: LessonShare,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self.policy = policy
        self._analyzer = analyzer
        self._pulls = pulls
        self._metrics = metrics
        self._tracing = tracing
        self._lessons = lessons
        self._next_seq = 0  # RequestView.seq of the next decision
        self._default_slo = Slo(ttft_s=settings.slo.ttft_s, tbt_s=settings.slo.tbt_s)
        self._slos = _model_slos(settings)  # model -> its pool's SLO (pools.<model>.slo), where set
        # priority class -> the SLO fields it sets (priority.classes.<c>.slo), where it sets any
        self._class_slos = {
            name: {key: getattr(c.slo, key) for key in c.slo.model_fields_set}
            for name, c in settings.priority.classes.items()
            if c.slo is not None and c.slo.model_fields_set
        }
        if isinstance(policy, ClassAware) and (settings.priority.enabled or settings.auth.tenants):
            policy.configure_classes(self._class_rules())  # its admission knows classes and tenants
        self._leg_observer = policy if isinstance(policy, PrefillLegObserver) else None
        # looked up once: a labels() call per request and label was ~1 us each (profiled)
        self._cached_tokens = (metrics.cached_tokens.labels("cached"), metrics.cached_tokens.labels("computed"))
        self.status = GatewayStatus()  # recent decisions and outcomes, for the status page (conductor/ops/status.py)
        # a policy that learns online (kvcache_aware's predictors) shares what it learns with the
        # sibling processes and learns what they do; a policy without predictors has nothing to share
        self.learner: OnlineLearner | None = online_learner(policy)
        self._lesson_outbox = None
        if self.learner is not None and not isinstance(lessons, NoLessonShare):
            self._lesson_outbox = self.learner.record_lessons()

    # ---- deciding ---------------------------------------------------------------------------
    def slo_for(self, model: str, ttft_header: str | None, tbt_header: str | None, priority: str | None = None) -> Slo:
        """The request's SLOs: per-request headers (milliseconds) over its priority class's
        (`priority.classes.<c>.slo`) where it sets them, over those of `model`'s pool
        (`pools.<model>.slo`) where it sets them, else the gateway-wide `slo`."""
        slo = self._slos.get(model, self._default_slo) if self._slos else self._default_slo
        if priority is not None and priority in self._class_slos:
            fields = self._class_slos[priority]
            slo = Slo(ttft_s=fields.get("ttft_s", slo.ttft_s), tbt_s=fields.get("tbt_s", slo.tbt_s))
        if not ttft_header and not tbt_header:
            return slo
        ttft, tbt = slo.ttft_s, slo.tbt_s
        if ttft_header:
            ttft = _slo_ms(SLO_TTFT_HEADER, ttft_header)
        if tbt_header:
            tbt = _slo_ms(SLO_TBT_HEADER, tbt_header)
        return Slo(ttft_s=ttft, tbt_s=tbt)

    def _class_rules(self) -> ClassRules:
        """What the policy's admission is told of the classes and tenants (policies/classes.py): the
        most urgent class's SLO as `slo_for` gives it for a model without a pool SLO of its own."""
        priority = self._settings.priority
        names = priority.names()
        return ClassRules(
            ranks={name: c.rank for name, c in priority.classes.items()},
            sheddable=frozenset(priority.shares()),
            urgent_slo=self.slo_for("", None, None, names[0]) if names else self._default_slo,
            guard_margin=priority.guard_margin,
            weights={name: t.weight for name, t in self._settings.auth.tenants.items()},
        )

    def propose(
        self,
        request_id: str,
        model: str,
        max_tokens: int,
        stream: bool,
        slo: Slo,
        analysis: PromptAnalysis,
        exclude: frozenset[str] = frozenset(),
        *,
        seq: int | None = None,
        priority: str | None = None,
        tenant: str | None = None,
        session: int | None = None,
    ) -> Proposal:
        """What the policy decides for this request now, and nothing more: no sequence number taken
        (`seq` None: the one the next decision will get), nothing remembered by the policy, logged
        or counted. `decide` acts on it; conductor/routing/explain.py only shows it."""
        outside = self._registry.pools.excluded(model)  # the instances that do not serve the model
        if outside:
            exclude = exclude | outside if exclude else outside
        offer = self._pulls.offer(analysis, exclude)
        view = RequestView(
            request_id=request_id,
            seq=self._next_seq if seq is None else seq,
            model=model,
            prompt_tokens=analysis.prompt_tokens,
            max_tokens=max_tokens,
            block_size=self._settings.block_size,
            block_keys=analysis.block_keys,
            cached=analysis.cached,
            store_cached_tokens=analysis.store_cached_tokens,
            slo=slo,
            stream=stream,
            pull_sources=offer.sources,
            queued_pull_sources=offer.queued,
            staging_jumps_queue=offer.jumps_queue,
            priority=priority,
            tenant=tenant,
            session=session,
        )
        snapshot = self._registry.snapshot(exclude, outside)
        return Proposal(self.policy.decide(view, snapshot), view, snapshot, offer)

    def decide(
        self,
        request_id: str,
        model: str,
        max_tokens: int,
        stream: bool,
        slo: Slo,
        analysis: PromptAnalysis,
        exclude: frozenset[str] = frozenset(),
        *,
        priority: str | None = None,
        tenant: str | None = None,
        session: int | None = None,
        may_hold: bool = False,
    ) -> Routed | None:
        """Ask the policy; `exclude`: instances this request already failed on (a failover);
        `priority`, `tenant`: its class and tenant, where configured (in the view and the log);
        `session`: its session's hashed key (conductor/routing/sessions.py), in the view.
        Raises Rejected (429) or NoHealthyInstance (503) when the policy turns the request away;
        with `may_hold`, a refusal for its TBT only (which streams ending may cure) returns None
        instead, with nothing remembered, logged or counted: the caller holds the request
        (conductor/routing/waiting_room.py) and asks again."""
        started = time.perf_counter()
        seq = self._next_seq
        args = (request_id, model, max_tokens, stream, slo, analysis, exclude)
        if self._tracing is None:
            proposal = self.propose(*args, seq=seq, priority=priority, tenant=tenant, session=session)
            decision, view = proposal.decision, proposal.view
            if may_hold and holdable(decision):
                return None
            self.policy.on_decided(view, proposal.snapshot, decision)
        else:
            with self._tracing.child("conductor.decide") as span:
                proposal = self.propose(*args, seq=seq, priority=priority, tenant=tenant, session=session)
                decision, view = proposal.decision, proposal.view
                if may_hold and holdable(decision):
                    return None
                self.policy.on_decided(view, proposal.snapshot, decision)
                span.set_attributes(decision_attributes(decision, view.prompt_tokens))
        self._next_seq = seq + 1
        self._metrics.decision_time.observe(time.perf_counter() - started)
        log_decision(decision_log, decision, analysis.prompt_tokens, model, priority=priority, tenant=tenant)
        self.status.decided(decision, analysis.prompt_tokens)
        self._count(decision, model, tenant)
        return Routed(decision, analysis, view, proposal.pulls)

    def decide_again(self, routed: Routed, stream: bool, slo: Slo, exclude: frozenset[str]) -> Routed:
        """`decide` for a request decided before (`routed`) that failed on the instances `exclude`
        (a failover): the same model, sizes, analysis, class, tenant and session; a request held
        before (waiting_room.py) keeps its wait and the SLO it was admitted with."""
        view = routed.view
        again = self.decide(
            view.request_id,
            view.model,
            view.max_tokens,
            stream,
            view.slo if routed.held_s else slo,
            routed.analysis,
            exclude,
            priority=view.priority,
            tenant=view.tenant,
            session=view.session,
        )
        assert again is not None  # not held: a refusal is raised
        return replace(again, held_s=routed.held_s) if routed.held_s else again

    def _count(self, decision: Decision, model: str, tenant: str | None) -> None:
        """The decision's metrics; a rejection raised as the error the client gets."""
        rejection = decision.rejection
        if rejection is not None:
            self._metrics.rejections.labels(rejection.reason).inc()
            if tenant is not None:
                self._metrics.tenant_rejections.labels(tenant, rejection.reason).inc()
            if rejection.reason == NO_INSTANCE:  # within the model's pool: say which model
                raise NoHealthyInstance(f"{rejection.message} serving model `{model}`")
            raise Rejected(
                rejection.message, reason=rejection.reason, retry_after_s=rejection.retry_after_s, retryable=rejection.retryable
            )
        self._metrics.decisions.labels(decision.policy, decision.prefill or "", decision.decode or "").inc()
        if decision.predicted_ttft_s is not None:
            self._metrics.predicted_ttft.observe(decision.predicted_ttft_s)

    # ---- learning ---------------------------------------------------------------------------
    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        """Tell a PrefillLegObserver policy a prefill leg as soon as it is over (NIXL: the prefill
        answered, before the decode; a mixed worker: its stream's first token): its prefill model
        learns it a decode's length sooner than from the Observation."""
        if self._leg_observer is not None:
            self._teach(self._leg_observer.observe_prefill_leg, leg, leg.request_id)

    def observe(self, routed: Routed, observation: Observation) -> None:
        """Feed what happened back to the policy's predictors and the KV index."""
        self._teach(self.policy.observe, observation, observation.request_id)
        self.status.observed(observation, routed.view.slo)
        try:
            self._analyzer.on_result(routed.analysis, routed.decision, observation)
        except Exception:
            log.exception("prompt analyzer failed on result of %s", observation.request_id)
        if observation.cached_tokens is not None:
            cached, computed = self._cached_tokens
            cached.inc(observation.cached_tokens)
            computed.inc(max(0, observation.prompt_tokens - observation.cached_tokens))

    def _teach(self, method: Callable[[Any], None], what: object, request_id: str) -> None:
        """Hand the policy what a request taught; then what its predictors learned goes to the
        sibling processes. A policy's learning bug must not fail the request that taught it."""
        try:
            method(what)
        except Exception:
            log.exception("policy %s failed to learn from %s of %s", self.policy.name, type(what).__name__, request_id)
        if self._lesson_outbox:
            self._lessons.publish(self._lesson_outbox)
            self._lesson_outbox.clear()


def _model_slos(settings: Settings) -> dict[str, Slo]:
    """model -> the SLO its pool sets, worked out once: served names, and the aliases of them (a
    request's model is its served name by the time it is routed; an alias costs nothing here)."""
    slos = {model: Slo(ttft_s=s.ttft_s, tbt_s=s.tbt_s) for model, s in pool_slos(settings.slo, settings.pools).items()}
    slos.update({alias: slos[served] for alias, served in settings.model_aliases.items() if served in slos})
    return slos


def _slo_ms(header: str, value: str) -> float:
    """An SLO header's milliseconds as seconds: a finite positive number, else 400."""
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0 or "_" in value:
        raise BadRequest(f"{header} must be a positive number of milliseconds, got {value[:32]!r}", param=header)
    return ms / 1000.0
