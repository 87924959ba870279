"""Conductor's own policy: KVCache-centric scheduling (Mooncake FAST'25, Algorithm 1) with SLO
admission and prediction-based early rejection (Mooncake arXiv report, 7.4). The recommended one.

Per request: every prefill-capable instance gets a predicted TTFT (policies.estimate: pull a remote
prefix only when the predicted transfer beats recomputing it, plus the predicted queue and prefill);
the minimum wins. The decode instance is the one with the lowest predicted TBT once this request
joins, by its load now; admission then judges that instance at the moment the request would reach
it (`admission="predicted"`) or by the streams decoding there now (`"early"`); see
policies.admission. Mixed (non-disaggregated) workers are scored the same way, with the TBT check
on the same worker: among workers whose TTFT fits in a slack of its SLO and whose TBT bound meets
the TBT SLO, the one where the request's prefill pauses the fewest stream-seconds of decoding.
Cost per decision grows with the cluster as cheaply as that allows: instances holding no prefix
share one prefix plan (only their queues differ; pool_estimates.PoolPrefillEstimates), decode loads are
a count and a sum, and only the best `listed_candidates` of each pool are built into the decision.
tests/policies/test_kvcache_aware_differential.py holds these to the estimate-everything algorithm.

Learning: `on_decided` remembers (boundedly) what was predicted for each admitted request; `observe`
compares that with what happened, records the errors, and feeds the predictors' online refit:

* prefill: every observed prefill leg (queue_and_prefill_s) is a sample. Behind an FCFS queue the
  leg is the running head's remainder plus the queued prefills plus its own, so leg + the head's
  elapsed time - the predicted prefix pull is linear in the prefill coefficients with the summed
  features of the queue and the request (Predictors.queue_features / observe_leg). The model keeps
  learning under sustained load, when no leg runs on an empty queue.
* decode leg: TTFT at the client minus the prefill leg (KV handoff, the decode step in progress and
  the one that samples the first token, HTTP) is fitted as k0 + k1*handoff bytes + k2*TBT
  (Predictors.observe_decode_leg); k1 is the link's cost per byte, so the transfer model (handoffs
  and prefix pulls) learns from every request; the predicted TTFT is the leg plus this.
* TBT: the mean of the stream's token intervals, against the batch it joined (decode_batch + 1) and
  the resident KV then (decode_resident_kv_tokens plus its own prompt and half its output).
* calibrated bounds: observed / predicted TTFT (and TBT as admission judged it) go into bounded
  ratio windows (predictors.quantile); admission compares `ttft_quantile` (0.95) and
  `tbt_quantile` (0.9) upper bounds with the SLOs, so admitted requests near the bound still meet
  it; the exported p90 coverage is that of the same windows' 0.9 quantile, fixed at decision time.
"""

from __future__ import annotations

import math

from conductor.core.types import ClusterSnapshot, Decision, InstanceView, Observation, PrefillLeg, RequestView, Role
from policies.admission import AdmissionMode, admit, parse_mode, stall_rejection
from policies.base import (
    NO_INSTANCE,
    BasePolicy,
    listed_indices,
    mixed_choice,
    mixed_least_stall,
    no_instance,
    stalled_stream_s,
)
from policies.estimate import (
    DecodeEstimate,
    JoinForecast,
    decode_candidate,
    decode_loads_now,
    estimate_decode,
    prefill_candidate,
    prefill_pool,
    remote_sources,
    staging_waits,
    stall_fits,
)
from policies.inflight import InflightPrefixes, placement_best, with_inflight
from policies.local_prefill import LocalPrefill, local_decision, local_prefill_s
from policies.outcome_learning import OutcomeLearner
from policies.pool_estimates import PoolPrefillEstimates
from predictors.errors import ErrorStats
from predictors.online import OnlineConfig, Predictors
from predictors.params import INSTANCE_LINK, STORE_LINK


def pull_links(allow_pull: bool | str) -> frozenset[str]:
    """Link classes a policy may pull prefixes over: True/"both", "peer", "store", False/"none"."""
    links = ("both" if allow_pull else "none") if isinstance(allow_pull, bool) else allow_pull
    table = {"both": (INSTANCE_LINK, STORE_LINK), "peer": (INSTANCE_LINK,), "store": (STORE_LINK,), "none": ()}
    if links not in table:
        raise ValueError(f"allow_pull must be true, false, both, peer, store or none, not {allow_pull!r}")
    return frozenset(table[links])


