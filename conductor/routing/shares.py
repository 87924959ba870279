"""Who may take the next in-flight slot: priority classes shed first, and each tenant's fair share.

The gateway holds at most `limits.max_inflight_requests` requests between admission and their last
byte (InflightLimit, conductor/routing/request_path.py). `Shares` admits a request into that limit
under two more rules, each a pure function of counts (tested directly), checked in one step with no
await between check and count, and counts every request exactly once in and once out.

Shedding (`shed`): a request of a sheddable class (`priority.classes.<c>.sheddable`) is refused
(429 `priority_shed`) when the gateway's requests in flight, of every class, are already at
`floor(share x limit)` or more. Why this protects the other classes: a sheddable request is only ever
admitted while fewer than `cap = floor(share x limit)` requests are in flight, so it finds fewer than
`cap` sheddable ones in flight then; by induction sheddable requests never hold more than `cap` slots
at once, and `limit - cap` slots always stay reachable for the classes that are not sheddable,
whatever the sheddable load. And since the count is of all classes, an urgent load past `cap` alone
sheds every new sheddable request: under overload they go first. Several sheddable classes, a less
urgent one with a share no larger (conductor/config/priority.py), are shed least urgent first.

Shedding by tenant (`shed_for_tenant`): with tenants, the count above is of every tenant's requests,
so a tenant flooding the gateway would push it past `cap` and shed the sheddable requests of a tenant
that keeps within its share (measured: benchmarks/bench_tenants.py's `flood`, tenant A's attainment
fell 40 points). So a tenant's sheddable request that the gateway-wide rule refuses is still admitted
while the tenant has fewer than `floor(share x g)` requests in flight, g its fair-share guarantee
(below): the same rule, applied to the tenant's own guarantee instead of the whole limit. A tenant
alone has g = limit, the gateway-wide rule. What it keeps: a tenant's sheddable requests admitted past
`cap` leave it at most `floor(share x g)` in flight, so within its guarantee `g - floor(share x g)`
slots stay for its urgent classes, which its guarantee makes reachable (the fair-share argument below);
the sheddable requests of all tenants together hold at most `cap + sum floor(share x g)` <= 2 cap.

Fair share (`over_share`): tenants (`auth.tenants`, by API key) with weights w. The contenders are the
tenants with requests in flight or refused for want of a free slot (the 503 of a full limit) within the
last `WAITING_S`: a tenant whose requests find the limit full is waiting, and must be seen although it
holds nothing yet. A contender is guaranteed `g = max(1, floor(limit x w / W))` requests in flight, W
the sum of the contenders' weights. Its next request is refused (429 `tenant_share`) when it would take
it past its guarantee and into room that another contender's guarantee leaves unused: admitted while
`count + 1 <= g`, or while `free slots - 1 >= the sum over the others of max(0, g - count)`. So a
tenant alone may use everything (work-conserving), and beside others whatever their guarantees leave
free. Why a tenant under its guarantee finds a slot: while the same tenants contend (and their
guarantees add up to at most the limit), the free slots never fall below the unused guarantees of all
of them (an entry within a guarantee uses one of each; one past it is only admitted with the others'
unused room still free after it; a departure frees one slot and one unit at most), so a tenant with
unused guarantee sees a free slot. A tenant that held more than its guarantee when another arrived
(it was alone) is refused until it is back within it; none is preempted. Requests without a tenant (a
plain `auth.api_keys` key, or no keys) are subject to neither rule but the limit, and take their slots too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping
from typing import NoReturn, Protocol

from conductor.config.settings import Settings
from conductor.core.errors import Overloaded, Rejected
from conductor.ops.metrics import GatewayMetrics

PRIORITY_SHED = "priority_shed"
TENANT_SHARE = "tenant_share"
OVERLOADED = "overloaded"  # the 503 of a full limit, as conductor_tenant_rejections_total counts it
# a tenant refused by the full limit counts as contending for this long: a client told Retry-After: 1
# is back well within it
WAITING_S = 5.0
RETRY_AFTER_S = 1.0


def shed(share: float, inflight: int, limit: int) -> bool:
    """Whether a request of a sheddable class with `share` is refused, `inflight` requests (all
    classes) being in flight under `limit` (see the module docstring: it never lets sheddable
    requests hold more than floor(share x limit) slots)."""
    return inflight >= math.floor(share * limit)


def shed_for_tenant(
    share: float,
    tenant: str,
    counts: Mapping[str, int],
    weights: Mapping[str, float],
    waiting: Collection[str],
    inflight: int,
    limit: int,
) -> bool:
    """Whether `tenant`'s request of a sheddable class with `share` is refused (module docstring):
    when the gateway-wide rule sheds it and the tenant already holds share x its guarantee."""
    if not shed(share, inflight, limit):
        return False
    others = _contenders(tenant, counts, weights, waiting)
    if not others:
        return True  # alone: its guarantee is the whole limit, the gateway-wide rule
    total = weights[tenant] + sum(weights[t] for t in others)
    return counts.get(tenant, 0) >= math.floor(share * _guaranteed(limit, weights[tenant], total))


def _contenders(tenant: str, counts: Mapping[str, int], weights: Mapping[str, float], waiting: Collection[str]) -> list[str]:
    """The other tenants with requests in flight or refused by the full limit lately."""
    return [t for t in weights if t != tenant and (counts.get(t, 0) > 0 or t in waiting)]


def over_share(
    tenant: str,
    counts: Mapping[str, int],
    weights: Mapping[str, float],
    waiting: Collection[str],
    inflight: int,
    limit: int,
) -> bool:
    """Whether `tenant`'s next request is refused for its fair share (module docstring): `counts`,
    tenant -> its requests in flight; `weights`, every tenant's; `waiting`, the tenants refused by the
    full limit lately; `inflight` requests in flight in all (tenants' or not) under `limit`."""
    others = _contenders(tenant, counts, weights, waiting)
    if not others:
        return False  # alone: all of it
    total = weights[tenant] + sum(weights[t] for t in others)
    if counts.get(tenant, 0) + 1 <= _guaranteed(limit, weights[tenant], total):
        return False
    unused = sum(max(0, _guaranteed(limit, weights[t], total) - counts.get(t, 0)) for t in others)
    return limit - inflight - 1 < unused  # the slot it would take is another's


def _guaranteed(limit: int, weight: float, total: float) -> int:
    """A contender's guaranteed requests in flight: its weighted share in whole requests, at least one
    (the 1e-9 keeps a share that is a whole number in exact arithmetic whole in floating point)."""
    return max(1, math.floor(limit * weight / total + 1e-9))


class Limit(Protocol):
    """The in-flight limit Shares admits into (InflightLimit)."""

    count: int
    limit: int

    def enter(self) -> None: ...

    def leave(self) -> None: ...


class Shares:
    """The in-flight limit with the class and tenant rules over it: `enter` before a request is
    decided (429 or 503 when refused, nothing counted then), `leave` once after its last byte."""

    def __init__(
        self, settings: Settings, limit: Limit, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limit = limit
        self._metrics = metrics
        self._clock = clock
        self._class_shares = settings.priority.shares()  # sheddable class -> its share
        self._weights = {name: tenant.weight for name, tenant in settings.auth.tenants.items()}
        self.tenants: dict[str, int] = dict.fromkeys(self._weights, 0)  # tenant -> its requests in flight
        self._refused_at: dict[str, float] = {}  # tenant -> when the full limit last refused it

    def enter(self, priority: str | None, tenant: str | None) -> None:
        limit = self._limit
        tenanted = tenant is not None and bool(self._weights)
        if priority is not None and priority in self._class_shares:
            self._shed(priority, self._class_shares[priority], tenant if tenanted else None)
        if tenant is None or not tenanted:
            limit.enter()
            return
        counts = self.tenants
        if over_share(tenant, counts, self._weights, self._waiting(), limit.count, limit.limit):
            self._refuse(
                TENANT_SHARE,
                f"tenant {tenant!r} has {counts[tenant]} requests in flight, its fair share of the gateway's "
                f"{limit.limit} while other tenants' requests are in flight or waiting",
                tenant,
            )
        try:
            limit.enter()
        except Overloaded:
            self._refused_at[tenant] = self._clock()
            self._metrics.tenant_rejections.labels(tenant, OVERLOADED).inc()
            raise
        counts[tenant] += 1

    def _shed(self, priority: str, share: float, tenant: str | None) -> None:
        """Refuse a request of the sheddable class `priority` that its share leaves no room for."""
        limit = self._limit
        if tenant is None:
            refused = shed(share, limit.count, limit.limit)
        else:
            refused = shed_for_tenant(share, tenant, self.tenants, self._weights, self._waiting(), limit.count, limit.limit)
        if refused:
            held = f"; tenant {tenant!r} holds {self.tenants[tenant]}, its part of that" if tenant is not None else ""
            self._refuse(
                PRIORITY_SHED,
                f"priority class {priority!r} is shed: the gateway has {limit.count} requests in flight, at or "
                f"over {share:g} of its limit of {limit.limit} that this class may be admitted under{held}",
                tenant,
            )

    def leave(self, tenant: str | None) -> None:
        self._limit.leave()
        if tenant is not None and self._weights:
            self.tenants[tenant] -= 1

    def _waiting(self) -> Collection[str]:
        if not self._refused_at:
            return ()
        since = self._clock() - WAITING_S
        return [tenant for tenant, at in self._refused_at.items() if at > since]

    def _refuse(self, reason: str, message: str, tenant: str | None) -> NoReturn:
        self._metrics.rejections.labels(reason).inc()
        if tenant is not None:
            self._metrics.tenant_rejections.labels(tenant, reason).inc()
        raise Rejected(message, reason=reason, retry_after_s=RETRY_AFTER_S)
