"""What the status page (`GET /status`, `GET /admin/status`: conductor/server/status_route.py) and
`conductor status` show of the gateway's recent past, kept by the Router as it decides and learns:

- `DecisionRing`: the last N decisions, as the `conductor.decisions` log writes them (sizes and
  predictions, never prompt text), each candidate's predictions with it. Decisions are kept as they
  are and written out only when someone reads the page: the request path pays an append, not a
  record per request.
- `WindowedCounts`: decisions, rejections by reason, and SLO attainment (TTFT and mean TBT met or
  missed, of streamed requests, the ones a client sees a first token and gaps of; failures) over
  the last minutes, in fixed time buckets: a bounded window whatever the
  traffic, read as the sum of the buckets still inside it.

Both are bounded by construction (a deque with a maxlen; a fixed number of buckets), so a gateway
up for weeks keeps the same few kilobytes.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conductor.core.decision_log import decision_log_record
from conductor.core.fast_init import fast_init
from conductor.core.types import Decision, Observation, Slo

DECISIONS_KEPT = 50  # the ring's size: what a page shows without scrolling for ever
BUCKET_S = 10.0  # the window's resolution
WINDOW_S = 300.0  # the window: the last five minutes


@fast_init
@dataclass(frozen=True, slots=True)
class _Kept:
    at: float  # time.time() of the decision: the page shows wall time
    seq: int  # the ring's own running number: a page knows which decisions it has already shown
    decision: Decision
    prompt_tokens: int


class DecisionRing:
    """The last `capacity` decisions, oldest first."""

    def __init__(self, capacity: int = DECISIONS_KEPT, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError("a decision ring keeps at least one decision")
        self._kept: deque[_Kept] = deque(maxlen=capacity)
        self._clock = clock
        self._seq = 0

    @property
    def capacity(self) -> int:
        assert self._kept.maxlen is not None
        return self._kept.maxlen

    def add(self, decision: Decision, prompt_tokens: int) -> None:
        self._seq += 1
        self._kept.append(_Kept(self._clock(), self._seq, decision, prompt_tokens))

    def records(self) -> list[dict[str, Any]]:
        """The kept decisions, newest first, each the decision log's record plus when and its number."""
        return [
            {"seq": k.seq, "at": round(k.at, 3), **decision_log_record(k.decision, k.prompt_tokens)} for k in reversed(self._kept)
        ]


@dataclass(slots=True)
class _Bucket:
    start: float
    decisions: int = 0
    rejections: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # ttft_met, ttft_missed, tbt_met, tbt_missed, failed


class WindowedCounts:
    """Counts over the last `window_s` seconds, in buckets of `bucket_s`."""

    def __init__(
        self, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if bucket_s <= 0 or window_s < bucket_s:
            raise ValueError("the window must hold at least one bucket of a positive length")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque(maxlen=int(window_s // bucket_s))
        self._clock = clock
        self._open_from = self._open_until = 0.0  # the newest bucket's time span (none yet)

    def _current(self) -> _Bucket:
        now = self._clock()
        if self._open_from <= now < self._open_until:  # the usual case: still the newest bucket's time
            return self._buckets[-1]
        start = now // self.bucket_s * self.bucket_s
        if not self._buckets or self._buckets[-1].start != start:
            self._buckets.append(_Bucket(start))  # the oldest falls out of the deque
        self._open_from, self._open_until = start, start + self.bucket_s
        return self._buckets[-1]

    def decided(self, decision: Decision) -> None:
        bucket = self._current()
        bucket.decisions += 1
        if decision.rejection is not None:
            bucket.rejections[decision.rejection.reason] += 1

    def observed(self, observation: Observation, slo: Slo) -> None:
        """A finished request against its SLOs: TTFT as the client saw it, TBT as the mean gap."""
        outcomes = self._current().outcomes
        if not observation.ok:
            outcomes["failed"] += 1
            return
        if observation.ttft_s is not None and slo.ttft_s is not None:  # no SLO: nothing to attain
            outcomes["ttft_met" if observation.ttft_s <= slo.ttft_s else "ttft_missed"] += 1
        gaps = observation.token_intervals_s
        if gaps and slo.tbt_s is not None:
            outcomes["tbt_met" if sum(gaps) / len(gaps) <= slo.tbt_s else "tbt_missed"] += 1

    def summary(self) -> dict[str, Any]:
        """The window's sums: decisions, rejections by reason, outcomes and the attainment they give."""
        horizon = self._clock() - self.window_s
        decisions = 0
        rejections: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        for bucket in self._buckets:
            if bucket.start + self.bucket_s <= horizon:
                continue  # wholly older than the window
            decisions += bucket.decisions
            rejections.update(bucket.rejections)
            outcomes.update(bucket.outcomes)
        return {
            "window_s": self.window_s,
            "decisions": decisions,
            "rejections": dict(sorted(rejections.items())),
            "outcomes": {k: outcomes[k] for k in ("ttft_met", "ttft_missed", "tbt_met", "tbt_missed", "failed")},
            "ttft_attainment": _share(outcomes["ttft_met"], outcomes["ttft_missed"]),
            "tbt_attainment": _share(outcomes["tbt_met"], outcomes["tbt_missed"]),
        }


def _share(met: int, missed: int) -> float | None:
    return None if met + missed == 0 else round(met / (met + missed), 4)


class GatewayStatus:
    """The Router's recent past, for the status page: its decisions and its window of counts."""

    def __init__(self, ring: DecisionRing | None = None, window: WindowedCounts | None = None) -> None:
        self.ring = ring or DecisionRing()
        self.window = window or WindowedCounts()

    def decided(self, decision: Decision, prompt_tokens: int) -> None:
        self.ring.add(decision, prompt_tokens)
        self.window.decided(decision)

    def observed(self, observation: Observation, slo: Slo) -> None:
        self.window.observed(observation, slo)
