"""Calls to a shared service (Redis) that may hang or vanish: short timeouts and a circuit breaker.

Why both: a Redis that is stopped (SIGSTOP, a stalled VM, a black-holing network) does not refuse
connections; the kernel still accepts them and replies never come, so every call costs its whole
timeout. redis-py's defaults (5 s, then up to 10 retries with back-off) would hold each request for
seconds. Short timeouts bring one failed call down to tens of milliseconds; the breaker brings the
calls after it down to microseconds: after `failures_to_open` consecutive failures it opens and,
for `open_s`, answers "not attempted" at once so the caller uses its fallback. Then it lets one
trial call through (half-open): success closes it, failure opens it for another `open_s`. Nothing
is retried here: the breaker is the retry policy, so a Redis that comes back is used again within
`open_s`, with no restart.

Counters live on the breaker itself (read by tests and by `BreakerCollector` at scrape time), so
the hot path pays no metric updates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    import redis.asyncio as aioredis

T = TypeVar("T")
F = TypeVar("F")


class BreakerState(IntEnum):
    """As exported on the state gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True, slots=True)
class BreakerStats:
    """What a breaker has seen since it was made.

    attempts: calls let through to the service. short_circuits: calls answered by the fallback
    without being attempted. failures: attempts that raised or timed out. opens: closed/half-open
    to open transitions. slowest_failure_s: the longest a failed attempt took (its cost to the
    caller), measured by the breaker around the call.
    """

    state: BreakerState
    attempts: int
    successes: int
    failures: int
    short_circuits: int
    opens: int
    consecutive_failures: int
    slowest_failure_s: float
    last_error: str | None


class CircuitBreaker:
    """Consecutive-failure breaker for one asyncio loop (no locks: nothing here awaits)."""

    def __init__(
        self,
        name: str,
        *,
        failures_to_open: int = 3,
        open_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        if failures_to_open <= 0 or open_s <= 0:
            raise ValueError("failures_to_open and open_s must be positive")
        self.name = name
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self._clock = clock
        self._log = logger or logging.getLogger(f"conductor.breaker.{name}")
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._trial = False  # half-open: the one trial call is in flight
        self._consecutive = 0
        self._attempts = self._successes = self._failures = self._short = self._opens = 0
        self._short_at_open = 0  # short circuits before this outage began (for the recovery message)
        self._slowest_failure = 0.0
        self._last_error: str | None = None

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def stats(self) -> BreakerStats:
        return BreakerStats(
            self._state,
            self._attempts,
            self._successes,
            self._failures,
            self._short,
            self._opens,
            self._consecutive,
            self._slowest_failure,
            self._last_error,
        )

    def allow(self) -> bool:
        """May a call go out now? False is counted as a short circuit."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.open_s:
            self._state = BreakerState.HALF_OPEN
        if self._state is BreakerState.HALF_OPEN and not self._trial:
            self._trial = True
            return True
        self._short += 1
        return False

    def success(self) -> None:
        self._successes += 1
        self._consecutive = 0
        self._trial = False
        if self._state is not BreakerState.CLOSED:
            self._state = BreakerState.CLOSED
            self._log.warning(
                "%s: reachable again, calls resumed (%d were skipped while it was down)",
                self.name,
                self._short - self._short_at_open,
            )

    def failure(self, error: BaseException | str, elapsed_s: float = 0.0) -> None:
        self._failures += 1
        self._consecutive += 1
        self._trial = False
        self._slowest_failure = max(self._slowest_failure, elapsed_s)
        self._last_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
        if self._state is BreakerState.HALF_OPEN or (
            self._state is BreakerState.CLOSED and self._consecutive >= self.failures_to_open
        ):
            reopening = self._state is BreakerState.HALF_OPEN
            if not reopening:
                self._short_at_open = self._short
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._opens += 1
            # the first opening is news; each failed trial after it would only flood the log
            self._log.log(
                logging.DEBUG if reopening else logging.WARNING,
                "%s: %d failures in a row (last %s): not called for %.1fs at a time, using the fallback",
                self.name,
                self._consecutive,
                self._last_error,
                self.open_s,
            )

    def abandon(self) -> None:
        """The caller was cancelled mid-call: no verdict, but free the half-open trial slot."""
        self._trial = False

    async def call(self, op: Callable[[], Awaitable[T]], fallback: Callable[[], F], *, timeout_s: float) -> T | F:
        """`op()` under `timeout_s` if the breaker allows it, else (or when it fails) `fallback()`.

        Any exception from `op` counts as a failure: whatever it is, the service did not do the job,
        and the caller has a fallback for exactly that case (the error is kept in `stats`).
        """
        if not self.allow():
            return fallback()
        self._attempts += 1
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                result = await op()
        except Exception as exc:  # noqa: BLE001  # see the docstring: every failure means "use the fallback"
            self.failure(exc, time.perf_counter() - started)
            return fallback()
        except BaseException:  # cancelled by our caller: not the service's fault
            self.abandon()
            raise
        self.success()
        return result


class BreakerCollector(Collector):
    """Prometheus view of one breaker, read at scrape time: conductor_<name>_breaker_*."""

    def __init__(self, breaker: CircuitBreaker, metric_prefix: str) -> None:
        self.breaker = breaker
        self.prefix = metric_prefix

    def _families(self, s: BreakerStats | None) -> list[Metric]:
        p = self.prefix
        fams: list[tuple[Any, str, str, float]] = [
            (
                GaugeMetricFamily,
                f"{p}_breaker_state",
                "Circuit breaker state: 0 closed, 1 half-open, 2 open",
                0 if s is None else int(s.state),
            ),
            (CounterMetricFamily, f"{p}_breaker_failures", "Calls that failed or timed out", 0 if s is None else s.failures),
            (
                CounterMetricFamily,
                f"{p}_breaker_short_circuits",
                "Calls not attempted because the breaker was open (answered by the fallback)",
                0 if s is None else s.short_circuits,
            ),
            (CounterMetricFamily, f"{p}_breaker_opens", "Times the breaker opened", 0 if s is None else s.opens),
        ]
        return [cls(name, doc, value=value) for cls, name, doc, value in fams]

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self.breaker.stats)


def register_breaker(breaker: CircuitBreaker, registry: CollectorRegistry | None, metric_prefix: str) -> None:
    """Export `breaker` on `registry` (nothing when None)."""
    if registry is not None:
        registry.register(BreakerCollector(breaker, metric_prefix))


def fail_fast_redis(url: str, *, timeout_s: float, connect_timeout_s: float | None = None) -> aioredis.Redis:
    """An asyncio Redis client whose every call gives up after about `timeout_s`, with no retries.

    redis-py would otherwise retry a failed call up to 10 times with back-off; the breaker above the
    client decides when to try again instead.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s or timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )
