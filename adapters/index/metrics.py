"""Prometheus view of the KV index's in-process memory and of its guard around a shared Redis.

Read at scrape time from the structures' own counters, so inserts and look-ups pay nothing for it.

- conductor_kv_memory_entries{structure, instance}: entries held; structure "index" (the in-process
  index, or the local copy beside a Redis index; instance "") or "hash_map" (the vLLM hash -> own
  key pairs of one instance);
- conductor_kv_memory_bytes{structure, instance}: entries x the measured per-entry cost (an upper
  figure; see ENTRY_BYTES in memory.py and MAPPED_ENTRY_BYTES in feed.py);
- conductor_kv_memory_cap_entries{structure, instance}: what the byte budget allows;
- conductor_kv_memory_evictions_total{structure, instance}: entries dropped to stay within it;
- conductor_kv_index_fallback_lookups_total, conductor_kv_index_missed_writes_total,
  conductor_kv_index_reseeds_total: with a Redis index, look-ups answered locally, writes Redis did
  not take, and instances re-seeded into Redis after it came back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adapters.index.base import MemoryUse
from adapters.index.guarded import GuardedIndex

_LABELS = ("structure", "instance")


class KVMemoryCollector(Collector):
    """Entries, estimated bytes, caps and evictions of the index and of each instance's hash map."""

    def __init__(self, index_memory: Callable[[], MemoryUse | None], map_memory: Callable[[], Mapping[str, MemoryUse]]) -> None:
        self._index_memory = index_memory
        self._map_memory = map_memory

    def _families(self, rows: list[tuple[str, str, MemoryUse]]) -> list[Metric]:
        entries = GaugeMetricFamily("conductor_kv_memory_entries", "Entries held by an in-process KV structure", labels=_LABELS)
        used = GaugeMetricFamily(
            "conductor_kv_memory_bytes",
            "Estimated bytes of an in-process KV structure (entries x measured cost per entry)",
            labels=_LABELS,
        )
        cap = GaugeMetricFamily("conductor_kv_memory_cap_entries", "Entries the structure's byte budget allows", labels=_LABELS)
        evictions = CounterMetricFamily(
            "conductor_kv_memory_evictions", "Entries dropped to stay within the byte budget", labels=_LABELS
        )
        for structure, instance, use in rows:
            labels = [structure, instance]
            entries.add_metric(labels, use.entries)
            used.add_metric(labels, use.estimated_bytes)
            cap.add_metric(labels, use.cap)
            evictions.add_metric(labels, use.evictions)
        return [entries, used, cap, evictions]

    def describe(self) -> Iterable[Metric]:
        return self._families([])

    def collect(self) -> Iterable[Metric]:
        rows: list[tuple[str, str, MemoryUse]] = []
        index = self._index_memory()
        if index is not None:
            rows.append(("index", "", index))
        rows.extend(("hash_map", name, use) for name, use in self._map_memory().items())
        return self._families(rows)


class GuardCollector(Collector):
    """What a Redis index's guard did instead of, or after, calling Redis."""

    def __init__(self, index: GuardedIndex) -> None:
        self.index = index

    def _families(self, index: GuardedIndex | None) -> list[Metric]:
        rows = (
            (
                "conductor_kv_index_fallback_lookups",
                "KV index look-ups answered without Redis (breaker open or "
                "Redis failing): from the local copy, or as nothing cached",
                "fallback_lookups",
            ),
            ("conductor_kv_index_missed_writes", "KV index writes Redis did not take (failed or not attempted)", "missed_writes"),
            ("conductor_kv_index_reseeds", "Instances re-seeded into Redis from the local copy after missed writes", "reseeds"),
        )
        return [CounterMetricFamily(name, doc, value=0 if index is None else getattr(index, attr)) for name, doc, attr in rows]

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self.index)


def register_kv_memory(
    registry: CollectorRegistry, index_memory: Callable[[], MemoryUse | None], map_memory: Callable[[], Mapping[str, MemoryUse]]
) -> None:
    registry.register(KVMemoryCollector(index_memory, map_memory))


def register_guard(registry: CollectorRegistry, index: GuardedIndex) -> None:
    registry.register(GuardCollector(index))
