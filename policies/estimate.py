"""Per-instance TTFT and TBT estimates from the fitted predictors (FAST'25 Algorithm 1, lines 4-17).

For a prefill (or mixed) instance p and a request of n prompt tokens:

    TTFT(p) = T_transfer(prefix pulled from elsewhere) + T_queue(p) + T_prefill(n - prefix, prefix)
              (+ T_transfer(P -> D handoff of the whole prompt's KV) when disaggregated)

The paper pulls the best remote prefix when `best_len - prefix_len > kvcache_balancing_threshold`,
a hand-set constant. Here the choice is made per instance from the predictors: with local prefix l
and a remote prefix L > l reachable over link k, pull iff

    T_transfer_k(L - l) + T_prefill(n - L, L)  <  T_prefill(n - l, l).

With T_prefill = c0 + c1*new + c2*new*(new + 2*cached), since new*(new + 2*cached) = n^2 - cached^2,
the saving of pulling d = L - l tokens is exactly c1*d + c2*d*(d + 2l): the MLP of those d tokens
and their attention over the context before them. The cost is a_k + b_k*B*d (link latency, B bytes
a token over the link's bandwidth). So pulling wins iff

    c2*d^2 + (c1 + 2*c2*l - b_k*B)*d - a_k > 0,   i.e.  d > d* = (-beta + sqrt(beta^2 + 4*c2*a_k)) / (2*c2)

with beta = c1 + 2*c2*l - b_k*B: the paper's `kvcache_balancing_threshold`, derived from the fitted
coefficients (it shrinks as the local prefix grows, since attention over a longer context makes
each recomputed token dearer) and moving whenever a refit moves them. `pull_threshold` computes d*
for logs and docs; decisions compare the two predicted times directly, which is the same test.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from types import MappingProxyType

from conductor.core.fast_init import fast_init
from conductor.core.types import ActiveDecode, CandidateScore, ClusterSnapshot, InstanceView, RequestView, Role, Tier
from predictors.online import Predictors
from predictors.params import INSTANCE_LINK, NO_STRETCH, STORE_LINK

STORE_SOURCE = "store"  # Decision.pull_from value for the pooled store
_CONTEXT = attrgetter("context_tokens")
_DECODING = attrgetter("decoding")
_TOKENS = itemgetter(0)


@fast_init
@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """Predicted TTFT of one request on one prefill-capable instance, by component."""

    instance: InstanceView
    ttft_s: float
    transfer_s: float  # pulling the prefix it lacks (0 when it recomputes)
    queue_s: float  # prefill work ahead of it
    prefill_s: float  # its own prefill compute
    handoff_s: float  # P -> D transfer of the whole prompt's KV (0 for mixed instances)
    cached_tokens: int  # prefix it will reuse (its own plus any pulled)
    pulled_tokens: int  # of which pulled from elsewhere
    pull_from: str | None  # instance id or STORE_SOURCE


@fast_init
@dataclass(frozen=True, slots=True)
class DecodeEstimate:
    """Predicted TBT on one decode-capable instance once the request has joined."""

    instance: InstanceView
    tbt_s: float
    batch: float  # streams, the request included (fractional with uniformly spread joins)
    resident_kv_tokens: float
    at_s: float  # how far in the future the state is predicted (0: now)


def prefill_candidate(est: PrefillEstimate, stalled_stream_s: float | None = None) -> CandidateScore:
    """A prefill-capable instance as weighed; on a mixed worker `stalled_stream_s`, the
    stream-seconds its prefill there would pause (what the mixed placement ranks by)."""
    detail = {
        "transfer_s": est.transfer_s,
        "queue_s": est.queue_s,
        "prefill_s": est.prefill_s,
        "handoff_s": est.handoff_s,
        "cached_tokens": float(est.cached_tokens),
        "pulled_tokens": float(est.pulled_tokens),
    }
    if stalled_stream_s is not None:
        detail["stalled_stream_s"] = stalled_stream_s
    return CandidateScore(
        instance_id=est.instance.id,
        role=est.instance.role,
        score=est.ttft_s,
        predicted_ttft_s=est.ttft_s,
        detail=MappingProxyType(detail),
    )


def decode_candidate(est: DecodeEstimate, judged: DecodeEstimate | None = None, pace_s: float = 0.0) -> CandidateScore:
    """A decode instance as weighed for the choice; the chosen one also says how admission saw it,
    and (`pace_s`, mixed_pace_floor) the pace of the streams there its TBT bound was kept above."""
    detail = {"batch": est.batch, "resident_kv_tokens": est.resident_kv_tokens, "at_s": est.at_s}
    if judged is not None and judged is not est:
        detail.update(admission_tbt_s=judged.tbt_s, admission_batch=judged.batch, admission_at_s=judged.at_s)
    if pace_s > 0.0:
        detail["streams_pace_s"] = pace_s
    return CandidateScore(
        instance_id=est.instance.id,
        role=est.instance.role,
        score=est.tbt_s,
        predicted_tbt_s=est.tbt_s,
        detail=MappingProxyType(detail),
    )


def stall_fits(worker: InstanceView, stall_s: float, spare_s: float, slo_s: float | None = None, now: float = 0.0) -> bool:
    """Whether the streams decoding on `worker` can absorb a `stall_s` pause of their batch (a
    prefill computed there) and keep their mean TBT within the SLO: `spare_s` (SLO - the predicted
    TBT) per token over each one's remaining tokens plus, given the SLO `slo_s` and the snapshot's
    `now`, what a stream the gateway watched has saved so far (earned_slack_s). A stream not
    watched is taken to see the pause whole near its end. At most a tenth of them (rounded down)
    may not absorb it: on a worker with few streams, none."""
    allowed = len(worker.decodes) // 10
    for a in worker.decodes:  # stops at the first stream over the allowance
        if a.remaining_tokens <= 0 or stall_s <= spare_s * a.remaining_tokens:
            continue
        if slo_s is not None and stall_s <= spare_s * a.remaining_tokens + max(0.0, earned_slack_s(a, slo_s, now)):
            continue
        allowed -= 1
        if allowed < 0:
            return False
    return True


def earned_slack_s(stream: ActiveDecode, slo_s: float, now: float) -> float:
    """What a stream has saved of its mean-TBT budget so far: the SLO times the intervals it has
    generated, less the time they took (the gateway's measure, on the snapshot's clock); negative
    when it runs behind, 0 when it was not watched. A mixed worker's stream on a fast engine saves
    most of its budget early, and a prefill's pause spends it (docs/kvcache_aware.md, "Mixed workers")."""
    first = stream.first_token_at
    if first is None or stream.generated < 2:
        return 0.0
    return slo_s * (stream.generated - 1) - (now - first)


