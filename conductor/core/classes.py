"""Priority classes and tenants as a policy's admission is told of them (issue 37): a frozen value
the gateway builds once at start-up from `priority.classes` and `auth.tenants`
(conductor/routing/router.py) and hands to a policy that is `ClassAware` (conductor/core/capabilities.py).
What admission does with it: policies/classes.py (the guarded SLO), policies/kvcache_aware/fairness.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from conductor.core.types import Slo

GUARD_MARGIN = 0.5  # the share of the urgent class's SLO a less urgent request may use


@dataclass(frozen=True, slots=True)
class ClassRules:
    """The classes and tenants a policy's admission is told of (all empty: none configured)."""

    ranks: Mapping[str, int] = field(default_factory=dict)  # class -> rank, 0 the most urgent
    sheddable: frozenset[str] = frozenset()
    urgent_slo: Slo = field(default_factory=Slo)  # the most urgent class's SLO
    guard_margin: float = GUARD_MARGIN
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> its weight

    def less_urgent(self, cls: str | None) -> bool:
        """Whether a request of `cls` ranks below the most urgent class (is guarded)."""
        if cls is None or cls not in self.ranks:
            return False
        return self.ranks[cls] > min(self.ranks.values())

    def is_sheddable(self, cls: str | None) -> bool:
        return cls is not None and cls in self.sheddable


NO_RULES = ClassRules()
