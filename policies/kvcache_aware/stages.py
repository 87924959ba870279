"""The stages of a decision but placement (policies/kvcache_aware/placement.py, mixed.py):
candidates, estimates, admission, fallback, explain. Each is a function of what the stages before
it produced; none changes the policy's state (on_decided does, after).
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.core.types import ClusterSnapshot, Decision, InstanceView, Rejection, RequestView, Role
from policies.admission import AdmissionMode, admit, stall_rejection
from policies.base import no_instance
from policies.estimate import (
    DecodeEstimate,
    JoinForecast,
    PrefillEstimate,
    decode_candidate,
    estimate_decode,
    prefill_candidate,
    prefill_pool,
    remote_sources,
    staging_waits,
)
from policies.kvcache_aware.inflight import InflightPrefixes, with_inflight
from policies.kvcache_aware.mixed import idle
from policies.kvcache_aware.options import AdmissionOptions
from policies.kvcache_aware.placement import Placement, TbtBound
from policies.kvcache_aware.pool_estimates import PoolPrefillEstimates
from policies.local_prefill import LocalPlan, LocalPrefill, local_decision
from predictors.online import Predictors

# a local prefill must fit in this share of the TTFT SLO: a margin, not the calibrated bound, which
# is learned from disaggregated legs
LOCAL_TTFT_MARGIN = 0.9


@dataclass(slots=True)
class Pools:
    """Stage 1, candidates: the instances a decision weighs, and the prefixes it may pull."""

    prefills: tuple[InstanceView, ...]  # prefill-capable: the prefill pool, or the mixed workers
    decodes: tuple[InstanceView, ...]  # the decode pool; () on mixed workers
    disaggregated: bool
    sources: list[tuple[int, str, str]]  # (tokens, source, link) of the remote prefixes it may pull
    pinned: bool  # the placement was chosen by someone else (`judge`): no pulls, no local prefill


@dataclass(slots=True)
class Verdict:
    """Stage 4, admission: the predictions for the placement, and the rejection if they miss."""

    best: PrefillEstimate  # the chosen prefill instance's estimate
    judged: DecodeEstimate | None  # the decode as admission judged it; None: an idle mixed worker, not judged
    ttft_s: float  # predicted TTFT at the client
    tbt_s: float  # predicted TBT (in predicted mode, for when the request gets to its decode)
    rejection: Rejection | None


def candidates(
    request: RequestView, cluster: ClusterSnapshot, links: frozenset[str], only_p: str | None, only_d: str | None, policy: str
) -> Pools | Decision:
    """The pools (narrowed to `only_p` / `only_d` when judging someone else's placement), or the
    503 decision when one the request needs is empty."""
    prefills, disaggregated = prefill_pool(cluster)
    if only_p is not None:
        prefills = tuple(p for p in prefills if p.id == only_p)
    if not prefills:
        return no_instance(request, policy, Role.PREFILL if disaggregated else Role.MIXED)
    decodes = cluster.by_role(Role.DECODE) if disaggregated else ()
    if only_d is not None:
        decodes = tuple(d for d in decodes if d.id == only_d)
    if disaggregated and not decodes:
        return no_instance(request, policy, Role.DECODE)
    sources: list[tuple[int, str, str]] = []
    if links and only_p is None and (request.cached or request.store_cached_tokens or request.pull_sources):
        sources = [s for s in remote_sources(request) if s[2] in links]
    return Pools(prefills, decodes, disaggregated, sources, only_p is not None)


def estimates(pred: Predictors, request: RequestView, pools: Pools, inflight: InflightPrefixes | None) -> PoolPrefillEstimates:
    """Stage 2: every prefill-capable instance weighed (the same predictions, bit for bit, as
    estimating each in full; full estimates are built only for the few a decision lists). A prefix
    in flight counts as its instance's own, not as a source: nothing can pull it yet."""
    waits = staging_waits(pred, request, pools.prefills) if pools.sources and request.queued_pull_sources else None
    return PoolPrefillEstimates(
        pred,
        with_inflight(inflight, request),
        pools.prefills,
        pools.sources,
        allow_pull=bool(pools.sources),
        disaggregated=pools.disaggregated,
        waits=waits,
    )


def admission(
    pred: Predictors,
    request: RequestView,
    cluster: ClusterSnapshot,
    pools: Pools,
    weighed: PoolPrefillEstimates,
    placed: Placement,
    options: AdmissionOptions,
    tbt: TbtBound,
) -> Verdict:
    """Stage 4: the TTFT at the client and the TBT for the placement, and admission's verdict on
    their calibrated bounds (policies.admission). `predicted` judges the decode as it will be when
    the request reaches it (prediction-based early rejection), `early` by the streams decoding
    there now. The TTFT at the client is the prefill leg, then (disaggregated) the decode leg --
    handoff, the decode step in progress and the one that samples the first token, HTTP -- learned
    from the gateway's own observations; a mixed worker's first token ends its prefill leg."""
    best = weighed.estimate(placed.best)
    chosen = placed.decode
    predicted = options.mode is AdmissionMode.PREDICTED
    judged: DecodeEstimate | None = chosen
    if pools.disaggregated and predicted:
        pool = prefill_pool(cluster)[0] if pools.pinned else pools.prefills
        joins = JoinForecast(pred, pool, len(cluster.by_role(Role.DECODE))) if options.forecast_joins else None
        judged = estimate_decode(pred, request, chosen.instance, best.ttft_s, joins)
    elif options.mode is AdmissionMode.EARLY:
        judged = estimate_decode(pred, request, chosen.instance, 0.0, None, include_pending=False)
    assert judged is not None
    tbt_s = judged.tbt_s if predicted else chosen.tbt_s  # in predicted mode, for when it gets there
    leg = best.transfer_s + best.queue_s + best.prefill_s
    ttft = leg + pred.first_token_s(best.handoff_s, tbt_s) if pools.disaggregated else best.ttft_s
    ttft_bound = ttft if options.ttft_quantile is None else pred.bound("ttft", ttft, options.ttft_quantile)
    tbt_bound = None if tbt.quantile is None else judged.tbt_s * tbt.ratio
    if placed.tbt_floor_s > 0.0:  # mixed: no lower than the pace the chosen worker's streams get
        tbt_bound = max(judged.tbt_s if tbt_bound is None else tbt_bound, placed.tbt_floor_s)
    if placed.tbt_stretch != 1.0:  # a less urgent class on a mixed worker: its prefill duty (prefill_duty.py)
        tbt_bound = (judged.tbt_s if tbt_bound is None else tbt_bound) * placed.tbt_stretch
    if not pools.disaggregated and idle(best.instance):
        judged = None  # an idle mixed worker: its TBT is not judged (mixed.idle says why)
    rejection = admit(pred, request, options.mode, best, judged, ttft_s=ttft, ttft_bound_s=ttft_bound, tbt_bound_s=tbt_bound)
    if rejection is None and placed.unabsorbed_s is not None:
        rejection = stall_rejection(request, best.instance, placed.unabsorbed_s, chosen.tbt_s)
    return Verdict(best, judged, ttft, tbt_s, rejection)


def local_fallback(
    local: LocalPrefill | None,
    pred: Predictors,
    request: RequestView,
    cluster: ClusterSnapshot,
    pools: Pools,
    placed: Placement,
    verdict: Verdict,
) -> LocalPlan | None:
    """Stage 5, fallback: a prefill on a decode instance itself (policies/local_prefill.py), where
    that beats the disaggregated placement by the gain or saves its rejection, within the margin of
    the TTFT SLO; None to keep the disaggregated placement."""
    if local is None or not pools.disaggregated or pools.pinned:
        return None
    assert placed.decode_tbts is not None  # every disaggregated placement weighs the decodes
    plan = local.plan(pred, request, pools.decodes, placed.decode_tbts, cluster.now)
    if plan is None:
        return None
    best = verdict.best
    if not local.worth_it(plan, verdict.ttft_s, verdict.rejection is not None, best.cached_tokens, request.prompt_tokens):
        return None
    slo = request.slo.ttft_s
    return plan if slo is None or plan.ttft_s <= slo * LOCAL_TTFT_MARGIN else None


def probed(rejection: Rejection | None, probe_after: int | None, rejected_in_a_row: int) -> Rejection | None:
    """Stage 5, fallback: after `probe_after` rejections in a row one request is let through, so
    the predictors see what really happens (admission learns only from admitted requests)."""
    if rejection is not None and probe_after is not None and rejected_in_a_row >= probe_after:
        return None
    return rejection


def explain(
    request: RequestView,
    policy: str,
    pools: Pools,
    weighed: PoolPrefillEstimates,
    placed: Placement,
    verdict: Verdict,
    rejection: Rejection | None,
    local: LocalPlan | None,
) -> Decision:
    """Stage 6: the decision, with the candidates it lists (the best few of each pool and the
    chosen ones, in pool order; mixed workers show the stream-seconds their placement ranked by)
    and how many it weighed without listing."""
    listed = [weighed.estimate(i) for i in placed.listed]
    decodes = placed.decodes_listed
    n_decodes = len(pools.decodes) if pools.disaggregated else len(pools.prefills)
    unlisted = len(pools.prefills) + n_decodes - len(listed) - len(decodes)
    if pools.disaggregated or placed.stalled is None:
        prefill_scores = tuple(prefill_candidate(e) for e in listed)
    else:
        stalled = placed.stalled
        prefill_scores = tuple(prefill_candidate(e, stalled[i]) for i, e in zip(placed.listed, listed, strict=True))
    chosen = placed.decode
    scores = prefill_scores + tuple(
        decode_candidate(e, verdict.judged, placed.tbt_floor_s) if e is chosen else decode_candidate(e) for e in decodes
    )
    if local is not None:
        return local_decision(local, request, policy, scores, unlisted)
    if rejection is not None:
        return Decision(
            request_id=request.request_id,
            policy=policy,
            rejection=rejection,
            predicted_ttft_s=verdict.ttft_s,
            predicted_tbt_s=verdict.tbt_s,
            candidates=scores,
            unlisted_candidates=unlisted,
        )
    best = verdict.best
    return Decision(
        request_id=request.request_id,
        policy=policy,
        prefill=best.instance.id,
        decode=chosen.instance.id if pools.disaggregated else None,
        predicted_ttft_s=verdict.ttft_s,
        predicted_tbt_s=verdict.tbt_s,
        pull_from=best.pull_from,
        pull_tokens=best.pulled_tokens,
        candidates=scores,
        unlisted_candidates=unlisted,
    )