def pull_threshold(pred: Predictors, local: int, link: str = INSTANCE_LINK) -> float:
    """Smallest prefix gain d* (tokens) beyond which pulling beats recomputing; inf if never."""
    _, c1, c2 = pred.params.prefill.coef
    a, b = pred.params.transfer_model(link).coef
    beta = c1 + 2 * c2 * local - b * pred.kv_bytes_per_token
    if c2 <= 0:
        return a / beta if beta > 0 else float("inf")
    return (-beta + math.sqrt(beta * beta + 4 * c2 * a)) / (2 * c2)


def remote_sources(request: RequestView) -> list[tuple[int, str, str]]:
    """(tokens, source, link) of every place a prefix could be pulled from, longest first.

    Instances are sources only where the request says a pull from them can be carried out
    (`pull_sources`; every cached instance when it is None, the simulator's peer-pull cluster);
    the store is one wherever it holds the prefix (the worker loads from it by itself)."""
    # a store-tier entry is reachable from every instance through the store, whoever it is filed under
    if request.pull_sources is None:
        out = [
            (p.tokens, STORE_SOURCE, STORE_LINK) if p.tier is Tier.STORE else (p.tokens, iid, INSTANCE_LINK)
            for iid, p in request.cached.items()
        ]
    else:
        out = [(p.tokens, STORE_SOURCE, STORE_LINK) for p in request.cached.values() if p.tier is Tier.STORE]
        out += [(tokens, iid, INSTANCE_LINK) for iid, tokens in request.pull_sources.items() if tokens > 0]
    if request.store_cached_tokens > 0:
        out.append((request.store_cached_tokens, STORE_SOURCE, STORE_LINK))
    out.sort(key=_TOKENS, reverse=True)  # stable in reverse too: equals keep their order, as by -tokens
    return out


def staging_waits(pred: Predictors, request: RequestView, prefills: Sequence[InstanceView]) -> dict[str, float]:
    """Per queued pull source (RequestView.queued_pull_sources): the predicted wait of its staging
    request, i.e. its prefill queue now (only the prefill running there when staging requests jump
    the queue) plus computing the one token the staging request adds."""
    queued, head = request.queued_pull_sources, request.staging_jumps_queue
    return {
        inst.id: pred.queue_s(inst.prefill_queue[:1] if head else inst.prefill_queue) + pred.prefill_s(1, request.prompt_tokens)
        for inst in prefills
        if inst.id in queued
    }