def _lowest_load(tbts: list[float], batches: list[float]) -> int:
    """min(zip(tbts, batches, range(n)))[2]: the lowest (tbt, batch), the first of equals, by the
    comparisons those tuples make (items equal by identity or ==, then <), without building them."""
    best, best_t, best_b = 0, tbts[0], batches[0]
    for i in range(1, len(tbts)):
        t, b = tbts[i], batches[i]
        if not (t is best_t or t == best_t):
            if t < best_t:
                best, best_t, best_b = i, t, b
        elif not (b is best_b or b == best_b) and b < best_b:
            best, best_t, best_b = i, t, b
    return best


def _tbt_ratio(pred: Predictors, q: float) -> float:
    """The q-quantile of observed / judged TBT. While too few are held (the window is emptied by
    every refit that moves the model: on mixed workers, often), the fit's own: its in-sample 0.9
    ratio for an upper tail, its median for q <= 0.5, which a least-squares fit puts at about 1
    (the point prediction). The 0.9 ratio for q = 0.5 brought back the bound that quantile is there
    to avoid: live, 28 of 120 conversation requests on mixed workers rejected at 1.9-5.6x the point
    prediction while fewer than 20 ratios were held."""
    return pred.ratios.quantile("tbt_judged", q, pred.params.tbt.p90_ratio if q > 0.5 else 1.0)


def _idle(worker: InstanceView) -> bool:
    """A mixed worker where nothing decodes and no prefill waits. Its TBT is not judged: a stream
    there sees the step of a batch of one plus the pauses of the prefills sent after it, which no
    prediction knows, and a TBT model fitted while every step was a prefill (a backlog on every
    worker) predicts even an idle worker to miss; rejecting on that would turn every request
    away for good, since only admitted requests teach the model (live, 4 mixed workers at 4x the
    synthetic slice: 83 of 120 rejected, the model at 230 ms for a batch of one against 15 ms)."""
    return not worker.decodes and not worker.prefill_queue


