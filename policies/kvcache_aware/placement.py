"""Stage 3, placement, on a disaggregated cluster: the decode instance, then the prefill instance.

The decode instance is the one with the lowest predicted TBT once the request joins, by its load
now (streams dispatched and still prefilling included): choosing by the forecast instead herds
requests onto instances whose streams are about to finish, and their freed capacity is soon taken
anyway. It does not depend on the prefill chosen, so it comes first: the prefill's slack needs its
TBT. The prefill instance is, with `ttft_slack`, the one that computes least among those whose TTFT
at the client fits in the slack (`placement_rank`), else the lowest TTFT (FAST'25 Algorithm 1).
Mixed workers are placed by policies/kvcache_aware/mixed.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conductor.core.types import InstanceView, RequestView
from policies.base import listed_indices
from policies.estimate import DecodeEstimate, decode_loads_now
from policies.kvcache_aware.options import PlacementOptions
from policies.kvcache_aware.pool_estimates import PoolPrefillEstimates
from predictors.online import Predictors


@dataclass(slots=True)
class Placement:
    """Where the request goes, and what the decision lists of what was weighed."""

    best: int  # index of the chosen prefill-capable instance in its pool
    listed: list[int]  # the prefill candidates a decision lists, in pool order (listed_indices)
    decode: DecodeEstimate  # the chosen decode instance (mixed: the chosen worker) by its load now
    decodes_listed: list[DecodeEstimate]  # the decode candidates listed, `decode` among them
    decode_tbts: list[float] | None = None  # P/D: every decode's TBT now (local prefills weigh them)
    stalled: list[float] | None = None  # mixed: stream-seconds each worker's streams would stall
    unabsorbed_s: float | None = None  # mixed: the prefill the chosen worker's streams cannot absorb
    tbt_stretch: float = 1.0  # mixed, a less urgent class: the chosen worker's TBT stretch by prefill duty
    tbt_floor_s: float = 0.0  # mixed, `mixed_pace_floor`: the chosen worker's streams' pace (observed_pace_s)


@dataclass(frozen=True, slots=True)
class TbtBound:
    """The TBT bound admission judges: the prediction times `ratio`, the calibrated `quantile` of
    observed / judged TBT (None: the point prediction, ratio 1)."""

    quantile: float | None
    ratio: float

    @classmethod
    def of(cls, pred: Predictors, quantile: float | None) -> TbtBound:
        return cls(quantile, 1.0 if quantile is None else tbt_ratio(pred, quantile))


def tbt_ratio(pred: Predictors, q: float) -> float:
    """The q-quantile of observed / judged TBT. While too few are held (the window is emptied by
    every refit that moves the model: on mixed workers, often), the fit's own: its in-sample 0.9
    ratio for an upper tail, its median for q <= 0.5, which a least-squares fit puts at about 1
    (the point prediction); the 0.9 ratio there rejected requests at several times the point
    prediction (docs/kvcache_aware.md, "Mixed workers")."""
    return pred.ratios.quantile("tbt_judged", q, pred.params.tbt.p90_ratio if q > 0.5 else 1.0)


def lowest_load(tbts: list[float], batches: list[float]) -> int:
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


def slack_limit(
    pred: Predictors, request: RequestView, handoff_s: float, first_tbt_s: float, slack: float | None, ttft_quantile: float | None
) -> float | None:
    """The longest predicted prefill leg `ttft_slack` allows this request, or None (no slack, no
    TTFT SLO). Judged on the TTFT at the client as admission judges it: the leg, then the decode
    leg with the chosen decode's TBT now (`first_tbt_s`), under the calibrated `ttft_quantile`
    bound, which must be at most slack x the SLO; a limit on the point prediction let the leg use
    the whole SLO and admission then turned the request away (docs/kvcache_aware.md, "Placement")."""
    slo = request.slo.ttft_s
    if slack is None or slo is None:
        return None
    target = slack * slo
    if ttft_quantile is not None:
        target = pred.largest_within("ttft", target, ttft_quantile)
    return target - pred.first_token_s(handoff_s, first_tbt_s)


def placement_rank(limit_s: float | None, weighed: PoolPrefillEstimates) -> Callable[[int], Any]:
    """The sort key of prefill candidates, best lowest: the predicted TTFT or, given `limit_s`,
    those whose predicted prefill leg (pull, queue, prefill) is at most `limit_s` first, by least
    compute among them (a prefix in flight, which cannot be pulled yet, is what makes instances
    differ there), the lowest TTFT among equals; the rest after them by TTFT. The caller derives
    the limit from the request's TTFT SLO (`slack_limit`)."""
    ttfts = weighed.ttfts
    if limit_s is None:
        return ttfts.__getitem__
    legs = [t - weighed.handoff_s for t in ttfts]
    works = weighed.works()

    def rank(i: int) -> tuple[int, float, float]:
        return (0, works[i], ttfts[i]) if legs[i] <= limit_s else (1, 0.0, ttfts[i])

    return rank


def placement_best(limit_s: float | None, weighed: PoolPrefillEstimates) -> int:
    """min(range(len(weighed.ttfts)), key=placement_rank(limit_s, weighed)): the first of the
    best, found without a key tuple and a call per instance. Each comparison is the one the
    rank tuples' would make (a tuple compares its items for equality first, by identity too)."""
    ttfts = weighed.ttfts
    best, best_t = 0, ttfts[0]
    if limit_s is None:
        for i in range(1, len(ttfts)):
            t = ttfts[i]
            if t < best_t:
                best, best_t = i, t
        return best
    handoff = weighed.handoff_s
    works = weighed.works()
    best_fits, best_w = ttfts[0] - handoff <= limit_s, works[0]
    for i in range(1, len(ttfts)):
        t = ttfts[i]
        fits = t - handoff <= limit_s
        if fits != best_fits:
            if fits:  # (0, ...) < (1, ...)
                best, best_t, best_fits, best_w = i, t, fits, works[i]
            continue
        if fits:
            w = works[i]
            if not (w is best_w or w == best_w):
                if w < best_w:
                    best, best_t, best_w = i, t, w
                continue
        if not (t is best_t or t == best_t) and t < best_t:
            best, best_t, best_w = i, t, works[i]
    return best


def place_disaggregated(
    pred: Predictors,
    request: RequestView,
    decodes: tuple[InstanceView, ...],
    weighed: PoolPrefillEstimates,
    options: PlacementOptions,
    ttft_quantile: float | None,
) -> Placement:
    """The decode instance by its load now, then the prefill instance by `placement_rank`; only the
    best `listed_candidates` of each pool (and the chosen ones) are built into estimates."""
    keep = options.listed_candidates
    tbts, batches, kvs = decode_loads_now(pred, request, decodes)
    chosen = lowest_load(tbts, batches)
    listed_decodes = {i: DecodeEstimate(decodes[i], tbts[i], batches[i], kvs[i], 0.0) for i in listed_indices(tbts, keep, chosen)}
    # the slack compares predicted seconds with the SLO: a model not yet fitted to this fleet (the
    # bundled profile of a faster GPU) fits every leg in it and piles work on a prefix's holder;
    # the lowest TTFT needs only the instances' order, which a wrong scale keeps
    slack = options.ttft_slack if pred.prefill_fitted else None
    limit = slack_limit(pred, request, weighed.handoff_s, tbts[chosen], slack, ttft_quantile)
    best = placement_best(limit, weighed)
    return Placement(
        best=best,
        listed=listed_indices(weighed.ttfts, keep, best),
        decode=listed_decodes[chosen],
        decodes_listed=list(listed_decodes.values()),
        decode_tbts=tbts,
    )
