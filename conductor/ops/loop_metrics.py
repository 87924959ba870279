"""Counters and histograms for metrics updated on the request path, without a lock per sample.

prometheus_client guards every value with a lock, because any thread may update it: `labels()`
takes one to find the child, `inc()` another, `Histogram.observe()` two (the sum and the bucket).
On this gateway every per-request update happens on the event loop's thread and `/metrics` is
served by an `async` route on the same loop, so those locks buy nothing and cost ~3 us per update
(profiled: 9-28 us of a request's CPU). These classes keep plain numbers, keyed by the label values
already seen, and hand them to the registry as ordinary metric families when it is scraped: the
exposition (names, help, types, `_total`, `_created`, buckets, `_sum`, `_count`) is the one
prometheus_client's own classes produce.

Only for code that runs on one thread. A collector may still be read from another thread (a
synchronous caller of `generate_latest`): it copies the children before reading them, which the
GIL makes safe, at the worst one observation apart between a histogram's sum and its buckets.
Memory: one child per distinct label tuple, as in prometheus_client; the label values used here are
routes, statuses, reasons and instance names, all bounded by the configuration.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterChild:
    """One label tuple's count."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramChild:
    """One label tuple's observations: a count per bucket (not cumulative) and their sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every finite bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # the first bound >= amount: Prometheus buckets are "less than or equal"
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


C = TypeVar("C", CounterChild, HistogramChild)


class LoopMetric(Collector, Generic[C]):
    """What the counter and the histogram share: a name, help, label names, children by label
    tuple; without label names the metric's own child counts (`_own`)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), registry: CollectorRegistry | None = None
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        self._own: C | None = self._child(()) if not self.labelnames else None
        if registry is not None:  # last: registering collects once, to check the names
            registry.register(self)

    def _child(self, values: tuple[str, ...]) -> C:
        """The child of these label values (made strings, as prometheus_client does), made on first use."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _new_child(self) -> C:
        raise NotImplementedError

    def labels(self, *values: str) -> C:
        return self._children.get(values) or self._child(values)

    def _unlabelled(self) -> C:
        if self._own is None:
            raise ValueError(f"{self.name} has labels: use labels(...) first")
        return self._own

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        """Drop every child whose labels include these (an instance that left: its series go);
        ValueError when this metric has no such label name, as prometheus_client does."""
        unknown = set(labels) - set(self.labelnames)
        if unknown:
            raise ValueError(f"{self.name} has no label {sorted(unknown)}")
        at = [(self.labelnames.index(k), v) for k, v in labels.items()]
        for values in [v for v in self._children if all(v[i] == want for i, want in at)]:
            del self._children[values]

    def _items(self) -> list[tuple[tuple[str, ...], C]]:
        return list(self._children.items())  # a copy: the loop may add a child while a thread reads

    def describe(self) -> Iterable[Metric]:
        return self.collect()


class LoopCounter(LoopMetric[CounterChild]):
    """A Counter for one thread. `labels(*values)` returns the child to `inc()`; without label
    names the counter itself counts."""

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            family.add_metric(list(values), child.value, created=child.created)
        return [family]


class LoopHistogram(LoopMetric[HistogramChild]):
    """A Histogram for one thread, with fixed finite bucket bounds (+Inf is implied)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError("buckets must be increasing")
        self._bounds = bounds  # before the base makes the first child
        self._labels = (*(floatToGoString(b) for b in bounds), "+Inf")
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        self._unlabelled().observe(amount)

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            counts, total, cumulative = list(child.counts), child.sum, 0
            buckets = []
            for label, count in zip(self._labels, counts, strict=True):
                cumulative += count
                buckets.append((label, float(cumulative)))
            family.add_metric(list(values), buckets, total)
            family.add_sample(self.name + "_created", dict(zip(self.labelnames, values, strict=True)), child.created)
        return [family]
