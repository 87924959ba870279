"""Tenants' fair share of the work admitted, judged where SLO admission is (issue 37).

SLO admission alone is first come, first served: a tenant sending 10x its share fills the workers,
and then the other tenant's requests are predicted to miss and refused (benchmarks/bench_tenants.py's
`flood`: tenant A lost 46 points). The gateway's fair share of requests in flight
(conductor/routing/shares.py) binds only when `limits.max_inflight_requests` is near the fleet's
concurrency, which its default (4096) is not, and counts a short request as much as a long one.

So, as VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24) does, each tenant's
service is counted in predicted work: `prompt_tokens + 2 x max_tokens` of every request admitted
(VTC's default weights, an output token costing a decode step), decayed with a half-life of
`HALF_LIFE_S` so it measures the recent rate, not the day's total. A tenant is *contending* while an
SLO rejection (ttft_slo / tbt_slo) of one of its requests is at most `CONTEND_S` old: the fleet had
no room for it. A request of tenant T is refused (429 `tenant_share`) when another tenant contends and
T's service exceeds its weighted share of the service of T and the contenders, by more than `SLACK`
(so two tenants at the same rate do not refuse each other on noise). Work-conserving: with no other
tenant contending nobody is refused for share. Since decay scales every tenant's service by the same
factor, comparing them needs no decay at decision time; the state changes only in `record`.

A tenant's urgent request is never refused for its own sheddable work: a request of a class that is
not sheddable is judged as if the tenant had sent nothing sheddable (its non-sheddable service, against
its share of that plus the contenders' service); its batch goes first, through the guarded SLO of
policies/classes.py. Counting its batch in the total instead let a flooding tenant's urgent requests
through while its batch raised the total (measured: B's urgent work was 3.5x A's whole). The tenants are the configured ones
(`ClassRules.weights`, from `auth.tenants`): a request's tenant that is not one is not counted, so
the table is bounded by the configuration.
"""

from __future__ import annotations

import math

from conductor.core.types import Decision, Rejection, RequestView
from policies.admission import TBT_SLO, TTFT_SLO
from policies.classes import ClassRules

TENANT_SHARE = "tenant_share"
HALF_LIFE_S = 10.0  # the service counted is that of about the last half-minute
CONTEND_S = 5.0  # an SLO rejection this recent makes its tenant a contender
SLACK = 0.1  # above its share by more than this, a tenant is refused
OUTPUT_WEIGHT = 2.0  # an output token's work against a prompt token's (VTC's default)
RETRY_AFTER_S = 1.0


def work(request: RequestView) -> float:
    """The request's predicted work (module docstring)."""
    return request.prompt_tokens + OUTPUT_WEIGHT * request.max_tokens


def over_share(own: float, total: float, weight: float, weights_total: float) -> bool:
    """Whether a tenant with `own` of the contenders' `total` service is above its weighted share."""
    return own > (1.0 + SLACK) * total * weight / weights_total


class TenantService:
    """Each configured tenant's decayed service and last SLO rejection."""

    __slots__ = ("_at", "_kept", "_rejected_at", "_served", "rules")

    def __init__(self, rules: ClassRules) -> None:
        self.rules = rules
        self._served = dict.fromkeys(rules.weights, 0.0)  # tenant -> decayed work admitted
        self._kept = dict.fromkeys(rules.weights, 0.0)  # the same, of its classes that are not sheddable
        self._rejected_at = dict.fromkeys(rules.weights, -math.inf)  # tenant -> its last SLO rejection
        self._at = 0.0  # when the services were last decayed

    def refuse(self, request: RequestView, now: float) -> Rejection | None:
        """The 429 for `request` when its tenant is above its share while another contends, else None."""
        tenant, weights = request.tenant, self.rules.weights
        if tenant is None or tenant not in weights:
            return None
        others = [t for t in weights if t != tenant and now - self._rejected_at[t] <= CONTEND_S]
        if not others:
            return None
        sheddable = self.rules.is_sheddable(request.priority)
        own = self._served[tenant] if sheddable else self._kept[tenant]
        total = own + sum(self._served[t] for t in others)
        weights_total = weights[tenant] + sum(weights[t] for t in others)
        if not over_share(own, total, weights[tenant], weights_total):
            return None
        part = own / total if total > 0 else 0.0
        return Rejection(
            reason=TENANT_SHARE,
            message=(
                f"tenant {tenant!r} has {part:.0%} of the recent work admitted ({'all' if sheddable else 'urgent'} "
                f"classes), over its share {weights[tenant] / weights_total:.0%} while tenant(s) "
                f"{', '.join(repr(t) for t in others)} are refused for want of room"
            ),
            retry_after_s=RETRY_AFTER_S,
        )

    def record(self, request: RequestView, decision: Decision, now: float) -> None:
        """The one place this table changes: an admitted request's work, or an SLO rejection's time."""
        tenant = request.tenant
        if tenant is None or tenant not in self._served:
            return
        rejection = decision.rejection
        if rejection is not None:
            if rejection.reason in (TTFT_SLO, TBT_SLO):
                self._rejected_at[tenant] = now
            return
        if now > self._at:
            factor = 0.5 ** ((now - self._at) / HALF_LIFE_S)
            for table in (self._served, self._kept):
                for t in table:
                    table[t] *= factor
            self._at = now
        w = work(request)
        self._served[tenant] += w
        if not self.rules.is_sheddable(request.priority):
            self._kept[tenant] += w
