"""Per-instance KV event metrics, read from the subscribers and the feeder at scrape time.

Labels: `instance` (the gateway's instance name) and, for what each subscriber counts, `rank` (the
data-parallel rank: each publishes on its own socket with its own sequence numbers).

Gauges:
- conductor_kv_events_configured{instance}: 1 when a prefill/mixed instance has a KV events endpoint
- conductor_kv_events_last_seq{instance,rank}: last sequence number applied (-1 before any)
- conductor_kv_events_silence_seconds{instance,rank}: since the last batch (since the feed started
  when none came yet)
- conductor_kv_events_delay_seconds{instance,rank}: receive time minus the worker's publish time of
  the last batch (clock skew between the hosts included)

Counters (exported with the `_total` suffix):
- conductor_kv_events_batches{instance,rank}: batches applied, live and replayed
- conductor_kv_events_gaps{instance,rank}: sequence gaps seen on the live feed
- conductor_kv_events_replay_requests{instance,rank}: requests to the replay socket (start-up
  catch-up, gaps, publisher restarts)
- conductor_kv_events_replayed_batches{instance,rank}: batches applied from the replay socket
- conductor_kv_events_resyncs{instance,rank}: times the index forgot the instance
- conductor_kv_events_rejected{instance,rank,reason}: messages dropped unapplied (frames, oversize,
  undecodable, invalid, seq_jump: see adapters/kv_events.py)
- conductor_kv_events_blocks_stored / _blocks_removed{instance}: blocks indexed / removed
- conductor_kv_events_blocks_skipped{instance}: not indexable (multimodal or cache-salt extra keys,
  a LoRA adapter whose path is unknown in "xxhash" key mode, other KV cache group or block size)
- conductor_kv_events_orphan_blocks{instance}: stored under a parent the gateway never saw stored
  (late start, lost events)
- conductor_kv_events_hash_checked / _hash_mismatched{instance}: prompt-start blocks whose vLLM
  hash the gateway recomputed ("vllm" key mode), and those that differed (wrong kv.vllm_hash_seed
  or kv.vllm_hash_algo)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adapters.index.feed import IndexFeeder
from adapters.kv_events import EventSubscriber

_SUB = ("instance", "rank")
_INST = ("instance",)
_REASON = ("instance", "rank", "reason")


class KVEventsCollector(Collector):
    """Prometheus view of every instance's KV event feed."""

    def __init__(self, subscribers: Sequence[EventSubscriber], feeder: IndexFeeder, instances: Sequence[str]) -> None:
        self.subscribers = tuple(subscribers)
        self.feeder = feeder
        self.instances = tuple(instances)  # prefill / mixed instances: those whose caches the index tracks

    def describe(self) -> Iterable[Metric]:
        return self._families(empty=True)

    def collect(self) -> Iterable[Metric]:
        return self._families(empty=False)

    def _families(self, *, empty: bool) -> list[Metric]:
        configured = GaugeMetricFamily(
            "conductor_kv_events_configured", "1 when the instance has a KV events endpoint", labels=_INST
        )
        sub_counters = {
            "batches": CounterMetricFamily(
                "conductor_kv_events_batches", "KV event batches applied, live and replayed", labels=_SUB
            ),
            "gaps": CounterMetricFamily("conductor_kv_events_gaps", "Sequence gaps seen on the live feed", labels=_SUB),
            "replay_requests": CounterMetricFamily(
                "conductor_kv_events_replay_requests", "Requests sent to the replay socket", labels=_SUB
            ),
            "replayed": CounterMetricFamily(
                "conductor_kv_events_replayed_batches", "Batches applied from the replay socket", labels=_SUB
            ),
            "resyncs": CounterMetricFamily(
                "conductor_kv_events_resyncs", "Times the index forgot the instance and refilled from events", labels=_SUB
            ),
        }
        last_seq = GaugeMetricFamily("conductor_kv_events_last_seq", "Last sequence number applied (-1 before any)", labels=_SUB)
        silence = GaugeMetricFamily(
            "conductor_kv_events_silence_seconds",
            "Seconds since the last batch (since the feed started when none came yet)",
            labels=_SUB,
        )
        delay = GaugeMetricFamily(
            "conductor_kv_events_delay_seconds",
            "Receive time minus the worker's publish time of the last batch (clock skew included)",
            labels=_SUB,
        )
        feed_counters = {
            "stored": CounterMetricFamily("conductor_kv_events_blocks_stored", "Blocks indexed from BlockStored", labels=_INST),
            "removed": CounterMetricFamily("conductor_kv_events_blocks_removed", "Blocks removed by BlockRemoved", labels=_INST),
            "skipped": CounterMetricFamily(
                "conductor_kv_events_blocks_skipped",
                "Blocks not indexable (extra keys, an unknown adapter, other group or block size)",
                labels=_INST,
            ),
            "orphans": CounterMetricFamily(
                "conductor_kv_events_orphan_blocks", "Blocks stored under a parent the gateway never saw stored", labels=_INST
            ),
            "hash_checked": CounterMetricFamily(
                "conductor_kv_events_hash_checked", "Prompt-start blocks whose vLLM hash the gateway recomputed", labels=_INST
            ),
            "hash_mismatched": CounterMetricFamily(
                "conductor_kv_events_hash_mismatched", "Recomputed vLLM hashes that differed from the worker's", labels=_INST
            ),
        }
        rejected = CounterMetricFamily(
            "conductor_kv_events_rejected", "KV event messages dropped unapplied, by reason", labels=_REASON
        )
        out: list[Metric] = [configured, *sub_counters.values(), rejected, last_seq, silence, delay, *feed_counters.values()]
        if empty:
            return out
        have = {sub.source.instance for sub in self.subscribers}
        for name in sorted(set(self.instances) | have):
            configured.add_metric([name], 1 if name in have else 0)
            feed = self.feeder.instance(name)
            for attr, family in feed_counters.items():
                family.add_metric([name], getattr(feed, attr))
        now = time.time()
        for sub in self.subscribers:
            st = sub.stats
            labels = [sub.source.instance, str(sub.source.rank)]
            for attr, family in sub_counters.items():
                family.add_metric(labels, getattr(st, attr))
            for reason, count in sorted(st.rejected.items()):
                rejected.add_metric([*labels, reason], count)
            last_seq.add_metric(labels, -1 if st.last_seq is None else st.last_seq)
            since = st.last_received_wall if st.last_received_wall is not None else st.started_wall
            if since is not None:
                silence.add_metric(labels, max(0.0, now - since))
            if st.last_received_wall is not None and st.last_batch_ts is not None:
                delay.add_metric(labels, st.last_received_wall - st.last_batch_ts)
        return out
