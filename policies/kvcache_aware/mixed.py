"""Stage 3, placement, on mixed workers (prefill and decode on one engine): the request decodes
where it prefills, so each worker is weighed as both.

Its prefill pauses every stream decoding on that worker for as long as it computes, which no TBT
prediction of the worker sees. So among the workers whose TTFT fits in `mixed_ttft_slack` of the
SLO (under the calibrated bound) and whose TBT bound meets the TBT SLO, the one where it stalls the
fewest stream-seconds wins (`mixed_least_stall`); without a TTFT SLO, or where no worker fits, the
lowest TTFT among the workers whose TBT bound meets the SLO (`mixed_choice`; the first when none
does). With admission on and `mixed_protect_streams`, a worker qualifies only if the streams there
absorb the prefill and keep their TBT SLO (policies.estimate.stall_fits); where the chosen one's
cannot, admission rejects the request. Why each rule: docs/kvcache_aware.md, "Mixed workers".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from conductor.core.types import InstanceView, RequestView
from policies.admission import AdmissionMode
from policies.base import listed_indices
from policies.estimate import DecodeEstimate, estimate_decode, stall_fits
from policies.kvcache_aware.options import KvCacheAwareOptions
from policies.kvcache_aware.placement import Placement, TbtBound
from policies.kvcache_aware.pool_estimates import PoolPrefillEstimates
from predictors.online import Predictors

Stretch = Callable[[str, float], float]  # (worker id, its prefill seconds) -> the factor its TBT is stretched by


def idle(worker: InstanceView) -> bool:
    """A mixed worker where nothing decodes and no prefill waits. Its TBT is not judged: a stream
    there sees the step of a batch of one plus the pauses of the prefills sent after it, which no
    prediction knows, and a model fitted while every worker had a backlog predicts even an idle
    one to miss; since only admitted requests teach the model, rejecting there would never end
    (docs/kvcache_aware.md, "Mixed workers")."""
    return not worker.decodes and not worker.prefill_queue


def stalled_stream_s(prefill_s: float, streams: int) -> float:
    """The stream-seconds a prefill of `prefill_s` pauses on a mixed worker with `streams` decoding:
    each of them waits for it, and one more for the capacity it takes (what mixed placement ranks by)."""
    return prefill_s * (streams + 1)


def observed_pace_s(worker: InstanceView, now: float, min_intervals: int = 4) -> float | None:
    """The seconds per token the streams the gateway watches on `worker` have taken so far, pooled
    (their time since the first token over their intervals), or None below `min_intervals`
    intervals in all. `now` falls somewhere in each stream's next interval, so each counts half
    an interval more than it has completed. What the engine delivers, whatever the TBT model says:
    a model started from another GPU's profile can be several times too fast until its first refit
    (docs/kvcache_aware.md, "Mixed workers")."""
    elapsed = 0.0
    intervals = 0.0
    for a in worker.decodes:
        first = a.first_token_at
        if first is None or a.generated < 2 or now <= first:
            continue
        elapsed += now - first
        intervals += a.generated - 0.5
    if intervals < min_intervals:
        return None
    return elapsed / intervals


def mixed_choice(ttfts: Sequence[float], tbt_bound: Callable[[int], float], slo_s: float | None) -> int:
    """The mixed worker a request goes to: the lowest predicted TTFT among the workers whose TBT
    bound meets the TBT SLO (`tbt_bound(i)`: the figure admission compares with it), the lowest
    TTFT when none does or there is no SLO; among workers of the same TTFT (an idle pool: every
    one equal), the lowest TBT bound, the first of equals. Bounds are asked for lazily, in TTFT order."""
    order = sorted(range(len(ttfts)), key=ttfts.__getitem__)  # stable: equals in pool order
    pick = order[0] if slo_s is None else next((i for i in order if tbt_bound(i) <= slo_s), order[0])
    ttft, bound = ttfts[pick], tbt_bound(pick)
    for i in order[order.index(pick) + 1 :]:
        if ttfts[i] != ttft:
            break
        other = tbt_bound(i)
        if other < bound:
            pick, bound = i, other
    return pick


def mixed_least_stall(
    ttfts: Sequence[float],
    stalled_s: Sequence[float],
    ttft_limit_s: float,
    tbt_bound: Callable[[int], float],
    slo_s: float | None,
    fits: Callable[[int], bool] | None = None,
) -> int | None:
    """The mixed worker where the request's prefill stalls the fewest stream-seconds, among those
    whose predicted TTFT is at most `ttft_limit_s` and whose TBT bound meets the SLO: the lowest
    `stalled_s[i]` (stalled_stream_s), the lowest TTFT among equals, the first in pool order among
    those; given `fits`, only workers where `fits(i)` holds. None when no worker fits (the caller
    falls back on mixed_choice). The candidates are tried best first, so the TBT bound and `fits`,
    which walk a worker's streams, are asked of as few workers as it takes."""
    order = sorted(
        (i for i in range(len(ttfts)) if ttfts[i] <= ttft_limit_s), key=lambda i: (stalled_s[i], ttfts[i])
    )  # stable: pool order among equals
    for i in order:
        if (slo_s is None or tbt_bound(i) <= slo_s) and (fits is None or fits(i)):
            return i
    return None


