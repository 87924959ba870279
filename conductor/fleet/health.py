"""Whether an instance may take requests: active health probes plus passive outlier ejection.

Two signals, because each misses what the other sees:

* Probes (`GET /health` every `health_interval_s`, on connections of their own so a decode busy
  with hundreds of streams still answers them) catch a worker that is down or hung. An instance
  out of rotation is probed every `health_unhealthy_interval_s` instead (1 s by default), so one
  that comes up or recovers does not wait out the whole interval.
  `unhealthy_after` failed probes in a row take it out; one good probe brings it back.
* Outlier ejection catches a worker whose `/health` is fine but which fails the requests
  themselves (a 500 to everything, connections reset mid-answer): `outlier.consecutive_errors`
  failures in a row eject it for `outlier.ejection_s`, doubled for each ejection in a row up to
  `outlier.max_ejection_s`. When that time is over the next good probe re-admits it; a request
  that then succeeds clears the doubling. At most `outlier.max_ejected_fraction` of a role's
  instances are out by ejection at once (at least one may always be), so a fault that hits every
  worker alike (a bad model name upstream, say) does not empty the pool.

Neither may empty it wholesale: below `health.panic_threshold` (50%) of a role's instances
available, routing trusts neither signal and goes over every instance of the role that has ever
answered a probe and does not refuse connections now (`panicking`, Envoy's panic threshold); /ready
and the metrics still tell the truth.

The clock is passed in (monotonic seconds), so the state machine is tested without sleeping.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from conductor.core.types import Role

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealthRules:
    unhealthy_after: int = 2  # failed probes in a row
    consecutive_errors: int = 5  # failed requests in a row that eject
    ejection_s: float = 10.0
    max_ejection_s: float = 300.0
    max_ejected_fraction: float = 0.5
    # below this share of a role's instances available, route over all of them that have ever
    # answered a probe rather than over the few left (Envoy's panic threshold); 0: never
    panic_threshold: float = 0.5


@dataclass(slots=True)
class InstanceHealth:
    """One instance's health; `available` is what routing reads."""

    name: str
    probe_ok: bool = False  # unknown until the first probe answers
    probe_failures: int = 0
    errors_in_a_row: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    ejections_in_a_row: int = 0
    ejections_total: int = 0
    probes_total: int = 0  # probes counted, answered or not (what shows the probe schedule)
    answered: bool = False  # a probe has succeeded at least once: known to exist, maybe up again
    refused: bool = False  # its last failed probe found nothing listening (refused, unreachable): down, not slow

    @property
    def available(self) -> bool:
        return self.probe_ok and not self.ejected

    @property
    def routable_in_panic(self) -> bool:
        """Worth a request when its role is in panic: it has answered before, and its probes now
        time out or fail rather than find nothing listening (a stopped worker stays out)."""
        return self.answered and not self.refused

    def on_probe(self, ok: bool, now: float, rules: HealthRules, refused: bool | None = None) -> None:
        """A probe's outcome; `refused`: whether a failed one found nothing listening (None: unknown)."""
        self.probes_total += 1
        if refused is not None or ok:
            self.refused = bool(refused) and not ok
        if ok:
            if not self.probe_ok:
                log.info("instance %s answers its health probe", self.name)
            self.probe_ok, self.probe_failures, self.answered = True, 0, True
            if self.ejected and now >= self.ejected_until:
                log.info("instance %s re-admitted after ejection", self.name)
                self.ejected, self.errors_in_a_row = False, 0
            return
        self.probe_failures += 1
        if self.probe_ok and self.probe_failures >= rules.unhealthy_after:
            log.warning("instance %s failed %d health probes: out of rotation", self.name, self.probe_failures)
            self.probe_ok = False

    def on_success(self) -> None:
        self.errors_in_a_row = 0
        self.ejections_in_a_row = 0

    def on_error(self, now: float, rules: HealthRules, may_eject: bool) -> bool:
        """A request failed here (5xx or transport). True when this ejects the instance."""
        self.errors_in_a_row += 1
        if self.ejected or self.errors_in_a_row < rules.consecutive_errors or not may_eject:
            return False
        period = min(rules.max_ejection_s, rules.ejection_s * (2**self.ejections_in_a_row))
        self.ejected, self.ejected_until = True, now + period
        self.ejections_in_a_row += 1
        self.ejections_total += 1
        log.warning("instance %s failed %d requests in a row: ejected for %.1fs", self.name, self.errors_in_a_row, period)
        return True


def may_eject(role_members: list[InstanceHealth], rules: HealthRules) -> bool:
    """Whether one more of these instances may be ejected under the fraction cap."""
    ejected = sum(1 for h in role_members if h.ejected)
    cap = max(1, math.floor(len(role_members) * rules.max_ejected_fraction))
    return ejected < cap


def panicking(role_members: list[InstanceHealth], rules: HealthRules) -> bool:
    """Whether fewer than `rules.panic_threshold` of these instances (one role's, in rotation) are
    available. Then health is not to be trusted: when a starved gateway host times out every
    probe at once, or a shared dependency flaps, the pool empties although most of it works, and
    every request would get a 503 for a whole probe round. Like Envoy's panic mode, routing then
    goes over every instance that has ever answered (a request that fails there fails over)
    rather than over the few left or none; one that never answered (still loading, a wrong
    address) or that refuses connections now (stopped) stays out."""
    if not role_members or rules.panic_threshold <= 0:
        return False
    available = sum(1 for h in role_members if h.available)
    return available < rules.panic_threshold * len(role_members)


def log_panic_change(
    before: frozenset[Role], after: frozenset[Role], by_role: Mapping[Role, list[InstanceHealth]], rules: HealthRules
) -> None:
    """A role entering or leaving panic, logged once as it happens."""
    for role in after - before:
        healths = by_role[role]
        log.warning(
            "PANIC: %d of %d %s instances available, below health.panic_threshold %.0f%%: routing over "
            "every one that has answered a probe until more recover",
            sum(1 for h in healths if h.available),
            len(healths),
            role.value,
            100 * rules.panic_threshold,
        )
    for role in before - after:
        log.warning("panic over: %s instances back above health.panic_threshold", role.value)


def refused_probe(exc: BaseException) -> bool:
    """Whether a probe failed because nothing listens there (refused, unreachable) rather than on a
    timeout: a stopped worker refuses, a starved gateway's probes time out."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, OSError) and not isinstance(cause, TimeoutError):
            return True
        cause = cause.__cause__
    return False
