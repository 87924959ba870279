"""Requests held at the gateway while the streams cannot take them, within their TTFT budget.

A request refused for its TBT (`tbt_slo`: on a mixed worker its prefill would pause the streams
decoding there past the TBT SLO, or the decode batch it would join is too large) is refused for
the load of this moment: the streams are short, and as they end the same request fits. Its TTFT
SLO usually leaves room to wait for that (on the tool-agent trace over 4 mixed workers no admitted
request missed its TTFT while 5-12% were refused for their TBT: docs/benchmarks.md). So instead
of a 429 the request waits here, and is decided again each time a stream ends (`freed`), with its
TTFT SLO less the time it has waited: the policy's own TTFT admission ends the wait when too
little is left, and the request is refused as before. A 429 for its TTFT, a class shed or a tenant
over its share is sent at once: waiting cannot cure it (the queue drains no faster than the budget
runs out).

Bounded: at most `hold.max_held` requests wait at once (past it, the refusal is sent at once), none
longer than its TTFT SLO or `hold.max_wait_s`, none refused for a TBT it would miss on an idle
instance too (not `retryable`: waiting cannot cure that), and a client that goes away takes its request out (the task is
cancelled). Nothing is remembered, logged or counted for a decision that holds a request
(Router.decide_or_hold): the decision that finally admits or refuses it is the one logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from conductor.config.groups import HoldSettings
from conductor.core.types import Slo
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.router import Routed

# the decision with this SLO; True: a refusal the streams' ending may cure returns None instead
Decide = Callable[[Slo, bool], Routed | None]


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class WaitingRoom:
    """The requests held (see the module docstring); `freed` is told when a stream ends."""

    __slots__ = ("_changed", "_clock", "_metrics", "held", "max_held", "max_wait_s")

    def __init__(self, settings: HoldSettings, metrics: GatewayMetrics, clock: Callable[[], float] | None = None) -> None:
        self.max_held = settings.max_held if settings.enabled else 0
        self.max_wait_s = settings.max_wait_s
        self._metrics = metrics
        self._clock = clock or _loop_time  # the clock the request's arrival was read on
        self._changed: asyncio.Event | None = None  # made when the first request waits (on its loop)
        self.held = 0

    def freed(self) -> None:
        """A stream ended (a request's load left the registry): every held request is decided again."""
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    async def admit(self, decide: Decide, slo: Slo, arrived: float) -> Routed:
        """The request's decision, after holding it while the streams cannot take it; raises the
        policy's refusal (Rejected) when its TTFT budget runs out first, as `decide` does."""
        routed = decide(slo, self._room(slo))
        if routed is not None:
            return routed
        assert slo.ttft_s is not None  # only a request with a TTFT SLO is held (_room)
        self.held += 1
        self._metrics.held_requests.inc()
        try:
            budget = min(slo.ttft_s, self.max_wait_s)
            while True:
                left = budget - (self._clock() - arrived)
                may_hold = left > 0 and await self._changed_within(left)
                waited = self._clock() - arrived
                routed = decide(replace(slo, ttft_s=max(0.0, slo.ttft_s - waited)), may_hold)
                if routed is not None:
                    self._metrics.hold_time.labels("admitted").observe(waited)
                    return replace(routed, held_s=waited)
        except asyncio.CancelledError:  # the client went away
            self._metrics.hold_time.labels("cancelled").observe(self._clock() - arrived)
            raise
        except BaseException:
            self._metrics.hold_time.labels("refused").observe(self._clock() - arrived)
            raise
        finally:
            self.held -= 1
            self._metrics.held_requests.dec()

    def _room(self, slo: Slo) -> bool:
        return slo.ttft_s is not None and self.held < self.max_held

    async def _changed_within(self, timeout_s: float) -> bool:
        """True when a stream ended within `timeout_s`, False when the time ran out first."""
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