def prefix_plan(
    pred: Predictors,
    n: int,
    local: int,
    sources: Sequence[tuple[int, str, str]],
    own_id: str | None,
    waits: Mapping[str, float] | None = None,
) -> tuple[float, float, int, int, str | None]:
    """(transfer_s, prefill_s, prefix reused, tokens pulled, source) of the cheapest way to prefill
    an n-token prompt on an instance holding its first `local` tokens: recompute what it lacks, or
    pull the longest prefix a link offers (never from `own_id`, the instance itself) first.
    `waits`: seconds before a source's KV can be read at all (a staged peer pull's wait in the
    holder's queue), counted in the pull's transfer time."""
    best_prefill = pred.prefill_s(n - local, local)
    best_transfer, prefix, pulled, source = 0.0, local, 0, None
    seen_links: set[str] = set()
    for tokens, src, link in sources:  # longest first: the first per link is that link's best
        if src == own_id or link in seen_links:
            continue
        seen_links.add(link)
        cand = min(tokens, n - 1)
        if cand <= local:
            continue
        t_x = pred.transfer_s(cand - local, link)
        if waits:
            t_x += waits.get(src, 0.0)
        t_p = pred.prefill_s(n - cand, cand)
        if t_x + t_p < best_transfer + best_prefill:
            best_transfer, best_prefill, prefix, pulled, source = t_x, t_p, cand, cand - local, src
    return best_transfer, best_prefill, prefix, pulled, source


def _local_prefix(request: RequestView, inst: InstanceView, n: int) -> int:
    own = request.cached.get(inst.id)
    # a prefix in this instance's device or host memory is local; a "store" entry is not
    return min(own.tokens, n - 1) if own is not None and own.tier is not Tier.STORE else 0


def estimate_prefill(
    pred: Predictors,
    request: RequestView,
    inst: InstanceView,
    sources: list[tuple[int, str, str]],
    *,
    allow_pull: bool = True,
    disaggregated: bool = True,
    waits: Mapping[str, float] | None = None,
) -> PrefillEstimate:
    n = max(1, request.prompt_tokens)
    best_transfer, best_prefill, prefix, pulled, source = prefix_plan(
        pred, n, _local_prefix(request, inst, n), sources if allow_pull else (), inst.id, waits
    )
    stretch = NO_STRETCH if disaggregated else pred.mixed_stretch(inst)  # streams sharing a mixed engine
    queue = pred.queue_s(inst.prefill_queue, stretch)
    if stretch is not NO_STRETCH:
        best_prefill += stretch[0] + stretch[1] * (n - prefix)
    handoff = pred.transfer_s(n) if disaggregated else 0.0
    return PrefillEstimate(
        instance=inst,
        ttft_s=best_transfer + queue + best_prefill + handoff,
        transfer_s=best_transfer,
        queue_s=queue,
        prefill_s=best_prefill,
        handoff_s=handoff,
        cached_tokens=prefix,
        pulled_tokens=pulled,
        pull_from=source,
    )


def decode_loads_now(
    pred: Predictors, request: RequestView, decodes: tuple[InstanceView, ...]
) -> tuple[list[float], list[float], list[float]]:
    """(tbt_s, batch, resident_kv_tokens) of estimate_decode(pred, request, d, 0.0) for each of
    `decodes`, without an estimate object each. Now, with dispatched streams counted, decode_state
    is the number of streams and the sum of their contexts (ints, so the sum is exact in any order)
    whether they are decoding yet or not: no need to split them as the forecast does."""
    prompt = request.prompt_tokens
    d0, d1, d2 = pred.params.tbt.coef  # pred.tbt_s(batch, kv) inline: its operations, once per decode instance
    tbts, batches, kvs = [], [], []
    for d in decodes:
        streams = d.decodes
        batch = float(len(streams)) + 1
        kv = float(sum(map(_CONTEXT, streams))) + prompt
        tbts.append(d0 + d1 * batch + d2 * kv)
        batches.append(batch)
        kvs.append(kv)
    return tbts, batches, kvs


class JoinForecast:
    """When the prefills now queued cluster-wide will finish and move on to decode.

    Each prefill instance runs its queue FCFS; the finish time of its k-th entry is the remaining
    time of the head plus the predicted prefill time of entries 1..k. Finished prefills are spread
    uniformly over the decode instances (the arXiv report's system-level prediction, 7.4). Only for
    cluster views that do not already list dispatched requests under their decode instance
    (`forecast_joins=True`); Conductor's gateway and simulator do list them.
    """

    def __init__(self, pred: Predictors, prefills: tuple[InstanceView, ...], n_decode: int) -> None:
        events: list[tuple[float, int]] = []
        for inst in prefills:
            t = 0.0
            for i, q in enumerate(inst.prefill_queue):
                dt = pred.prefill_s(q.new_tokens, q.cached_tokens)
                t += max(0.0, dt - q.elapsed_s) if i == 0 else dt
                events.append((t, q.new_tokens + q.cached_tokens))
        events.sort()
        self._times = [t for t, _ in events]
        self._cum_tokens = [0]
        for _, tokens in events:
            self._cum_tokens.append(self._cum_tokens[-1] + tokens)
        self._share = 1.0 / max(1, n_decode)

    def joined_by(self, at_s: float) -> tuple[float, float]:
        """(streams, KV tokens) that join each decode instance by `at_s` from now."""
        k = bisect_right(self._times, at_s)
        return k * self._share, self._cum_tokens[k] * self._share


