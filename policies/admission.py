"""SLO admission: reject before anything is forwarded when the predictions say the SLO is lost.

Three modes, so the simulator can reproduce the arXiv report's Table 3 comparison:

* `none`: admit everything (the baselines' default).
* `early` (arXiv 7.2, "Early Rejection"): judge the decode instance by its load *now*, with this
  request added: the streams decoding there (`ActiveDecode.decoding`), not those routed there and
  still in prefill. Because a request reaches decode only after its TTFT, this reacts late: decode
  looks idle while the prefills that will fill it run, and full while streams about to finish are
  counted, so prefill and decode load oscillate in anti-phase (arXiv 7.3, Fig. 9).
* `predicted` (arXiv 7.4, "Early Rejection Based on Prediction"): judge the decode instance as it
  will be when this request reaches it, at now + predicted TTFT: decodes whose remaining tokens
  will be done by then (remaining_tokens * predicted TBT) have left, and prefills that will have
  finished by then have joined, each counted with the chance that it has not already finished
  again by then (policies.estimate.decode_state). Joining needs care not to count twice: Conductor's gateway and its
  simulator list a request under its decode instance from the moment it is dispatched (an
  ActiveDecode with all its tokens remaining), so queued prefills are already in the decode view,
  on the very instance they will join. Only for views that do not do this, `forecast_joins=True`
  adds the prefills queued cluster-wide that finish by then, spread uniformly over the decode pool
  (the report's system-level prediction).

Both SLOs are judged on calibrated upper bounds when the policy gives them (`ttft_bound_s`,
`tbt_bound_s`: quantiles of observed / predicted, predictors.quantile), else on the point
predictions. TTFT is checked the same way in both non-`none` modes: the best instance's predicted TTFT against
`request.slo.ttft_s`. Retry-After is an estimate of when the request would fit: for TTFT, when the
queue ahead of it will have drained by the excess; for TBT, when enough decodes will have finished.
"""

from __future__ import annotations

from dataclasses import replace
from enum import StrEnum

from conductor.core.types import ClusterSnapshot, Decision, InstanceView, Rejection, RequestView, Role, Slo
from policies.estimate import (
    DecodeEstimate,
    JoinForecast,
    PrefillEstimate,
    drain_time_s,
    estimate_decode,
    estimate_prefill,
    prefill_pool,
)
from predictors.online import Predictors

TTFT_SLO = "ttft_slo"
TBT_SLO = "tbt_slo"
# held requests decided again per stream that ends, the longest waiting first (the gateway's
# conductor/routing/waiting_room.py and the simulator's traces/sim/hold.py): a stream's end frees
# room for about one prefill, and deciding every held request at each end would cost up to
# hold.max_held decisions per end for one admission
WAKE_PER_END = 4
MIN_RETRY_S = 1.0  # Retry-After is whole seconds; sooner than this is noise
MAX_RETRY_S = 60.0  # beyond this the estimate means "much later", not a time


class AdmissionMode(StrEnum):
    NONE = "none"
    EARLY = "early"
    PREDICTED = "predicted"


def parse_mode(value: str | AdmissionMode) -> AdmissionMode:
    try:
        return AdmissionMode(value)
    except ValueError:
        known = ", ".join(m.value for m in AdmissionMode)
        raise ValueError(f"admission must be one of {known}, not {value!r}") from None


def _retry(seconds: float) -> float:
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))


def check_ttft(
    request: RequestView, best: PrefillEstimate, ttft_s: float | None = None, bound_s: float | None = None
) -> Rejection | None:
    """`ttft_s`: the point prediction (default: the prefill estimate's); `bound_s`: the figure
    compared with the SLO, an upper quantile of it (default: the point prediction itself)."""
    slo = request.slo.ttft_s
    point = best.ttft_s if ttft_s is None else ttft_s
    judged = point if bound_s is None else bound_s
    if slo is None or judged <= slo:
        return None
    excess = judged - slo
    retryable = True
    if best.queue_s >= excess:
        # the queue ahead is what breaks the SLO: once it has drained by the excess, it fits
        retry, why = excess, f"queue of {best.queue_s:.3f}s on {best.instance.id}"
    else:
        # even an idle instance would be too slow: sending it again cannot help (x-should-retry: false)
        retry, why, retryable = best.queue_s, "the prompt's own prefill", False
    return Rejection(
        reason=TTFT_SLO,
        message=(
            f"predicted TTFT {point:.3f}s (upper bound {judged:.3f}s) exceeds the TTFT SLO {slo:.3f}s by "
            f"{excess:.3f}s (best instance {best.instance.id}; dominated by {why})"
        ),
        predicted_s=point,
        slo_s=slo,
        retry_after_s=_retry(retry),
        retryable=retryable,
    )


