"""Conductor's own policy, the recommended one: KVCache-centric scheduling (Mooncake FAST'25,
Algorithm 1) with SLO admission and prediction-based early rejection (Mooncake arXiv report, 7.4).

A decision runs six stages (`KvCacheAwarePolicy._decide`):

1. candidates: the prefill-capable pool (prefill instances, or mixed workers), the decode pool, and
   the remote prefixes the request may pull over the links `allow_pull` allows (stages.py).
2. estimates: each prefill-capable instance's predicted TTFT: the pull where the predicted transfer
   beats recomputing, its queue, its prefill of the rest, the KV handoff (pool_estimates.py). A
   prefix the index is blind to is credited to the instance that served the request's session
   last (a hint, sessions.py).
3. placement: the decode with the lowest TBT by its load now; the prefill that computes least among
   those whose bounded TTFT at the client fits `ttft_slack` of the SLO, else the lowest TTFT
   (placement.py). Mixed workers: the fewest stream-seconds stalled within `mixed_ttft_slack`
   (mixed.py).
4. admission: the TTFT at the client and the TBT on arrival, as calibrated upper bounds, against
   the SLOs; a predicted miss is a rejection, nothing is forwarded (stages.py, policies.admission).
   A class less urgent than the most urgent is judged by the guarded SLO (policies/classes.py); a
   flooding tenant above its share of the work is refused while another tenant sends and the fleet is
   short of room, or the request would go to a mixed worker decoding streams, as long as that other
   tenant is short of its max-min fair share (fairness.py).
5. fallback: a prefill on the decode itself where that wins (policies/local_prefill.py), and a
   probe let through after `probe_after` rejections in a row (stages.py).
6. explain: the Decision, listing the best `listed_candidates` of each pool and the chosen ones.

`on_decided` then remembers the admitted request's predictions and its prefix in flight
(inflight.py), and `observe` teaches the predictors its outcome (learning.py). Instances holding no
prefix share one prefix plan and decode loads are a count and a sum, so a decision grows with the
cluster as cheaply as that allows; tests/policies/test_kvcache_aware_differential.py holds these
shortcuts to the estimate-everything algorithm. Options, typed and checked: options.py; what each
does and the evidence behind its default: docs/kvcache_aware.md.
"""

from __future__ import annotations

from conductor.core.classes import NO_RULES, ClassRules
from conductor.core.errors import ConfigError
from conductor.core.types import ClusterSnapshot, Decision, Observation, PrefillLeg, RequestView
from policies.base import NO_INSTANCE, BasePolicy
from policies.classes import guarded
from policies.estimate import decode_candidate, prefill_candidate
from policies.kvcache_aware.fairness import TENANT_SHARE, TenantService
from policies.kvcache_aware.inflight import InflightPrefixes, with_inflight
from policies.kvcache_aware.learning import OutcomeLearner
from policies.kvcache_aware.mixed import place_mixed
from policies.kvcache_aware.options import (
    OPTION_KEYS,
    AdmissionOptions,
    KvCacheAwareOptions,
    LearningOptions,
    LocalPrefillOptions,
    MixedOptions,
    PlacementOptions,
    PrefixOptions,
    SessionOptions,
    pull_links,
)
from policies.kvcache_aware.placement import Placement, TbtBound, place_disaggregated
from policies.kvcache_aware.pool_estimates import PoolPrefillEstimates
from policies.kvcache_aware.prefill_duty import PrefillDuty
from policies.kvcache_aware.sessions import (
    MOVED,
    LastTurn,
    SessionTable,
    hint_mark,
    hinted,
    mark_session,
    prefer_decode,
    readback_decode,
)
from policies.kvcache_aware.stages import (
    Pools,
    Verdict,
    admission,
    candidates,
    estimates,
    explain,
    local_fallback,
    probed,
)
from policies.local_prefill import LocalPrefill, local_prefill_s
from predictors.errors import ErrorStats
from predictors.online import OnlineConfig, Predictors
from predictors.overrun import overrun_scale

