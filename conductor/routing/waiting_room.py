"""Requests held at the gateway while the streams cannot take them, within their TTFT budget.

A request refused for its TBT (`tbt_slo`: on a mixed worker its prefill would pause the streams
decoding there past the TBT SLO, or the decode batch it would join is too large) is refused for
the load of this moment: the streams are short, and as they end the same request fits. Its TTFT
SLO usually leaves room to wait for that (on the tool-agent trace over 4 mixed workers no admitted
request missed its TTFT while 5-12% were refused for their TBT: docs/kvcache_aware.md, "Mixed
workers"). So instead of a 429 the request waits here, and is decided again as streams end
(`freed`: the longest waiting first, WAKE_PER_END of them per end), with its TTFT SLO less the
time it has waited: the policy's own TTFT admission ends the wait when too little is left, and
the request is refused as before. A 429 for its TTFT, a class shed or a tenant over its share is
sent at once: waiting cannot cure it (the queue drains no faster than the budget runs out).

Bounded: at most `hold.max_held` requests wait at once (past it, the refusal is sent at once), none
longer than its TTFT SLO or `hold.max_wait_s`, none refused for a TBT it would miss on an idle
instance too (not `retryable`: waiting cannot cure that), and a client that goes away takes its
request out (its task is cancelled). Nothing is remembered, logged or counted for a decision that
holds a request (Router.decide with `may_hold`): the decision that finally admits or refuses it is
the one logged. Only this process's streams wake its held requests: with `--workers N` a sibling's
streams ending do not, and its held requests are decided again at their own streams' ends or
their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from conductor.config.groups import HoldSettings
from conductor.core.types import Slo
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.router import Routed
from policies.admission import WAKE_PER_END, slo_after_wait

# the decision with this SLO; True: a refusal the streams' ending may cure returns None instead
Decide = Callable[[Slo, bool], Routed | None]


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class WaitingRoom:
    """The requests held (see the module docstring); `freed` is told when a stream ends."""

    __slots__ = ("_clock", "_metrics", "_waiters", "held", "max_held", "max_wait_s")

    def __init__(self, settings: HoldSettings, metrics: GatewayMetrics, clock: Callable[[], float] | None = None) -> None:
        self.max_held = settings.max_held if settings.enabled else 0
        self.max_wait_s = settings.max_wait_s
        self._metrics = metrics
        self._clock = clock or _loop_time  # the event loop's
        # one future per held request waiting for a stream's end, the longest waiting first
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.held = 0

    def freed(self) -> None:
        """A stream ended (a request's load left the registry): the WAKE_PER_END held requests that
        have waited longest since they were last decided are decided again."""
        waiters, woken = self._waiters, 0
        while waiters and woken < WAKE_PER_END:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1

    async def admit(self, decide: Decide, slo: Slo) -> Routed:
        """The request's decision, after holding it while the streams cannot take it; raises the
        policy's refusal (Rejected) when its TTFT budget runs out first, as `decide` does."""
        routed = decide(slo, self._room(slo))
        if routed is not None:
            return routed
        assert slo.ttft_s is not None  # only a request with a TTFT SLO is held (_room)
        self.held += 1
        self._metrics.held_requests.inc()
        start = self._clock()
        try:
            budget = min(slo.ttft_s, self.max_wait_s)
            while True:
                left = budget - (self._clock() - start)
                may_hold = left > 0 and await self._freed_within(left)
                waited = self._clock() - start
                routed = decide(slo_after_wait(slo, waited), may_hold)
                if routed is not None:
                    self._metrics.hold_time.labels("admitted").observe(waited)
                    return replace(routed, held_s=waited)
        except asyncio.CancelledError:  # the client went away
            self._metrics.hold_time.labels("cancelled").observe(self._clock() - start)
            raise
        except BaseException:
            self._metrics.hold_time.labels("refused").observe(self._clock() - start)
            raise
        finally:
            self.held -= 1
            self._metrics.held_requests.dec()

    def _room(self, slo: Slo) -> bool:
        return slo.ttft_s is not None and self.held < self.max_held

    async def _freed_within(self, timeout_s: float) -> bool:
        """True when `freed` woke this request within `timeout_s`, False when the time ran out first."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return False
        finally:
            if waiter.cancelled():  # timed out, or the request cancelled: not woken, so still queued
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        return True