def decode_state(
    pred: Predictors, decodes: tuple[ActiveDecode, ...], at_s: float, include_pending: bool = True
) -> tuple[float, float]:
    """(streams, resident KV tokens) on a decode instance now (`at_s` <= 0) or `at_s` from now.

    Now: every listed stream, or only those already decoding (`include_pending=False`, the plain
    "load now" of early rejection). Later: decoding streams whose remaining tokens will be done by
    then have left, the others have grown by the steps taken; streams still in prefill or transfer
    (`decoding=False`) were dispatched before this request and reach decode first, at a time
    taken as uniform over [now, now + at_s]: each counts with the probability that it has not
    finished by then (see the comment in the body).
    """
    # map/attrgetter and comprehensions: this runs for every decode stream in the cluster on every
    # decision, and generator expressions cost about twice as much here
    pending: Sequence[ActiveDecode] = ()
    running: Sequence[ActiveDecode] = decodes
    if not all(map(_DECODING, decodes)):  # one pass splits them (both keep the listed order)
        running, pending = [], []
        for d in decodes:
            (running if d.decoding else pending).append(d)
    kv_running = sum(map(_CONTEXT, running))
    if at_s <= 0 or not running:
        if not include_pending:
            return float(len(running)), float(kv_running)
        return float(len(running) + len(pending)), float(kv_running + sum(map(_CONTEXT, pending)))
    step_s = pred.tbt_s(len(running), kv_running)
    steps = at_s / step_s
    staying = [d.context_tokens for d in running if d.remaining_tokens > steps]
    # A pending stream reaches decode some time u in [0, at_s] (it was dispatched earlier, often to
    # a shorter prefill queue) and by at_s has run (at_s - u) / step_s steps: with u uniform it is
    # still there with probability min(1, remaining * step_s / at_s). Counting every pending stream
    # as present overstates the load whenever the TTFT ahead is comparable to a stream's decode
    # time -- the case where judging "at arrival" matters at all (arXiv 7.3).
    horizon = at_s / step_s
    p_batch = p_kv = 0.0
    for d in pending:
        frac = min(1.0, d.remaining_tokens / horizon)
        p_batch += frac
        p_kv += frac * d.context_tokens
    return len(staying) + p_batch, sum(staying) + len(staying) * steps + p_kv


def estimate_decode(
    pred: Predictors,
    request: RequestView,
    inst: InstanceView,
    at_s: float,
    joins: JoinForecast | None = None,
    include_pending: bool = True,
) -> DecodeEstimate:
    """TBT on `inst` with this request joined, the state predicted `at_s` from now."""
    batch, kv = decode_state(pred, inst.decodes, at_s, include_pending)
    if joins is not None and at_s > 0:
        j_batch, j_kv = joins.joined_by(at_s)
        batch, kv = batch + j_batch, kv + j_kv
    batch, kv = batch + 1, kv + request.prompt_tokens
    return DecodeEstimate(inst, pred.tbt_s(batch, kv), batch, kv, at_s)


def drain_time_s(pred: Predictors, request: RequestView, inst: InstanceView, slo_s: float) -> float | None:
    """How long until enough decodes finish that this request would meet `slo_s`; None if never."""
    decodes = sorted(inst.decodes, key=lambda d: d.remaining_tokens)
    step = pred.tbt_s(len(decodes), sum(d.context_tokens for d in decodes)) if decodes else 0.0
    for k in range(len(decodes) + 1):
        rest = decodes[k:]
        tbt = pred.tbt_s(len(rest) + 1, sum(d.context_tokens for d in rest) + request.prompt_tokens)
        if tbt <= slo_s:
            return decodes[k - 1].remaining_tokens * step if k > 0 else 0.0
    return None


def prefill_pool(cluster: ClusterSnapshot) -> tuple[tuple[InstanceView, ...], bool]:
    """Instances that can prefill, and whether the cluster is disaggregated."""
    prefill = cluster.by_role(Role.PREFILL)
    if prefill or cluster.by_role(Role.DECODE):
        return prefill, True
    return cluster.by_role(Role.MIXED), False
