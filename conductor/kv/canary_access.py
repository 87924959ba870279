"""An analyzer's KV canary, for the parts that report or steer it (/ready, the fleet's membership)
without knowing which analyzer they were given."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from conductor.kv.canary import KVCanary


@runtime_checkable
class RunsCanaries(Protocol):
    """An analyzer that checks instances' KV events before trusting them (KVAwareAnalyzer; None: turned off)."""

    @property
    def canary(self) -> KVCanary | None: ...


def canary_of(analyzer: object) -> KVCanary | None:
    """The analyzer's canary, None for one that runs none."""
    return analyzer.canary if isinstance(analyzer, RunsCanaries) else None


def canary_detail(analyzer: object) -> dict[str, Any] | None:
    """The canary report of an analyzer that runs canaries (None for one that does not)."""
    canary = canary_of(analyzer)
    return canary.report() if canary is not None and canary.enabled else None
