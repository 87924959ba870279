"""Tenants' fair share of the work admitted, judged where SLO admission is (issue 37).

SLO admission alone is first come, first served: a tenant sending 10x its share fills the workers,
and then the other tenant's requests are predicted to miss and refused (benchmarks/bench_tenants.py's
`flood`: tenant A lost 46 points). The gateway's fair share of requests in flight
(conductor/routing/shares.py) binds only when `limits.max_inflight_requests` is near the fleet's
concurrency, which its default (4096) is not, and counts a short request as much as a long one.

So, as VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24) does, each tenant's
service is counted in predicted work: `prompt_tokens + 2 x max_tokens` of every request admitted
(VTC's default weights, an output token costing a decode step), decayed with a half-life of
`HALF_LIFE_S` so it measures the recent rate, not the day's total; its demand likewise, of every
request it sent, admitted or not.

A request of tenant T is refused (429 `tenant_share`) when all of these hold:
- the fleet is short of room: a request (any tenant's) was refused for a predicted SLO miss
  (ttft_slo / tbt_slo) at most `CONTEND_S` ago, or this request's own predicted TTFT is past `NEAR` of
  its SLO (the fleet filling up before anyone is refused yet), or, on mixed workers, it would be
  placed on a worker already decoding streams (`busy`: no idle worker takes it);
- another tenant is active (sent a request within `ACTIVE_S`): the contenders;
- T floods: its demand per weight is more than `FLOOD` x the contenders' demand per weight, the
  contenders credited with `EVIDENCE` requests of T's mean size (so the first few requests of an even
  load, a handful each, are no flood);
- T's service exceeds its weighted share of the service of T and the contenders;
- a contender is short of its max-min fair share, min(its demand, its weighted part of that
  service): it sends at the rate of its whole part or more (`wants`: its decayed demand scaled up
  where its sending period is younger than the tables' window), or it is served under min(its
  decayed demand, its part) by more than `SLACK` of the service.
Why it acts before the other tenant is refused: it used to wait for one of A's requests to be refused
for room, and by then B's streams, admitted while there was room, held it for their whole life; A's
batch, which needs a worker with little recent prefill duty (prefill_duty.py), was refused behind
them (19.8 points lost, 3 runs of 9.5-22.3; docs/benchmarks.md). Why `busy`: the policy's decisions
in the simulated `flood` (benchmarks/bench_sim_tenants.py, seed 0) showed the flooder admitted over
its share in the first 4 s of a fresh fleet, its predicted TTFTs short and nobody yet refused, while
its prefills took every worker's prefill duty to ~0.5; the other tenant's batch, which fits beside
streams only under a duty of a few percent, was then refused tbt_slo for ~10 s more (the duty window,
the streams' life). Over 4 seeds A's batch was admitted 70-100% in the first 10 s of `share`, 36-57%
in those of `flood`, and about the same in both after: nearly all of A's loss was that start. A
worker with streams is where a less urgent class has room only under that small duty, so a
flooder's request placed there takes room another tenant's request needs (live, 3 runs: 3.2 points
lost, from 11.7). Why the flood test: tenants sending at about the same rate never refuse each other
on the noise of their service, so tenants within their share lose nothing to this rule (the `share`
and `3x` scenarios; `EVIDENCE` keeps the first second of `3x` from refusing anyone). Why the
max-min test (work-conserving, issue 37): without it a flooder beside a tenant that sends little was
held to about that one's service whenever the fleet was short of room, which with `busy` is nearly
always (simulated `trickle`, B at 10x beside A at 0.05x its share, 4 seeds: the fleet met 20.9% of
all sent, 32.1% with no share rule); what a tenant does not use is the others' to take. The test is
on demand, not on service alone, because the flood is decided before the other tenant is short: its
service equals its demand until B's streams crowd it out (the loss `busy` was added for), while its
demand rate, from its first requests, already shows it wants its whole part; a trickle's does so only
for the few seconds after its first request in `RESET_S`. `SLACK` leaves a trickle whose
few requests are refused for room to the class rules: holding the flooder back for it cost ~10
points of the fleet's met share. With it (bench_sim_tenants.py, 4 seeds): `trickle` 32.3% (no share
rule 32.1%), A's loss in `flood` 2.9 points, as before (the same per seed); since the young policy's
prefill duty (prefill_duty.py, 8 seeds): `trickle` 29.6% (31.8%), A's loss 1.1. Work-conserving
as far as it goes: a tenant alone, one placed on an idle worker with no request refused or near its
SLO, or one whose contenders have their fair share, is never refused for share. What it costs still:
a contender between a trickle and its part, crowded out by the flood, holds the flooder back while
it is short (simulated, A at 0.2x-0.8x its share beside B at 10x: the fleet met 10-16% of all sent,
30-32% with no share rule, A 57-87% against 22-30%).

A tenant's whole service is weighed, whatever the request's class: judging the flooder's urgent
requests by its urgent work alone admitted them up to 1.22x the other tenant's entire work, and their
prefills kept the workers' duty above what the other tenant's batch fits under (decision log of
`flood`: A's batch refused tbt_slo while B's urgent streams were admitted). Within a tenant the lowest
class still goes first: its batch is judged by the guarded SLO (policies/classes.py). The tenants are
the configured ones (`ClassRules.weights`, from `auth.tenants`): a request's tenant that is not one is
not counted, so the tables are bounded by the configuration.
"""

