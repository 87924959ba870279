"""The gateway's priority classes, tenants and in-flight shares, handed to the simulator (traces/sim/classes.py).

traces may not import the gateway (tests/test_import_rules.py), so the gateway's code is wired in
here, outside both: `sim_classes(settings)` takes a gateway settings dict (only its `priority`,
`auth` and `limits` are read; benchmarks/bench_tenants.py's `conductor_settings` makes one), validates
it as the gateway does at start-up (conductor.config.settings.Settings: an unknown default class, a
sheddable class ranked as urgent as one that is not, ... fail here too), and gives the simulator

* the ClassRules a ClassAware policy is told: built as conductor/routing/router.py's
  `Router._class_rules` builds them (that method needs a whole Router; its five fields are read here
  from the same settings the same way);
* each class's SLO: its fields over the gateway-wide `slo` (`Router.slo_for` without headers or pools);
* per run, an `Admission` of the gateway's own objects: conductor/routing/priority.py's `Classifier`
  and conductor/routing/shares.py's `Shares` over conductor/routing/request_path.py's `InflightLimit`
  (`limits.max_inflight_requests`), its clock the simulated one, its metrics a throwaway registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from conductor.config.pools import SloSettings
from conductor.config.settings import Settings
from conductor.core.classes import ClassRules
from conductor.core.errors import Overloaded, Rejected
from conductor.core.types import Slo
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.priority import Classifier
from conductor.routing.request_path import InflightLimit
from conductor.routing.shares import Shares
from traces.sim.classes import SimClasses

SECTIONS = ("priority", "auth", "limits", "slo")
OVERLOADED = "overloaded"  # the in-flight limit's 503 (Overloaded), counted as a refusal


class GatewayAdmission:
    """traces.sim.classes.Admission by the gateway's Classifier and Shares."""

    def __init__(self, settings: Settings, clock: Callable[[], float]) -> None:
        self.limit = InflightLimit(settings.limits.max_inflight_requests)
        self.shares = Shares(settings, self.limit, GatewayMetrics(), clock=clock)
        self._classifier = Classifier(settings.priority, {name: t.priority for name, t in settings.auth.tenants.items()})
        self._tenants = frozenset(settings.auth.tenants)

    def classify(self, priority: str | None, tenant: str | None) -> tuple[str | None, str | None]:
        known = tenant if tenant in self._tenants else None
        return self._classifier.classify(priority, {}, known), known

    def enter(self, priority: str | None, tenant: str | None) -> str | None:
        try:
            self.shares.enter(priority, tenant)
        except Rejected as exc:
            return exc.reason
        except Overloaded:
            return OVERLOADED
        return None

    def leave(self, tenant: str | None) -> None:
        self.shares.leave(tenant)


class _Factory:
    """A fresh GatewayAdmission per run (a class, not a closure: SimConfig travels to worker processes)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __call__(self, clock: Callable[[], float]) -> GatewayAdmission:
        return GatewayAdmission(self.settings, clock)


def sim_classes(settings: Mapping[str, Any]) -> SimClasses:
    """The simulator's classes and tenants from a gateway settings dict (module docstring)."""
    s = Settings.model_validate({k: settings[k] for k in SECTIONS if k in settings})
    default = Slo(ttft_s=s.slo.ttft_s, tbt_s=s.slo.tbt_s)
    slos = {name: _class_slo(c.slo, default) for name, c in s.priority.classes.items()}
    names = s.priority.names()
    rules = ClassRules(
        ranks={name: c.rank for name, c in s.priority.classes.items()},
        sheddable=frozenset(s.priority.shares()),
        urgent_slo=slos[names[0]] if names else default,
        guard_margin=s.priority.guard_margin,
        weights={name: t.weight for name, t in s.auth.tenants.items()},
    )
    return SimClasses(rules=rules, slos=slos, admission=_Factory(s))


def _class_slo(slo: SloSettings | None, default: Slo) -> Slo:
    """A class's SLO fields (those it sets) over `default`'s."""
    if slo is None:
        return default
    fields = {key: getattr(slo, key) for key in slo.model_fields_set}
    return Slo(ttft_s=fields.get("ttft_s", default.ttft_s), tbt_s=fields.get("tbt_s", default.tbt_s))
