"""vLLM's Prometheus metrics, same names, types and labels (`model_name`, `engine`), per app.

Each emulator owns its CollectorRegistry, so several emulators in one test process never share
counters. Bucket boundaries are vLLM's (vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One finished request's phases, in seconds (already time-scaled: what a client would see)."""

    queue_s: float  # arrival to scheduled
    prefill_s: float  # scheduled to first token
    decode_s: float  # first token to last token
    e2e_s: float  # arrival to last token
    ttft_s: float  # arrival to first token


class EngineMetrics:
    """The metric families an emulated vLLM engine exports."""

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (model_name, engine)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            (*labels, "source"),
            registry=r,
        )
        self.tokens_local_compute = by_source.labels(*values, "local_compute")
        self.tokens_cache_hit = by_source.labels(*values, "local_cache_hit")
        self.tokens_external = by_source.labels(*values, "external_kv_transfer")
        # emulator-only: bidirectional NIXL readbacks that found no KV (recomputed instead)
        self.kv_load_failures = counter(
            "emulator:kv_load_failures", "KV loads from a remote engine that failed and were recomputed."
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.success_length = self._success.labels(*values, "length")
        self.success_abort = self._success.labels(*values, "abort")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)

    def prompt(self, total: int, local_hit: int, external: int) -> None:
        """A request's prompt was accounted: where its tokens came from."""
        computed = max(total - local_hit - external, 0)
        self.prefix_queries.inc(total)
        self.prefix_hits.inc(local_hit)
        self.prompt_tokens.inc(total)
        self.tokens_local_compute.inc(computed)
        self.tokens_cache_hit.inc(local_hit)
        self.tokens_external.inc(external)

    def finished(self, times: RequestTimes) -> None:
        self.success_length.inc()
        self.queue_time.observe(times.queue_s)
        self.prefill_time.observe(times.prefill_s)
        self.decode_time.observe(times.decode_s)
        self.e2e.observe(times.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
