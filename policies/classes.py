"""Priority classes and tenants as admission sees them (issue 37): pure rules, no state.

`ClassRules` is what the gateway tells a policy once, at start-up (conductor/routing/router.py builds
it from `priority.classes` and `auth.tenants`): each class's rank, which are sheddable, the most
urgent class's SLO, and each tenant's weight.

Guarded SLO (`guarded`): a request of a class less urgent than the most urgent one is admitted only
where its placement leaves the most urgent class's SLO met, with a margin. So it is judged by
`min(its own SLO, guard_margin x the urgent SLO)`, field by field. Why: every stream on a worker
decodes at the same step time, so a batch request whose predicted TBT there is within half the urgent
TBT leaves that worker able to take urgent streams; judged by its own loose TBT (0.9 s against the
urgent 0.24 s in benchmarks/bench_tenants.py) it filled the decode batches and every urgent request
admitted at 3x overload missed (docs/benchmarks.md). TTFT likewise: a batch prefill queued where the
urgent TTFT would then be missed would delay every urgent request sent behind it. The margin leaves
the urgent class the rest. On mixed workers kvcache_aware adds two rules for such a class
(policies/kvcache_aware/mixed.py, prefill_duty.py): its prefill must be absorbed by the streams there
on top of the prefills queued ahead of it, and its TBT bound is stretched by the worker's prefill duty.
With the guard alone urgent met 33% and 39% among admitted at 3x (two single runs); with both, see
docs/benchmarks.md. A class's SLO as the client sees it (`Router.slo_for`, the gateway's SLO
metrics) is unchanged: only admission judges by the guard.
"""

from __future__ import annotations

from dataclasses import replace

from conductor.core.classes import ClassRules
from conductor.core.types import RequestView, Slo

__all__ = ["guard_slo", "guarded"]


def guard_slo(own: Slo, urgent: Slo, margin: float) -> Slo:
    """`own`, each field no looser than `margin` x the urgent one's (a field None: no bound there)."""
    return Slo(ttft_s=_tighter(own.ttft_s, urgent.ttft_s, margin), tbt_s=_tighter(own.tbt_s, urgent.tbt_s, margin))


def _tighter(own: float | None, urgent: float | None, margin: float) -> float | None:
    if urgent is None:
        return own
    guard = urgent * margin
    return guard if own is None else min(own, guard)


def guarded(request: RequestView, rules: ClassRules) -> RequestView:
    """The request as admission judges it: a less urgent class's under the guarded SLO, else itself."""
    if not rules.less_urgent(request.priority):
        return request
    slo = guard_slo(request.slo, rules.urgent_slo, rules.guard_margin)
    return request if slo == request.slo else replace(request, slo=slo)
