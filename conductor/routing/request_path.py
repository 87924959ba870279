"""What the request path (conductor/server/endpoint.py) is given by the gateway that wires it, and
the in-flight limit it admits requests under (through `Shares`, conductor/routing/shares.py, which adds
the priority classes' and tenants' rules). The endpoint knows these parts, never the Gateway."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from adapters.load_share import LoadShare
from conductor.config.settings import Settings
from conductor.core.errors import Overloaded
from conductor.kv.analysis import PromptAnalyzer
from conductor.ops.metrics import GatewayMetrics
from conductor.ops.tracing import Tracing
from conductor.routing.deadlines import Deadlines
from conductor.routing.priority import Classifier
from conductor.routing.relay import Relay
from conductor.routing.router import Router
from conductor.routing.shares import Shares
from conductor.routing.waiting_room import WaitingRoom


class InflightLimit:
    """Requests between admission and their last byte, at most `limit`. `enter` checks and counts
    in one step with no await between them, so requests arriving together cannot all pass a check
    that one free slot allows; 503 (Overloaded) without queueing when none is free."""

    __slots__ = ("count", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def enter(self) -> None:
        if self.count >= self.limit:
            raise Overloaded(f"the gateway already has {self.count} requests in flight")
        self.count += 1

    def leave(self) -> None:
        self.count -= 1


@dataclass(frozen=True, slots=True)
class RequestPath:
    """What the request path uses, wired once by the gateway."""

    settings: Settings
    # the client's Authorization header: 401 unless accepted; else its key's tenant (auth.tenants) or None
    authorize: Callable[[str | None], str | None]
    known_models: Callable[[], Collection[str]]  # what a request may name (empty: anything)
    analyzer: PromptAnalyzer
    router: Router
    relay: Relay
    waiting_room: WaitingRoom  # holds a request refused for its TBT until streams end
    deadlines: Deadlines
    inflight: InflightLimit
    shares: Shares  # admits into `inflight`: priority classes shed first, tenants' fair shares
    classes: Classifier  # each request's priority class
    load_share: LoadShare  # other replicas' load, refreshed before each decision
    metrics: GatewayMetrics
    tracing: Tracing | None
    upstream_key: str | None  # sent to the workers instead of the client's key