class KvCacheAwarePolicy(BasePolicy):
    name = "kvcache_aware"

    def __init__(
        self,
        predictor_params: str | None = None,
        admission: str = "predicted",
        allow_pull: bool | str = True,
        online: bool = True,
        window: int = 512,
        refit_every: int = 32,
        refit_queue_fraction: float = 0.2,
        max_pending: int = 65536,
        forecast_joins: bool = False,
        predictors: Predictors | None = None,
        ttft_quantile: float | None = 0.95,
        tbt_quantile: float | None = 0.9,
        ttft_bound_shift_s: float = 0.0,
        probe_after: int | None = 100,
        listed_candidates: int | None = 8,
        ttft_slack: float | None = 1.0,
        inflight_prefixes: bool = True,
        max_inflight_keys: int = 200_000,
        track_errors: bool = True,
        local_prefill_tokens: int = 0,
        local_prefill_duty: float = 0.15,
        local_prefill_gain: float = 0.8,
        mixed_tbt_quantile: float | None = 0.5,
        mixed_ttft_slack: float | None = 0.8,
        mixed_protect_streams: bool = True,
    ) -> None:
        """`predictor_params`: a JSON file written by `conductor fit`; None fits the bundled
        profile now. `predictors`: an already built Predictors (the simulator shares one).
        `forecast_joins`: add queued prefills to the decode pool as they finish (see
        policies.admission); off because the gateway and the simulator already list a request
        under its decode instance from the moment it is dispatched. `ttft_quantile`: admission
        compares this calibrated upper quantile of the predicted TTFT with the SLO (None: the
        point prediction, as the paper does); see predictors.quantile. `tbt_quantile`: likewise for
        the TBT admission judges, calibrated on that judged figure, so a mode that judges the
        decode load worse (early: the load now) gets a wider bound. `ttft_bound_shift_s`: the TTFT
        bound's ratio window is shifted by this much (predictors.quantile; ignored when
        `predictors` is given, whose own OnlineConfig says). `refit_queue_fraction`:
        legs whose predicted queue is at most this fraction are also recorded as "prefill" errors.
        `probe_after`: after this many rejections in a row, admit the next request anyway. Admission
        learns only from admitted requests: predictions that run too high would otherwise reject
        everything for ever, with nothing observed to correct them (None: never probe).
        `listed_candidates`: how many instances of each pool a decision lists in `candidates` (the
        decision log, traces): the best this many by score, the chosen one always among them, in
        pool order; `Decision.unlisted_candidates` counts the rest (None: list every one). Every
        instance is still weighed; building and logging a score for each of hundreds would cost
        more than deciding.
        `ttft_slack` (0 < s <= 1; None: off, Algorithm 1's lowest TTFT; prefill pools only, see
        policies.inflight.placement_rank): among the instances where the request's TTFT at the
        client, as admission bounds it (`ttft_quantile`, with the chosen decode's TBT now), fits in
        s times its TTFT SLO, the one that computes least (its cached prefix and a pull cover the
        most), the lowest TTFT among equals; the lowest TTFT when none fits or the request has no
        TTFT SLO. Affinity is broken only where the SLO needs it: placing every request where it
        is fastest spends compute on prefixes another instance holds, capacity the queue behind it
        will lack under load.
        `inflight_prefixes`: count a prefix this policy dispatched to an instance, and that the
        index does not show yet, as cached there (policies/inflight.py; at most
        `max_inflight_keys` block keys remembered).
        `track_errors`: keep the per-instance prediction error windows (`error_stats`, exported by
        the gateway); they feed no decision, and a simulation, which never reads them, turns them
        off (ignored when `predictors` is given, whose own OnlineConfig says).
        `local_prefill_tokens` (0: off): prompts of at most this many tokens may be prefilled on a
        decode instance itself, within `local_prefill_duty` of its time, where that beats
        `local_prefill_gain` times the disaggregated TTFT or saves a rejection (policies/local_prefill.py;
        the decodes must compute requests that carry no KV transfer, as vLLM's kv_both engines do).
        `mixed_tbt_quantile` (mixed workers): the `tbt_quantile` used there. A stream's mean TBT on
        a mixed worker depends on how many prefills land during its decode, so it spreads widely
        around the prediction (live, 8-token streams: the 0.9 quantile of actual / predicted was
        2.8), and admitting only where the 0.9 bound meets the SLO turned away requests that met it
        nine times in ten. 0.5 admits a request when it is more likely to meet its TBT SLO than not.
        `mixed_ttft_slack` (0 < s <= 1; None: off, the lowest TTFT; mixed workers only): among the
        workers whose predicted TTFT, under the calibrated `ttft_quantile` bound, fits in s times
        the TTFT SLO and whose TBT bound meets the TBT SLO, the one where the request's prefill
        stalls the fewest stream-seconds (its compute there times the streams it pauses, plus
        one for the capacity it takes; policies.base.mixed_least_stall).
        `mixed_protect_streams` (mixed workers, with admission): only workers whose decoding streams
        can absorb the request's prefill and keep their TBT SLO (policies.estimate.stall_fits: the
        spare TBT per token over each one's remaining tokens, at most a tenth of them short) are
        placed on; where the chosen worker's cannot, the request is rejected (`tbt_slo`). The TBT
        prediction of the request's own stream does not see the prefills that later land on its
        worker; this check is what keeps admitting those prefills from breaking the streams there."""
        self.admission = parse_mode(admission)
        self.pull_links = pull_links(allow_pull)
        self.allow_pull = bool(self.pull_links)
        self.ttft_quantile = ttft_quantile
        self.tbt_quantile = tbt_quantile
        self.forecast_joins = forecast_joins
        if predictors is None:
            cfg = OnlineConfig(
                enabled=online,
                window=window,
                refit_every=refit_every,
                ttft_bound_shift_s=ttft_bound_shift_s,
                track_errors=track_errors,
            )
            fitted = Predictors.from_file(predictor_params, cfg) if predictor_params else None
            predictors = fitted or Predictors.from_bundled_profile(cfg)
        self.predictors = predictors
        self.learner = OutcomeLearner(predictors, refit_queue_fraction=refit_queue_fraction, max_pending=max_pending)
        self.probe_after = probe_after
        self._rejected_in_a_row = 0
        if listed_candidates is not None and listed_candidates < 1:
            raise ValueError(f"listed_candidates must be at least 1 or None, not {listed_candidates!r}")
        self.listed_candidates = listed_candidates
        if ttft_slack is not None and not 0.0 < ttft_slack <= 1.0:
            raise ValueError(f"ttft_slack must be in (0, 1] or None, not {ttft_slack!r}")
        self.ttft_slack = ttft_slack
        self.inflight = InflightPrefixes(max_inflight_keys) if inflight_prefixes else None
        self.local = (
            LocalPrefill(local_prefill_tokens, max_duty=local_prefill_duty, gain=local_prefill_gain)
            if local_prefill_tokens
            else None
        )
        self.mixed_tbt_quantile = mixed_tbt_quantile
        if mixed_ttft_slack is not None and not 0.0 < mixed_ttft_slack <= 1.0:
            raise ValueError(f"mixed_ttft_slack must be in (0, 1] or None, not {mixed_ttft_slack!r}")
        self.mixed_ttft_slack = mixed_ttft_slack
        self.mixed_protect_streams = mixed_protect_streams

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
        pred = self.predictors
        prefills, disaggregated = prefill_pool(cluster)
        if only_p is not None:
            prefills = tuple(p for p in prefills if p.id == only_p)
        if not prefills:
            return no_instance(request, self.name, Role.PREFILL if disaggregated else Role.MIXED)
        decodes = cluster.by_role(Role.DECODE) if disaggregated else ()
        if only_d is not None:
            decodes = tuple(d for d in decodes if d.id == only_d)
        if disaggregated and not decodes:
            return no_instance(request, self.name, Role.DECODE)
        sources = []
        if self.pull_links and only_p is None and (request.cached or request.store_cached_tokens or request.pull_sources):
            sources = [s for s in remote_sources(request) if s[2] in self.pull_links]
        # every instance is weighed (the same predictions, bit for bit, as estimating each in full);
        # full estimates are built only for the few a decision lists (see listed_indices). A prefix
        # in flight counts as its instance's own, not as a source: nothing can pull it yet
        waits = staging_waits(pred, request, prefills) if sources and request.queued_pull_sources else None
        weighed = PoolPrefillEstimates(
            pred,
            with_inflight(self.inflight, request),
            prefills,
            sources,
            allow_pull=bool(sources),
            disaggregated=disaggregated,
            waits=waits,
        )
        ttfts, keep = weighed.ttfts, self.listed_candidates
        predicted = self.admission is AdmissionMode.PREDICTED
        # the TBT bound admission judges is the prediction times this ratio (mixed workers: their own quantile)
        tbt_q = self.tbt_quantile if disaggregated else self.mixed_tbt_quantile
        tbt_ratio = 1.0 if tbt_q is None else _tbt_ratio(pred, tbt_q)
        unabsorbed_s: float | None = None  # mixed: the prefill that the chosen worker's streams cannot absorb
        if disaggregated:
            # the decode instance is chosen by its load now, dispatched-but-prefilling streams
            # included; choosing by the forecast instead herds requests onto instances whose
            # streams are about to finish, and their freed capacity is soon taken anyway. It does
            # not depend on the prefill chosen, so it comes first: the slack needs its TBT
            tbts, batches, kvs = decode_loads_now(pred, request, decodes)
            chosen_d = _lowest_load(tbts, batches)
            d_listed = {
                i: DecodeEstimate(decodes[i], tbts[i], batches[i], kvs[i], 0.0) for i in listed_indices(tbts, keep, chosen_d)
            }
            chosen_decode: DecodeEstimate | None = d_listed[chosen_d]
            d_ests = list(d_listed.values())
            # the first of the best by placement_rank (policies.inflight), as min() of estimates
            best_i = placement_best(self._slack_limit(request, weighed, tbts[chosen_d]), weighed)
            listed = listed_indices(ttfts, keep, best_i)
        else:
            # mixed: the request decodes where it prefilled, so weigh both on the same worker. Its
            # prefill pauses every stream decoding there for as long as it computes, which no TBT
            # prediction of the worker sees, so among the workers whose TTFT fits in
            # `mixed_ttft_slack` of the SLO (and whose TBT bound meets that SLO) the one where it
            # stalls the fewest stream-seconds wins (policies.base.mixed_least_stall): live, 4 mixed
            # workers at 4x the synthetic slice, 7.37 -> 10.05 req/s against the lowest TTFT, whose
            # TTFT p50 had 1.1 s to spare while the TBT missed. Least compute alone (the P/D slack)
            # piled the prefills on the prefix's holder and its streams (tool-agent at 4x: 24% of
            # requests met both SLOs against 100%). Without a TTFT SLO, or where no worker fits:
            # the lowest TTFT among workers whose TBT bound meets the SLO (the first if none does)
            mixed: dict[int, DecodeEstimate] = {}

            def on_worker(i: int) -> DecodeEstimate:
                if i not in mixed:
                    mixed[i] = estimate_decode(pred, request, prefills[i], ttfts[i] if predicted else 0.0, None)
                return mixed[i]

            # judged as admission will judge it: under the same calibrated bound (a placement by the
            # point prediction chose workers whose bound admission then rejected, beside one that fit)
            def bound(i: int) -> float:
                return 0.0 if _idle(prefills[i]) else on_worker(i).tbt_s * tbt_ratio

            works = weighed.works()
            stalled = [stalled_stream_s(w, len(p.decodes)) for w, p in zip(works, prefills, strict=True)]
            slo_tbt = request.slo.tbt_s
            protect = None
            if self.mixed_protect_streams and slo_tbt is not None and self.admission is not AdmissionMode.NONE:

                def protect(i: int) -> bool:  # its streams absorb the request's prefill (stall_fits)
                    return stall_fits(prefills[i], works[i], slo_tbt - bound(i))

            stall_i = None
            if self.mixed_ttft_slack is not None and request.slo.ttft_s is not None:
                limit = self.mixed_ttft_slack * request.slo.ttft_s
                if self.ttft_quantile is not None:
                    limit = pred.largest_within("ttft", limit, self.ttft_quantile)
                stall_i = mixed_least_stall(ttfts, stalled, limit, bound, slo_tbt, protect)
            if stall_i is not None:
                best_i = stall_i
            elif protect is None:
                best_i = mixed_choice(ttfts, bound, slo_tbt)
            else:  # the lowest TTFT among the workers that meet the TBT SLO and whose streams absorb it
                best_i = mixed_choice(ttfts, lambda i: bound(i) if protect(i) else math.inf, slo_tbt)
            if protect is not None and stall_i is None and not protect(best_i):  # stall_i passed protect
                unabsorbed_s = works[best_i]
            chosen_decode = on_worker(best_i)
            listed = listed_indices(ttfts, keep, best_i)
            d_ests = [on_worker(i) for i in listed]  # the same workers as their prefill candidates
        best = weighed.estimate(best_i)
        ests = [weighed.estimate(i) for i in listed]
        unlisted = len(prefills) + (len(decodes) if disaggregated else len(prefills)) - len(ests) - len(d_ests)
        judged = chosen_decode
        if disaggregated and predicted and chosen_decode is not None:
            # prediction-based early rejection: the chosen instance as it will be on arrival
            pool = prefill_pool(cluster)[0] if only_p is not None else prefills
            joins = JoinForecast(pred, pool, len(cluster.by_role(Role.DECODE))) if self.forecast_joins else None
            judged = estimate_decode(pred, request, chosen_decode.instance, best.ttft_s, joins)
        elif self.admission is AdmissionMode.EARLY and chosen_decode is not None:
            # plain early rejection judges the load now: the streams already decoding there
            judged = estimate_decode(pred, request, chosen_decode.instance, 0.0, None, include_pending=False)
        tbt: float | None = None
        if chosen_decode is not None:  # in predicted mode, the forecast for when it gets there
            tbt = judged.tbt_s if predicted and judged is not None else chosen_decode.tbt_s
        # TTFT at the client: the prefill leg, then (disaggregated) the decode leg -- handoff,
        # the decode step in progress and the one that samples the first token, HTTP -- learned
        # from the gateway's own observations; a mixed worker's first token ends its prefill leg
        first_tbt = 0.0
        if chosen_decode is not None:
            first_tbt = judged.tbt_s if predicted and judged is not None else chosen_decode.tbt_s
        leg = best.transfer_s + best.queue_s + best.prefill_s
        ttft = leg + pred.first_token_s(best.handoff_s, first_tbt) if disaggregated else best.ttft_s
        ttft_bound = ttft if self.ttft_quantile is None else pred.bound("ttft", ttft, self.ttft_quantile)
        tbt_bound = None
        if judged is not None and tbt_q is not None:
            tbt_bound = judged.tbt_s * tbt_ratio
        if not disaggregated and _idle(best.instance):
            judged = None  # an idle mixed worker: its TBT is not judged (_idle says why)
        rejection = admit(
            pred, request, self.admission, best, judged, ttft_s=ttft, ttft_bound_s=ttft_bound, tbt_bound_s=tbt_bound
        )
        if rejection is None and unabsorbed_s is not None:
            rejection = stall_rejection(request, best.instance, unabsorbed_s, chosen_decode.tbt_s if chosen_decode else 0.0)
        if disaggregated:
            p_candidates = tuple(prefill_candidate(e) for e in ests)
        else:  # the decision log shows what the mixed placement ranked by
            p_candidates = tuple(prefill_candidate(e, stalled[i]) for i, e in zip(listed, ests, strict=True))
        candidates = p_candidates + tuple(decode_candidate(e, judged if e is chosen_decode else None) for e in d_ests)
        if self.local is not None and disaggregated and only_p is None:
            plan = self.local.plan(pred, request, decodes, tbts, cluster.now)
            if (
                plan is not None
                and self.local.worth_it(plan, ttft, rejection is not None, best.cached_tokens, request.prompt_tokens)
                and (
                    # a margin, not the calibrated bound: that is learned from disaggregated legs
                    request.slo.ttft_s is None or plan.ttft_s <= request.slo.ttft_s * 0.9
                )
            ):
                return local_decision(plan, request, self.name, candidates, unlisted)
        if rejection is not None and self.probe_after is not None and self._rejected_in_a_row >= self.probe_after:
            rejection = None  # a probe: let one through so the predictors see what really happens
        if rejection is not None:
            return Decision(
                request_id=request.request_id,
                policy=self.name,
                rejection=rejection,
                predicted_ttft_s=ttft,
                predicted_tbt_s=tbt,
                candidates=candidates,
                unlisted_candidates=unlisted,
            )
        decode_id = chosen_decode.instance.id if disaggregated and chosen_decode is not None else None
        return Decision(
            request_id=request.request_id,
            policy=self.name,
            prefill=best.instance.id,
            decode=decode_id,
            predicted_ttft_s=ttft,
            predicted_tbt_s=tbt,
            pull_from=best.pull_from,
            pull_tokens=best.pulled_tokens,
            candidates=candidates,
            unlisted_candidates=unlisted,
        )

    def _slack_limit(self, request: RequestView, weighed: PoolPrefillEstimates, first_tbt_s: float) -> float | None:
        """The longest predicted prefill leg `ttft_slack` allows this request, or None (no slack,
        no TTFT SLO). Judged on the TTFT at the client as admission judges it: the leg, then the
        decode leg with the chosen decode's TBT now (`first_tbt_s`), under the calibrated
        `ttft_quantile` bound, which must be at most slack x the SLO. A limit on the point
        prediction instead let the leg use the whole SLO: the instance holding the prefix kept
        being chosen while its bound already missed, and admission then turned the request away
        (live, 4P+4D tool-agent at 13x: 29 rejections, 0.77x round robin's goodput)."""
        slo = request.slo.ttft_s
        if self.ttft_slack is None or slo is None:
            return None
        pred = self.predictors
        target = self.ttft_slack * slo
        if self.ttft_quantile is not None:
            target = pred.largest_within("ttft", target, self.ttft_quantile)
        return target - pred.first_token_s(weighed.handoff_s, first_tbt_s)

    # ---- remembering ----------------------------------------------------------------------

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        """The one place this policy's memory changes after a decision.

        State, and why: `_rejected_in_a_row` (SLO rejections since the last admitted request, for
        the `probe_after` probe), `inflight` (the prefixes dispatched and not yet indexed), the
        local prefills' duty, and the learner's pending predictions (policies/outcome_learning.py:
        what was predicted for each admitted request, bounded by `max_pending`, until `observe`
        compares it with what happened).
        """
        if decision.rejection is not None:
            if decision.rejection.reason != NO_INSTANCE:
                self._rejected_in_a_row += 1
            return
        self._rejected_in_a_row = 0
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
        now, not after the request's decode. On a cold start (the bundled profile 3x fast against
        the workers) the first refits came after the first requests' whole decodes, while a burst
        kept joining the prefix's holder on the optimistic predictions (docs/simulator.md)."""
        self.learner.learn_leg(leg)

    def observe(self, observation: Observation) -> None:
        obs = observation
        if self.inflight is not None:
            self.inflight.forget(obs.request_id)  # the index reports what the worker holds by now
        self.learner.learn(obs)

    def error_stats(self) -> tuple[ErrorStats, ...]:
        """Plain ErrorStats records for the gateway's Prometheus export."""
        return self.predictors.error_stats()