class MixedWorkers:
    """A mixed pool, each worker weighed as the request's decode too: lazily, and once each (its
    estimate walks the worker's streams, and the rules ask about as few workers as they can)."""

    __slots__ = (
        "_bounds",
        "_decodes",
        "_paces",
        "now",
        "pace_floor",
        "pred",
        "predicted",
        "request",
        "stalls",
        "stretch",
        "tbt_ratio",
        "tbt_slo",
        "ttfts",
        "workers",
        "works",
    )

    def __init__(
        self,
        pred: Predictors,
        request: RequestView,
        weighed: PoolPrefillEstimates,
        predicted: bool,
        tbt_ratio: float,
        backlog: bool = False,
        stretch: Stretch | None = None,
        now: float = 0.0,
        pace_floor: bool = False,
    ) -> None:
        self.pred = pred
        self.pace_floor = pace_floor  # the TBT bound no lower than the worker's streams' pace
        self.now = now  # the snapshot's clock: what the streams watched have saved (stall_fits)
        self.request = request
        self.workers = weighed.prefills
        self.ttfts = weighed.ttfts
        self.works = weighed.works()  # each worker's own prefill compute: what its streams would wait for
        # `backlog` (a less urgent class, policies/classes.py): its streams wait for the prefills queued
        # ahead of it too, all of it before its first token, which the TTFT bounds
        self.stalls = self.ttfts if backlog else self.works
        self.stretch = stretch  # (worker id, its prefill seconds) -> its TBT's stretch by prefill duty
        self.predicted = predicted  # judged at arrival (the TTFT from now), else by the load now
        self.tbt_ratio = tbt_ratio
        self.tbt_slo = request.slo.tbt_s
        self._decodes: dict[int, DecodeEstimate] = {}
        self._paces: dict[int, float] = {}
        self._bounds: dict[int, float] = {}

    def decode(self, i: int) -> DecodeEstimate:
        """The request's TBT on worker `i` (the same object each time: the decision log marks the
        chosen one by identity)."""
        est = self._decodes.get(i)
        if est is None:
            at = self.ttfts[i] if self.predicted else 0.0
            est = self._decodes[i] = estimate_decode(self.pred, self.request, self.workers[i], at, None)
        return est

    def tbt_bound(self, i: int) -> float:
        """Worker `i`'s TBT as admission will judge it, under the same calibrated bound (placing by
        the point prediction chose workers whose bound admission then rejected, beside one that
        fit); 0 on an idle worker, whose TBT is not judged (`idle`). Once per worker: the rules
        ask it up to four times (least stall, choice, absorbs, absorbed bound)."""
        bound = self._bounds.get(i)
        if bound is None:
            worker = self.workers[i]
            if idle(worker):
                bound = 0.0
            else:
                bound = max(self.decode(i).tbt_s * self.tbt_ratio, self.pace(i))
                if self.stretch is not None:
                    bound *= self.stretch(worker.id, self.works[i])
            self._bounds[i] = bound
        return bound

    def pace(self, i: int) -> float:
        """With `pace_floor`, the pace the streams on worker `i` get (observed_pace_s): the TBT bound
        is never lower; else, or where too few intervals were seen, 0. Walked once per worker, as
        `decode`: the rules ask a worker's bound several times."""
        if not self.pace_floor:
            return 0.0
        pace = self._paces.get(i)
        if pace is None:
            pace = self._paces[i] = observed_pace_s(self.workers[i], self.now) or 0.0
        return pace

    def absorbs(self, i: int) -> bool:
        """The streams on worker `i` absorb the request's prefill and keep their TBT SLO."""
        slo = self.tbt_slo
        assert slo is not None  # asked only of requests with a TBT SLO
        return stall_fits(self.workers[i], self.stalls[i], slo - self.tbt_bound(i), slo, self.now)

    def absorbed_bound(self, i: int) -> float:
        """`tbt_bound` where the streams absorb the prefill, else inf: such a worker fits no SLO."""
        return self.tbt_bound(i) if self.absorbs(i) else math.inf