__all__ = [
    "OPTION_KEYS",
    "AdmissionOptions",
    "KvCacheAwareOptions",
    "KvCacheAwarePolicy",
    "LearningOptions",
    "LocalPrefillOptions",
    "MixedOptions",
    "PlacementOptions",
    "PrefixOptions",
    "SessionOptions",
    "decode_candidate",
    "prefill_candidate",
    "pull_links",
]


class KvCacheAwarePolicy(BasePolicy):
    name = "kvcache_aware"

    def __init__(
        self, options: KvCacheAwareOptions | None = None, /, *, predictors: Predictors | None = None, **flat: object
    ) -> None:
        """`options` typed, or the flat `policy_options` keys as keywords, as the entry point is
        called (KvCacheAwareOptions.from_mapping checks them: ConfigError naming the key).
        `predictors`: an already built Predictors (the simulator shares one; the options that
        would build it, `ttft_bound_shift_s` and `track_errors` among them, are then unused); else
        they are fitted from `predictor_params`, or from the bundled profile."""
        if options is None:
            options = KvCacheAwareOptions.from_mapping(flat)
        elif flat:
            raise ConfigError(f"{self.name}: options are given typed or as keys, not both ({', '.join(flat)})")
        if predictors is not None and not isinstance(predictors, Predictors):
            raise ConfigError(f"{self.name}: 'predictors' takes a built Predictors, not {predictors!r}", param="predictors")
        self.options = options
        self.admission = options.admission.mode
        self.pull_links = pull_links(options.prefixes.allow_pull)
        self.allow_pull = bool(self.pull_links)
        self.predictors = _predictors(options) if predictors is None else predictors
        learning = options.learning
        self.learner = OutcomeLearner(
            self.predictors, refit_queue_fraction=learning.refit_queue_fraction, max_pending=learning.max_pending
        )
        prefixes = options.prefixes
        self.inflight = InflightPrefixes(prefixes.max_inflight_keys) if prefixes.inflight else None
        local = options.local
        self.local = LocalPrefill(local.tokens, max_duty=local.duty, gain=local.gain) if local.tokens else None
        self._rejected_in_a_row = 0  # SLO rejections since the last admitted request (`probe_after`)
        sessions = options.sessions
        self.sessions = SessionTable(sessions.max_sessions) if sessions.affinity else None
        self.classes = NO_RULES  # priority classes and tenants (configure_classes); none until told
        self.tenants: TenantService | None = None  # tenants' recent work admitted (fairness.py)
        self.duty: PrefillDuty | None = None  # mixed workers' recent prefill duty (prefill_duty.py)

    def configure_classes(self, rules: ClassRules) -> None:
        """The gateway's priority classes and tenants (conductor/routing/router.py, at start-up): a
        less urgent class is judged by the guarded SLO (policies/classes.py), and with two tenants or
        more each is held to its share of the work while another is refused for room (fairness.py)."""
        self.classes = rules
        self.tenants = TenantService(rules) if len(rules.weights) > 1 else None
        self.duty = PrefillDuty() if rules.ranks else None

    @property
    def listed_candidates(self) -> int | None:
        """How many instances of each pool a decision lists (None: all of them)."""
        return self.options.placement.listed_candidates

    # ---- deciding -------------------------------------------------------------------------

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return self._decide(request, cluster, None, None)

    def judge(self, request: RequestView, cluster: ClusterSnapshot, prefill: str, decode: str | None) -> Decision:
        """This policy's predictions and admission for a placement chosen by someone else (a
        baseline's): the same predictors, calibrated bounds and probes, without prefix pulls
        (the baselines recompute what their instance lacks). Call `on_decided` and `observe` as
        for `decide`, so the predictors keep learning from the baseline's outcomes."""
        return self._decide(request, cluster, prefill, decode or "")

    def _decide(self, request: RequestView, cluster: ClusterSnapshot, only_p: str | None, only_d: str | None) -> Decision:
        """The six stages of the module docstring; `only_p` / `only_d` narrow the pools to one
        placement (`judge`). A session's hint (sessions.py) enters the estimates. A less urgent
        class is judged by its guarded SLO; a tenant above its share is refused (fairness.py)."""
        pred, options = self.predictors, self.options
        request = guarded(request, self.classes)
        pools = candidates(request, cluster, self.pull_links, only_p, only_d, self.name)
        if isinstance(pools, Decision):
            return pools  # no healthy instance in a pool the request needs
        scale = overrun_scale(pred, pools.prefills, mixed=not pools.disaggregated)
        if not pools.disaggregated:  # and the newest mixed legs' lag behind the fit (Predictors.mixed_scale)
            scale = max(scale, pred.mixed_scale) if scale > 1.0 else pred.mixed_scale
        if scale != 1.0:  # predict as slow as the running prefills (or the newest mixed legs) show
            pred = pred.prefill_scaled(scale)
        seen = with_inflight(self.inflight, request)  # what the index and the in-flight table report
        last = None if self.sessions is None or request.session is None or pools.pinned else self.sessions.last(request.session)
        hint = None if last is None else hinted(seen, last, pools.prefills)
        weighed = estimates(pred, seen if hint is None else hint, pools, None)
        placed, tbt = self._place(pred, request, pools, weighed, cluster.now)
        hint_marked = None
        if hint is not None and last is not None:
            plain = None  # the placement without the hint, needed only where the hint's instance won
            if pools.prefills[placed.best].id == last.prefill:
                plain = self._place(pred, request, pools, estimates(pred, seen, pools, None), cluster.now)[0].best
            hint_marked = hint_mark(placed.best, pools.prefills, last, plain)
        placed, verdict, decode_marked = self._admit(pred, request, cluster, pools, weighed, placed, tbt, last)
        local = local_fallback(self.local, pred, request, cluster, pools, placed, verdict)
        rejection = probed(verdict.rejection, options.admission.probe_after, self._rejected_in_a_row)
        if rejection is None and local is None and self.tenants is not None and not pools.pinned:
            busy = not pools.disaggregated and verdict.judged is not None  # a mixed worker with streams
            rejection = self.tenants.refuse(request, cluster.now, verdict.ttft_s, busy)
        decision = explain(request, self.name, pools, weighed, placed, verdict, rejection, local)
        if hint_marked is None and decode_marked is None:
            return decision
        return mark_session(decision, (hint_marked, decode_marked))

    def _place(
        self, pred: Predictors, request: RequestView, pools: Pools, weighed: PoolPrefillEstimates, now: float
    ) -> tuple[Placement, TbtBound]:
        """Stage 3, placement, and the TBT bound admission will judge it by; a less urgent class on
        mixed workers under the prefills queued ahead (backlog) and the workers' duty (prefill_duty.py)."""
        options = self.options
        if pools.disaggregated:
            tbt = TbtBound.of(pred, options.admission.tbt_quantile)
            placed = place_disaggregated(
                pred, request, pools.decodes, weighed, options.placement, options.admission.ttft_quantile
            )
            return placed, tbt
        tbt = TbtBound.of(pred, options.mixed.tbt_quantile)  # mixed workers judge TBT at their own quantile
        less_urgent = self.classes.less_urgent(request.priority)
        duty = self.duty
        stretch = None if duty is None or not less_urgent else lambda worker, prefill_s: duty.stretch(worker, prefill_s, now)
        return place_mixed(pred, request, weighed, options, tbt, less_urgent, stretch, now), tbt

    def _admit(
        self,
        pred: Predictors,
        request: RequestView,
        cluster: ClusterSnapshot,
        pools: Pools,
        weighed: PoolPrefillEstimates,
        placed: Placement,
        tbt: TbtBound,
        last: LastTurn | None,
    ) -> tuple[Placement, Verdict, float | None]:
        """Stage 4, admission, of the placement, or of it on the session's decode where a readback
        is offered from that decode (sessions.py); a session whose decode would miss an SLO that
        the placement meets moves. The decode's mark (None: the rule did not apply)."""
        options = self.options
        decode_id = None if last is None or not pools.disaggregated else readback_decode(request, last)
        if decode_id is None:
            return placed, admission(pred, request, cluster, pools, weighed, placed, options.admission, tbt), None
        steered, mark = prefer_decode(pred, request, decode_id, pools.decodes, placed, options.sessions.decode_slack)
        verdict = admission(pred, request, cluster, pools, weighed, steered, options.admission, tbt)
        if verdict.rejection is not None and steered is not placed:
            plain = admission(pred, request, cluster, pools, weighed, placed, options.admission, tbt)
            if plain.rejection is None:
                return placed, plain, MOVED
        return steered, verdict, mark

    # ---- remembering ----------------------------------------------------------------------

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        """The one place this policy's memory changes after a decision.

        State, and why: `_rejected_in_a_row` (SLO rejections since the last admitted request, for
        the `probe_after` probe), `sessions` (each session's last turn: its instances and prompt, sessions.py),
        `inflight` (the prefixes dispatched and not yet indexed), `tenants` (each tenant's recent work
        admitted and SLO rejections, fairness.py), `duty` (prefill seconds admitted per worker,
        prefill_duty.py), the local prefills' duty, and the
        learner's pending predictions (learning.py: what was predicted for each admitted request,
        bounded by `max_pending`, until `observe` compares it with what happened).
        """
        if self.tenants is not None:
            self.tenants.record(request, decision, cluster.now)
        if self.duty is not None:
            self.duty.record(decision, cluster.now)
        if decision.rejection is not None:
            if decision.rejection.reason not in (NO_INSTANCE, TENANT_SHARE):  # a probe tests predictions only
                self._rejected_in_a_row += 1
            return
        self._rejected_in_a_row = 0
        if self.sessions is not None:
            self.sessions.remember(request, decision)
        if self.local is not None and decision.prefilled_on_decode:
            assert decision.prefill is not None
            # a local prefill (policies/local_prefill.py): its duty is remembered; its legs are
            # not learned from (no P -> D handoff, and its prefill shares steps with the batch)
            self.local.record(decision.prefill, cluster.now, local_prefill_s(decision))
            return
        if decision.prefill is not None and self.inflight is not None:
            self.inflight.add(request.request_id, request.block_keys, decision.prefill, request.block_size)
        self.learner.remember(request, cluster, decision)

    # ---- learning -------------------------------------------------------------------------

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        """A prefill leg as soon as it is over (PrefillLegObserver: a NIXL prefill's answer, a mixed
        worker's first token): the prefill model learns it now, not after the request's decode,
        which on a cold start (and a mixed worker's load surge) came too late
        (docs/kvcache_aware.md, "Learning")."""
        self.learner.learn_leg(leg)

    def observe(self, observation: Observation) -> None:
        if self.inflight is not None:
            self.inflight.forget(observation.request_id)  # the index reports what the worker holds by now
        self.learner.learn(observation)

    def error_stats(self) -> tuple[ErrorStats, ...]:
        """Plain ErrorStats records for the gateway's Prometheus export."""
        return self.predictors.error_stats()


def _predictors(options: KvCacheAwareOptions) -> Predictors:
    """Predictors fitted from `predictor_params` (a JSON file written by `conductor fit`), or from
    the bundled profile, learning online as the learning options say."""
    learning = options.learning
    online = OnlineConfig(
        enabled=learning.online,
        window=learning.window,
        refit_every=learning.refit_every,
        mixed_refit_every=learning.mixed_refit_every,
        mixed_recent=learning.mixed_recent,
        ttft_bound_shift_s=options.admission.ttft_bound_shift_s,
        track_errors=learning.track_errors,
    )
    if not learning.predictor_params:
        return Predictors.from_bundled_profile(online)
    try:
        return Predictors.from_file(learning.predictor_params, online)
    except ValueError as exc:  # start-up must say which option is wrong
        raise ConfigError(f"kvcache_aware option 'predictor_params': {exc}", param="predictor_params") from exc
