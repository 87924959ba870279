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
  its SLO (the fleet filling up before anyone is refused yet);
- another tenant is active (sent a request within `ACTIVE_S`): the contenders;
- T floods: its demand per weight is more than `FLOOD` x the contenders' demand per weight;
- T's service exceeds its weighted share of the service of T and the contenders.
Why it acts before the other tenant is refused: it used to wait for one of A's requests to be refused
for room, and by then B's streams, admitted while there was room, held it for their whole life; A's
batch, which needs a worker with little recent prefill duty (prefill_duty.py), was refused behind
them (19.8 points lost, 3 runs of 9.5-22.3; docs/benchmarks.md). Why the flood test: tenants sending
at about the same rate never refuse each other on the noise of their service, so tenants within their
share lose nothing to this rule (the `share` and `3x` scenarios). Work-conserving: a tenant alone, or
with no request refused or near its SLO, is never refused for share. What it costs: a flooding tenant
beside one that sends little is held to about that one's service while the fleet is short of room.

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

from conductor.core.types import Decision, Rejection, RequestView
from policies.admission import TBT_SLO, TTFT_SLO
from policies.classes import ClassRules

TENANT_SHARE = "tenant_share"
HALF_LIFE_S = 10.0  # the service counted is that of about the last half-minute
CONTEND_S = 5.0  # an SLO rejection this recent says the fleet is short of room
ACTIVE_S = 5.0  # a tenant that sent a request this recently is a contender
NEAR = 0.5  # a predicted TTFT past this share of its SLO: the fleet is filling up
# demand per weight past this multiple of the contenders': a flooding tenant (10x is one; 1.5 took the
# even 3x trace of tests/traces/test_sim_classes.py for a flood, its batch sizes' noise)
FLOOD = 3.0
OUTPUT_WEIGHT = 2.0  # an output token's work against a prompt token's (VTC's default)
RETRY_AFTER_S = 1.0


def work(request: RequestView) -> float:
    """The request's predicted work (module docstring)."""
    return request.prompt_tokens + OUTPUT_WEIGHT * request.max_tokens


def over_share(own: float, total: float, weight: float, weights_total: float) -> bool:
    """Whether a tenant with `own` of the contenders' `total` service is above its weighted share."""
    return own > total * weight / weights_total


def flooding(own: float, weight: float, theirs: float, their_weights: float) -> bool:
    """Whether a tenant's demand `own` per weight is past `FLOOD` x the contenders' `theirs` per weight."""
    return own / weight > FLOOD * theirs / their_weights


class TenantService:
    """Each configured tenant's decayed service and demand, its last request, the last SLO rejection."""

    __slots__ = ("_at", "_full_at", "_seen_at", "_sent", "_served", "rules")

    def __init__(self, rules: ClassRules) -> None:
        self.rules = rules
        self._served = dict.fromkeys(rules.weights, 0.0)  # tenant -> decayed work admitted
        self._sent = dict.fromkeys(rules.weights, 0.0)  # tenant -> decayed work sent, admitted or not
        self._seen_at = dict.fromkeys(rules.weights, -math.inf)  # tenant -> its last request decided
        self._full_at = -math.inf  # the last SLO rejection, of any tenant's request
        self._at = 0.0  # when the tables were last decayed

    def refuse(self, request: RequestView, now: float, ttft_s: float | None = None) -> Rejection | None:
        """The 429 for `request` (predicted TTFT `ttft_s`) when its tenant floods above its share
        while the fleet is short of room and another tenant is active, else None."""
        tenant, weights = request.tenant, self.rules.weights
        if tenant is None or tenant not in weights:
            return None
        slo = request.slo.ttft_s
        near = ttft_s is not None and slo is not None and ttft_s > NEAR * slo
        if not near and now - self._full_at > CONTEND_S:
            return None
        others = [t for t in weights if t != tenant and now - self._seen_at[t] <= ACTIVE_S]
        if not others:
            return None
        their_weights = sum(weights[t] for t in others)
        if not flooding(self._sent[tenant], weights[tenant], sum(self._sent[t] for t in others), their_weights):
            return None
        own = self._served[tenant]
        total = own + sum(self._served[t] for t in others)
        if not over_share(own, total, weights[tenant], weights[tenant] + their_weights):
            return None
        part = own / total if total > 0 else 0.0
        return Rejection(
            reason=TENANT_SHARE,
            message=(
                f"tenant {tenant!r} sends over {FLOOD:g}x its share and has {part:.0%} of the recent work "
                f"admitted, over its share {weights[tenant] / (weights[tenant] + their_weights):.0%}, while "
                f"tenant(s) {', '.join(repr(t) for t in others)} also send and the fleet is "
                f"{'filling up' if near else 'refusing requests for want of room'}"
            ),
            retry_after_s=RETRY_AFTER_S,
        )

    def record(self, request: RequestView, decision: Decision, now: float) -> None:
        """The one place these tables change: every request's work sent, an admitted one's work
        served, an SLO rejection's time."""
        rejection = decision.rejection
        if rejection is not None and rejection.reason in (TTFT_SLO, TBT_SLO):
            self._full_at = now  # whoever sent it: the fleet is short of room
        tenant = request.tenant
        if tenant is None or tenant not in self._served:
            return
        if now > self._at:
            factor = 0.5 ** ((now - self._at) / HALF_LIFE_S)
            for table in (self._served, self._sent):
                for t in table:
                    table[t] *= factor
            self._at = now
        self._seen_at[tenant] = now
        w = work(request)
        self._sent[tenant] += w
        if rejection is None:
            self._served[tenant] += w