def place_mixed(
    pred: Predictors,
    request: RequestView,
    weighed: PoolPrefillEstimates,
    options: KvCacheAwareOptions,
    tbt: TbtBound,
    backlog: bool = False,
    stretch: Stretch | None = None,
    now: float = 0.0,
) -> Placement:
    """The worker by the rules above; the workers listed are the same as prefill and as decode.
    `backlog`: the streams must absorb the prefills queued ahead of this one too (a less urgent
    class: it may not take the urgent streams' spare time, only what is left of it); `stretch`, its
    TBT bound stretched by each worker's prefill duty (prefill_duty.py; the same class); `now`, the
    snapshot's clock."""
    mode = options.admission.mode
    predicted = mode is AdmissionMode.PREDICTED
    workers = MixedWorkers(pred, request, weighed, predicted, tbt.ratio, backlog, stretch, now, options.mixed.pace_floor)
    stalled = [stalled_stream_s(w, len(p.decodes)) for w, p in zip(workers.works, weighed.prefills, strict=True)]
    protect = options.mixed.protect_streams and request.slo.tbt_s is not None and mode is not AdmissionMode.NONE
    best, calm = _choose(workers, options, stalled, protect)
    unabsorbed = workers.stalls[best] if protect and not calm and not workers.absorbs(best) else None
    listed = listed_indices(workers.ttfts, options.placement.listed_candidates, best)
    return Placement(
        best=best,
        listed=listed,
        decode=workers.decode(best),
        decodes_listed=[workers.decode(i) for i in listed],
        stalled=stalled,
        unabsorbed_s=unabsorbed,
        tbt_stretch=1.0 if stretch is None else stretch(weighed.prefills[best].id, workers.works[best]),
        tbt_floor_s=workers.pace(best),
    )


def _choose(workers: MixedWorkers, options: KvCacheAwareOptions, stalled: list[float], protect: bool) -> tuple[int, bool]:
    """(the chosen worker, whether the least-stall rule chose it: then its streams absorb it)."""
    slo = workers.request.slo
    slack = options.mixed.ttft_slack
    if slack is not None and slo.ttft_s is not None:
        limit = slack * slo.ttft_s
        quantile = options.admission.ttft_quantile
        if quantile is not None:
            limit = workers.pred.largest_within("ttft", limit, quantile)
        fits = workers.absorbs if protect else None
        calm = mixed_least_stall(workers.ttfts, stalled, limit, workers.tbt_bound, slo.tbt_s, fits)
        if calm is not None:
            return calm, True
    # the lowest TTFT among the workers that meet the TBT SLO (and, protecting, whose streams absorb it)
    return mixed_choice(workers.ttfts, workers.absorbed_bound if protect else workers.tbt_bound, slo.tbt_s), False