from __future__ import annotations

import math

from conductor.core.classes import ClassRules
from conductor.core.types import Decision, Rejection, RequestView
from policies.admission import TBT_SLO, TTFT_SLO

TENANT_SHARE = "tenant_share"
HALF_LIFE_S = 10.0  # the service counted is that of about the last half-minute
CONTEND_S = 5.0  # an SLO rejection this recent says the fleet is short of room
ACTIVE_S = 5.0  # a tenant that sent a request this recently is a contender
NEAR = 0.5  # a predicted TTFT past this share of its SLO: the fleet is filling up
# demand per weight past this multiple of the contenders': a flooding tenant (10x is one; 1.5 took the
# even 3x trace of tests/traces/test_sim_classes.py for a flood, its batch sizes' noise)
FLOOD = 3.0
# the contenders are credited with this many of the flooder's mean requests: at an even 3x load's
# start, with a handful of requests each, one tenant's first few were taken for a flood (simulated)
EVIDENCE = 3.0
# a contender short of its fair share by less than this part of the fleet's service is left to the class
# rules: a trickle's refused requests (B at 10x beside A at 0.05x, simulated) came to at most 0.09 of
# it, and holding the flooder back for them (SLACK 0.02-0.05) cost 6-10 points of the fleet's met share
SLACK = 0.1
# a tenant idle this long starts a new sending period: its demand's window is young again (3 half-lives:
# its tables are at 1/8 by then)
RESET_S = 30.0
OUTPUT_WEIGHT = 2.0  # an output token's work against a prompt token's (VTC's default)
RETRY_AFTER_S = 1.0


def work(request: RequestView) -> float:
    """The request's predicted work (module docstring)."""
    return request.prompt_tokens + OUTPUT_WEIGHT * request.max_tokens


def over_share(own: float, total: float, weight: float, weights_total: float) -> bool:
    """Whether a tenant with `own` of the contenders' `total` service is above its weighted share."""
    return own > total * weight / weights_total


def wants(sent: float, part: float, age_s: float) -> bool:
    """Whether a tenant that sent work `sent` (decayed) over the `age_s` seconds of its sending period
    sends at the rate of its weighted `part` of the service or more: the decayed sum of a period younger
    than the tables' window holds only `1 - 0.5 ** (age / HALF_LIFE_S)` of the rate's, so the part is
    scaled down by that."""
    return sent >= part * (1.0 - 0.5 ** (age_s / HALF_LIFE_S))


def flooding(own: float, weight: float, theirs: float, their_weights: float) -> bool:
    """Whether a tenant's demand `own` per weight is past `FLOOD` x the contenders' `theirs` per weight."""
    return own / weight > FLOOD * theirs / their_weights


