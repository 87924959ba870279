"""Conductor's own policy: KVCache-centric scheduling (Mooncake FAST'25, Algorithm 1) with SLO
admission and prediction-based early rejection (Mooncake arXiv report, 7.4). The recommended one.

Per request: every prefill-capable instance gets a predicted TTFT (policies.estimate: pull a remote
prefix only when the predicted transfer beats recomputing it, plus the predicted queue and prefill);
the minimum wins. The decode instance is the one with the lowest predicted TBT once this request
joins, by its load now; admission then judges that instance at the moment the request would reach
it (`admission="predicted"`) or by the streams decoding there now (`"early"`); see
policies.admission. Mixed (non-disaggregated) workers are scored the same way, with the TBT check
on the same worker: among workers whose predicted TBT meets the SLO, the one with the lowest TTFT.

Learning: `decide` remembers (boundedly) what it predicted for each admitted request; `observe`
compares that with what happened, records the errors, and feeds the predictors' online refit:

* prefill: an observed prefill leg (queue_and_prefill_s) includes waiting behind the queue and the
  prefix pull. Only legs dispatched to a (nearly) empty queue are used -- predicted queue at dispatch
  at most `refit_queue_fraction` of the leg -- with the predicted queue and pull subtracted. Using
  every leg with the queue subtracted would teach the compute model the queue model's errors; under
  sustained load the model therefore keeps its last fit rather than drifting.
* TBT: the mean of the stream's token intervals, against the batch it joined (decode_batch + 1) and
  the resident KV then (decode_resident_kv_tokens plus its own prompt and half its output).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType

from policies.admission import AdmissionMode, admit, parse_mode
from policies.base import BasePolicy, no_instance
from policies.estimate import (
    DecodeEstimate,
    JoinForecast,
    PrefillEstimate,
    estimate_decode,
    estimate_prefill,
    prefill_pool,
    remote_sources,
)
from policies.types import CandidateScore, ClusterSnapshot, Decision, Observation, RequestView, Role
from predictors.errors import ErrorStats
from predictors.online import OnlineConfig, Predictors


@dataclass(frozen=True, slots=True)
class _Pending:
    """What was predicted for an admitted request, kept until its observation arrives."""

    prefill: str
    decode: str | None
    cached_tokens: int
    queue_s: float
    transfer_s: float
    prefill_s: float
    ttft_s: float
    tbt_s: float | None


def prefill_candidate(est: PrefillEstimate) -> CandidateScore:
    return CandidateScore(
        instance_id=est.instance.id,
        role=est.instance.role,
        score=est.ttft_s,
        predicted_ttft_s=est.ttft_s,
        detail=MappingProxyType(
            {
                "transfer_s": est.transfer_s,
                "queue_s": est.queue_s,
                "prefill_s": est.prefill_s,
                "handoff_s": est.handoff_s,
                "cached_tokens": float(est.cached_tokens),
                "pulled_tokens": float(est.pulled_tokens),
            }
        ),
    )


def decode_candidate(est: DecodeEstimate, judged: DecodeEstimate | None = None) -> CandidateScore:
    """A decode instance as weighed for the choice; the chosen one also says how admission saw it."""
    detail = {"batch": est.batch, "resident_kv_tokens": est.resident_kv_tokens, "at_s": est.at_s}
    if judged is not None and judged is not est:
        detail.update(admission_tbt_s=judged.tbt_s, admission_batch=judged.batch, admission_at_s=judged.at_s)
    return CandidateScore(
        instance_id=est.instance.id,
        role=est.instance.role,
        score=est.tbt_s,
        predicted_tbt_s=est.tbt_s,
        detail=MappingProxyType(detail),
    )


class KvCacheAwarePolicy(BasePolicy):
    name = "kvcache_aware"

    def __init__(
        self,
        predictor_params: str | None = None,
        admission: str = "predicted",
        allow_pull: bool = True,
        online: bool = True,
        window: int = 512,
        refit_every: int = 32,
        refit_queue_fraction: float = 0.2,
        max_pending: int = 65536,
        forecast_joins: bool = False,
        predictors: Predictors | None = None,
    ) -> None:
        """`predictor_params`: a JSON file written by `conductor fit`; None fits the bundled
        profile now. `predictors`: an already built Predictors (the simulator shares one).
        `forecast_joins`: add queued prefills to the decode pool as they finish (see
        policies.admission); off because the gateway and the simulator already list a request
        under its decode instance from the moment it is dispatched."""
        self.admission = parse_mode(admission)
        self.allow_pull = allow_pull
        self.refit_queue_fraction = refit_queue_fraction
        self.forecast_joins = forecast_joins
        if predictors is None:
            cfg = OnlineConfig(enabled=online, window=window, refit_every=refit_every)
            fitted = Predictors.from_file(predictor_params, cfg) if predictor_params else None
            predictors = fitted or Predictors.from_bundled_profile(cfg)
        self.predictors = predictors
        self._max_pending = max(1, max_pending)
        self._pending: OrderedDict[str, _Pending] = OrderedDict()

    # ---- deciding -------------------------------------------------------------------------

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        pred = self.predictors
        prefills, disaggregated = prefill_pool(cluster)
        if not prefills:
            return no_instance(request, self.name, Role.PREFILL if disaggregated else Role.MIXED)
        decodes = cluster.by_role(Role.DECODE) if disaggregated else ()
        if disaggregated and not decodes:
            return no_instance(request, self.name, Role.DECODE)
        sources = remote_sources(request) if request.cached or request.store_cached_tokens else []
        ests = [
            estimate_prefill(pred, request, p, sources, allow_pull=self.allow_pull, disaggregated=disaggregated) for p in prefills
        ]
        predicted = self.admission is AdmissionMode.PREDICTED
        if disaggregated:
            best = min(ests, key=lambda e: e.ttft_s)
            # the decode instance is chosen by its load now, dispatched-but-prefilling streams
            # included; choosing by the forecast instead herds requests onto instances whose
            # streams are about to finish, and their freed capacity is soon taken anyway
            d_ests = [estimate_decode(pred, request, d, 0.0) for d in decodes]
            chosen_decode: DecodeEstimate | None = min(d_ests, key=lambda e: (e.tbt_s, e.batch))
        else:
            # mixed: the request decodes where it prefilled, so weigh both on the same worker
            d_ests = [estimate_decode(pred, request, e.instance, e.ttft_s if predicted else 0.0, None) for e in ests]
            slo = request.slo.tbt_s
            pairs = list(zip(ests, d_ests, strict=True))
            fitting = [pair for pair in pairs if slo is None or pair[1].tbt_s <= slo] or pairs
            best, chosen_decode = min(fitting, key=lambda pair: pair[0].ttft_s)
        judged = chosen_decode
        if disaggregated and predicted and chosen_decode is not None:
            # prediction-based early rejection: the chosen instance as it will be on arrival
            joins = JoinForecast(pred, prefills, len(decodes)) if self.forecast_joins else None
            judged = estimate_decode(pred, request, chosen_decode.instance, best.ttft_s, joins)
        elif self.admission is AdmissionMode.EARLY and chosen_decode is not None:
            # plain early rejection judges the load now: the streams already decoding there
            judged = estimate_decode(pred, request, chosen_decode.instance, 0.0, None, include_pending=False)
        rejection = admit(pred, request, self.admission, best, judged)
        candidates = tuple(prefill_candidate(e) for e in ests) + tuple(
            decode_candidate(e, judged if e is chosen_decode else None) for e in d_ests
        )
        tbt: float | None = None
        if chosen_decode is not None:  # in predicted mode, the forecast for when it gets there
            tbt = judged.tbt_s if predicted and judged is not None else chosen_decode.tbt_s
        if rejection is not None:
            return Decision(
                request_id=request.request_id,
                policy=self.name,
                rejection=rejection,
                predicted_ttft_s=best.ttft_s,
                predicted_tbt_s=tbt,
                candidates=candidates,
            )
        decode_id = chosen_decode.instance.id if disaggregated and chosen_decode is not None else None
        self._remember(request.request_id, best, decode_id, tbt)
        return Decision(
            request_id=request.request_id,
            policy=self.name,
            prefill=best.instance.id,
            decode=decode_id,
            predicted_ttft_s=best.ttft_s,
            predicted_tbt_s=tbt,
            pull_from=best.pull_from,
            pull_tokens=best.pulled_tokens,
            candidates=candidates,
        )

    def _remember(self, request_id: str, best: PrefillEstimate, decode: str | None, tbt: float | None) -> None:
        self._pending[request_id] = _Pending(
            prefill=best.instance.id,
            decode=decode,
            cached_tokens=best.cached_tokens,
            queue_s=best.queue_s,
            transfer_s=best.transfer_s,
            prefill_s=best.prefill_s,
            ttft_s=best.ttft_s,
            tbt_s=tbt,
        )
        while len(self._pending) > self._max_pending:  # observations that never came: forget them
            self._pending.popitem(last=False)

    # ---- learning -------------------------------------------------------------------------

    def observe(self, observation: Observation) -> None:
        obs = observation
        p = self._pending.pop(obs.request_id, None)
        if p is None or not obs.ok:
            return
        pred = self.predictors
        ratio = pred.params.prefill.p90_ratio
        leg = obs.queue_and_prefill_s
        if leg is not None and leg > 0 and obs.prefill == p.prefill:
            predicted_leg = p.queue_s + p.transfer_s + p.prefill_s
            pred.record_error("queue_and_prefill", p.prefill, predicted_leg, predicted_leg * ratio, leg)
            if p.queue_s <= self.refit_queue_fraction * leg:
                cached = p.cached_tokens if obs.cached_tokens is None else obs.cached_tokens
                cached = max(0, min(cached, obs.prompt_tokens - 1))
                compute = leg - p.queue_s - p.transfer_s
                if compute > 0:
                    pred.observe_prefill(obs.prompt_tokens - cached, cached, compute, p.prefill)
        if obs.ttft_s is not None and obs.ttft_s > 0:
            pred.record_error("ttft", p.prefill, p.ttft_s, p.ttft_s * ratio, obs.ttft_s)
        decoder = obs.decode or (obs.prefill if p.decode is None else None)  # mixed: same worker
        if obs.token_intervals_s and decoder is not None:
            mean = sum(obs.token_intervals_s) / len(obs.token_intervals_s)
            if p.tbt_s is not None:
                hi = p.tbt_s * pred.params.tbt.p90_ratio
                pred.record_error("tbt_at_decision", decoder, p.tbt_s, hi, mean)
            kv = obs.decode_resident_kv_tokens + obs.prompt_tokens + obs.output_tokens // 2
            pred.observe_tbt(obs.decode_batch + 1, kv, mean, decoder)

    def error_stats(self) -> tuple[ErrorStats, ...]:
        """Plain ErrorStats records for the gateway's Prometheus export."""
        return self.predictors.error_stats()
