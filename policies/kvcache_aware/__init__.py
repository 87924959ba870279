"""Conductor's own policy, the recommended one: KVCache-centric scheduling (Mooncake FAST'25,
Algorithm 1) with SLO admission and prediction-based early rejection (Mooncake arXiv report, 7.4).

A decision runs six stages (`KvCacheAwarePolicy._decide`):

1. candidates: the prefill-capable pool (prefill instances, or mixed workers), the decode pool, and
   the remote prefixes the request may pull over the links `allow_pull` allows (stages.py).
2. estimates: each prefill-capable instance's predicted TTFT: the pull where the predicted transfer
   beats recomputing, its queue, its prefill of the rest, the KV handoff (pool_estimates.py).
3. placement: the decode with the lowest TBT by its load now; the prefill that computes least among
   those whose bounded TTFT at the client fits `ttft_slack` of the SLO, else the lowest TTFT
   (placement.py). Mixed workers: the fewest stream-seconds stalled within `mixed_ttft_slack`
   (mixed.py).
4. admission: the TTFT at the client and the TBT on arrival, as calibrated upper bounds, against
   the SLOs; a predicted miss is a rejection, nothing is forwarded (stages.py, policies.admission).
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

from conductor.core.errors import ConfigError
from conductor.core.types import ClusterSnapshot, Decision, Observation, PrefillLeg, RequestView
from policies.base import NO_INSTANCE, BasePolicy
from policies.estimate import decode_candidate, prefill_candidate
from policies.kvcache_aware.inflight import InflightPrefixes
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
from policies.kvcache_aware.sessions import MOVED, Marks, SessionTable, mark_session, prefer_session
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
        placement (`judge`)."""
        pred, options = self.predictors, self.options
        pools = candidates(request, cluster, self.pull_links, only_p, only_d, self.name)
        if isinstance(pools, Decision):
            return pools  # no healthy instance in a pool the request needs
        weighed = estimates(pred, request, pools, self.inflight)
        if pools.disaggregated:
            tbt = TbtBound.of(pred, options.admission.tbt_quantile)
            placed = place_disaggregated(
                pred, request, pools.decodes, weighed, options.placement, options.admission.ttft_quantile
            )
        else:
            tbt = TbtBound.of(pred, options.mixed.tbt_quantile)  # mixed workers judge TBT at their own quantile
            placed = place_mixed(pred, request, weighed, options, tbt)
        placed, verdict, mark = self._admit(request, cluster, pools, weighed, placed, tbt)
        local = local_fallback(self.local, pred, request, cluster, pools, placed, verdict)
        rejection = probed(verdict.rejection, options.admission.probe_after, self._rejected_in_a_row)
        decision = explain(request, self.name, pools, weighed, placed, verdict, rejection, local)
        return decision if mark is None else mark_session(decision, mark)

    def _admit(
        self,
        request: RequestView,
        cluster: ClusterSnapshot,
        pools: Pools,
        weighed: PoolPrefillEstimates,
        placed: Placement,
        tbt: TbtBound,
    ) -> tuple[Placement, Verdict, Marks | None]:
        """Stage 4, admission, of the placement, or of the session's own instances where they are
        within the slacks (sessions.py); a session whose instances would miss an SLO that the
        placement meets moves. The mark for the decision's candidates (None: no session known)."""
        pred, options = self.predictors, self.options
        last = None
        if self.sessions is not None and request.session is not None and pools.disaggregated and not pools.pinned:
            last = self.sessions.last(request.session)
        if last is None:
            return placed, admission(pred, request, cluster, pools, weighed, placed, options.admission, tbt), None
        listed = options.placement.listed_candidates
        steered, mark = prefer_session(pred, request, last, pools.decodes, weighed, placed, options.sessions, listed)
        verdict = admission(pred, request, cluster, pools, weighed, steered, options.admission, tbt)
        if verdict.rejection is not None and steered is not placed:
            plain = admission(pred, request, cluster, pools, weighed, placed, options.admission, tbt)
            if plain.rejection is None:
                return placed, plain, (MOVED, MOVED)
        return steered, verdict, mark

    # ---- remembering ----------------------------------------------------------------------

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        """The one place this policy's memory changes after a decision.

        State, and why: `_rejected_in_a_row` (SLO rejections since the last admitted request, for
        the `probe_after` probe), `sessions` (each session's last instances, sessions.py),
        `inflight` (the prefixes dispatched and not yet indexed), the local prefills' duty, and the
        learner's pending predictions (learning.py: what was predicted for each admitted request,
        bounded by `max_pending`, until `observe` compares it with what happened).
        """
        if decision.rejection is not None:
            if decision.rejection.reason != NO_INSTANCE:
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
        """A prefill leg as soon as it answered (PrefillLegObserver): the prefill model learns it
        now, not after the request's decode, which on a cold start came too late
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
        ttft_bound_shift_s=options.admission.ttft_bound_shift_s,
        track_errors=learning.track_errors,
    )
    if not learning.predictor_params:
        return Predictors.from_bundled_profile(online)
    try:
        return Predictors.from_file(learning.predictor_params, online)
    except ValueError as exc:  # start-up must say which option is wrong
        raise ConfigError(f"kvcache_aware option 'predictor_params': {exc}", param="predictor_params") from exc