class TenantService:
    """Each configured tenant's decayed service, demand and request count, its last request, the last
    SLO rejection."""

    __slots__ = ("_at", "_count", "_full_at", "_seen_at", "_sent", "_served", "_since", "rules")

    def __init__(self, rules: ClassRules) -> None:
        self.rules = rules
        self._served = dict.fromkeys(rules.weights, 0.0)  # tenant -> decayed work admitted
        self._sent = dict.fromkeys(rules.weights, 0.0)  # tenant -> decayed work sent, admitted or not
        self._count = dict.fromkeys(rules.weights, 0.0)  # tenant -> decayed requests sent (its mean size)
        self._seen_at = dict.fromkeys(rules.weights, -math.inf)  # tenant -> its last request decided
        self._full_at = -math.inf  # the last SLO rejection, of any tenant's request
        self._at = 0.0  # when the tables were last decayed
        self._since = dict.fromkeys(rules.weights, -math.inf)  # tenant -> the start of its sending period

    def refuse(self, request: RequestView, now: float, ttft_s: float | None = None, busy: bool = False) -> Rejection | None:
        """The 429 for `request` (predicted TTFT `ttft_s`; `busy`: placed on a mixed worker decoding
        streams) when its tenant floods above its share while the fleet is short of room and another
        tenant is active, else None."""
        tenant, weights = request.tenant, self.rules.weights
        if tenant is None or tenant not in weights:
            return None
        slo = request.slo.ttft_s
        near = ttft_s is not None and slo is not None and ttft_s > NEAR * slo
        full = now - self._full_at <= CONTEND_S
        if not (near or full or busy):
            return None
        others = [t for t in weights if t != tenant and now - self._seen_at[t] <= ACTIVE_S]
        if not others:
            return None
        their_weights = sum(weights[t] for t in others)
        sent, count = self._sent[tenant], self._count[tenant]
        credit = EVIDENCE * sent / count if count > 0 else 0.0  # EVIDENCE of its mean requests
        if not flooding(sent, weights[tenant], sum(self._sent[t] for t in others) + credit, their_weights):
            return None
        own = self._served[tenant]
        total = own + sum(self._served[t] for t in others)
        if not over_share(own, total, weights[tenant], weights[tenant] + their_weights):
            return None
        if not self._starved(others, total, weights[tenant] + their_weights, now):
            return None
        room = "refusing requests for want of room" if full else "filling up" if near else "decoding streams where it would go"
        return _rejection(tenant, others, own / total if total > 0 else 0.0, weights[tenant], their_weights, room)

    def _starved(self, others: list[str], total: float, weights_total: float, now: float) -> bool:
        """Whether one of `others` is short of its max-min fair share of the service `total`: it wants
        its whole weighted part (its demand rate, `wants`), or it is served under min(its demand, its
        part) by more than `SLACK` of `total`."""
        weights = self.rules.weights
        for t in others:
            part = total * weights[t] / weights_total
            sent = self._sent[t]
            if wants(sent, part, now - self._since[t]):
                return True
            if self._served[t] < min(sent, part) - SLACK * total:
                return True
        return False

    def record(self, request: RequestView, decision: Decision, now: float) -> None:
        """The one place these tables change: every request's work sent and count, an admitted one's
        work served, an SLO rejection's time."""
        rejection = decision.rejection
        if rejection is not None and rejection.reason in (TTFT_SLO, TBT_SLO):
            self._full_at = now  # whoever sent it: the fleet is short of room
        tenant = request.tenant
        if tenant is None or tenant not in self._served:
            return
        if now > self._at:
            factor = 0.5 ** ((now - self._at) / HALF_LIFE_S)
            for table in (self._served, self._sent, self._count):
                for t in table:
                    table[t] *= factor
            self._at = now
        if now - self._seen_at[tenant] > RESET_S:  # a new sending period (`wants`)
            self._since[tenant] = now
        self._seen_at[tenant] = now
        w = work(request)
        self._sent[tenant] += w
        self._count[tenant] += 1.0
        if rejection is None:
            self._served[tenant] += w


def _rejection(tenant: str, others: list[str], part: float, weight: float, their_weights: float, room: str) -> Rejection:
    """The 429 `refuse` answers, saying why (`room`: how the fleet is short of it)."""
    share = weight / (weight + their_weights)
    return Rejection(
        reason=TENANT_SHARE,
        message=(
            f"tenant {tenant!r} sends over {FLOOD:g}x its share and has {part:.0%} of the recent work "
            f"admitted, over its share {share:.0%}, while tenant(s) {', '.join(repr(t) for t in others)} "
            f"also send and the fleet is {room}"
        ),
        retry_after_s=RETRY_AFTER_S,
    )