def check_tbt(pred: Predictors, request: RequestView, decode: DecodeEstimate, bound_s: float | None = None) -> Rejection | None:
    """`bound_s`: the figure compared with the SLO, an upper quantile of `decode.tbt_s` (default: itself)."""
    slo = request.slo.tbt_s
    judged = decode.tbt_s if bound_s is None else bound_s
    if slo is None or judged <= slo:
        return None
    drain = drain_time_s(pred, request, decode.instance, slo)
    when = "now" if decode.at_s <= 0 else f"in {decode.at_s:.3f}s when this request reaches decode"
    return Rejection(
        reason=TBT_SLO,
        message=(
            f"predicted TBT {decode.tbt_s * 1e3:.2f}ms (upper bound {judged * 1e3:.2f}ms) on {decode.instance.id} "
            f"({when}, {decode.batch:.1f} streams) exceeds the TBT SLO {slo * 1e3:.2f}ms by "
            f"{(judged - slo) * 1e3:.2f}ms"
        ),
        predicted_s=decode.tbt_s,
        slo_s=slo,
        retry_after_s=_retry(drain if drain is not None else MAX_RETRY_S),
        retryable=drain is not None,  # None: it alone, on an idle instance, misses the SLO
    )


def stall_rejection(request: RequestView, worker: InstanceView, stall_s: float, tbt_s: float) -> Rejection:
    """A mixed worker's streams cannot absorb this request's prefill (policies.estimate.stall_fits):
    `stall_s` its predicted compute there, `tbt_s` the TBT it was judged to decode at."""
    slo = request.slo.tbt_s
    assert slo is not None
    return Rejection(
        reason=TBT_SLO,
        message=(
            f"its prefill on {worker.id} ({stall_s * 1e3:.1f}ms predicted) would pause more than a tenth of the "
            f"{len(worker.decodes)} streams decoding there past the TBT SLO {slo * 1e3:.2f}ms (no worker that "
            f"fits the request could absorb it)"
        ),
        predicted_s=tbt_s,
        slo_s=slo,
        retry_after_s=_retry(stall_s),
    )


def admit(
    pred: Predictors,
    request: RequestView,
    mode: AdmissionMode,
    prefill: PrefillEstimate,
    decode: DecodeEstimate | None,
    *,
    ttft_s: float | None = None,
    ttft_bound_s: float | None = None,
    tbt_bound_s: float | None = None,
) -> Rejection | None:
    """The first SLO the request is predicted to miss, or None to admit it. TTFT is judged by
    `ttft_bound_s` when given (an upper quantile of the prediction `ttft_s`), TBT by `tbt_bound_s`
    when given (an upper quantile of the judged decode estimate), else by the point predictions."""
    if mode is AdmissionMode.NONE:
        return None
    rejection = check_ttft(request, prefill, ttft_s, ttft_bound_s)
    if rejection is None and decode is not None:
        rejection = check_tbt(pred, request, decode, tbt_bound_s)
    return rejection


class BaselineAdmission:
    """Optional SLO admission for the baseline policies (off by default, as in the peers).

    The baseline picks its instances by its own rule; this only predicts TTFT on the chosen prefill
    instance (recomputing whatever it lacks: the peers do not pull prefixes) and TBT on the chosen
    decode instance, and rejects the same way the KVCache-aware policy does.
    """

    def __init__(self, mode: str = "none", predictor_params: str | None = None, forecast_joins: bool = False) -> None:
        self.mode = parse_mode(mode)
        self.forecast_joins = forecast_joins
        self._pred: Predictors | None = None
        if self.mode is not AdmissionMode.NONE:
            self._pred = Predictors.from_file(predictor_params) if predictor_params else Predictors.from_bundled_profile()

    def check(self, request: RequestView, cluster: ClusterSnapshot, prefill: str, decode: str | None) -> Rejection | None:
        pred = self._pred
        if pred is None:
            return None
        prefills, disaggregated = prefill_pool(cluster)
        by_id = {i.id: i for i in cluster.instances}
        p_est = estimate_prefill(pred, request, by_id[prefill], [], allow_pull=False, disaggregated=disaggregated)
        d_inst = by_id[decode] if decode is not None else by_id[prefill]
        at, joins = 0.0, None
        if self.mode is AdmissionMode.PREDICTED:
            at = p_est.ttft_s
            if disaggregated and self.forecast_joins:
                joins = JoinForecast(pred, prefills, len(cluster.by_role(Role.DECODE)))
        pending = self.mode is AdmissionMode.PREDICTED  # early: the load now, decoding streams only
        d_est = estimate_decode(pred, request, d_inst, at, joins, include_pending=pending)
        return admit(pred, request, self.mode, p_est, d_est)


def holdable(decision: Decision) -> bool:
    """A refusal for the request's TBT alone, which streams ending may cure: the gateway holds such a
    request instead of refusing it (conductor/routing/waiting_room.py), and so does the simulator
    (traces/sim/hold.py); not one it would get on an idle instance too (not `retryable`)."""
    rejection = decision.rejection
    return rejection is not None and rejection.reason == TBT_SLO and rejection.retryable


def slo_after_wait(slo: Slo, waited_s: float) -> Slo:
    """A held request's SLO when it is decided again: its TTFT SLO less the time it has waited (at
    least 0), as the gateway's waiting room and the simulator's judge it."""
    assert slo.ttft_s is not None  # only a request with a TTFT SLO is held
    return replace(slo, ttft_s=max(0.0, slo.ttft_s - waited_s))
