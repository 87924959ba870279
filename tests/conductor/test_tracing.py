"""OpenTelemetry: one trace per request, continuing the client's traceparent, with the analysis,
the decision (its predictions as attributes) and each leg as child spans; the workers receive the
request's context as `traceparent`, as vLLM expects it."""

from __future__ import annotations

import httpx
import pytest

from conductor.ops.tracing import Tracing
from tests.support.ci import require_import
from tests.support.cluster import cluster

require_import("opentelemetry.sdk", "the test extra (or the otel extra) installs opentelemetry-sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


@pytest.mark.parametrize("protocol", ["nixl", "mooncake"])
def test_one_trace_tree_per_request_across_gateway_and_workers(protocol: str) -> None:
    tracing, exporter = _tracing()
    with cluster(protocol, tracing=tracing, policy_options={}) as c:
        r = httpx.post(
            c.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
        assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"conductor.request", "conductor.analyse", "conductor.decide", "conductor.prefill_leg", "conductor.decode_leg"} <= set(
        spans
    )
    root = spans["conductor.request"]
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE  # the client's trace continues here
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    for name in ("conductor.analyse", "conductor.decide", "conductor.prefill_leg", "conductor.decode_leg"):
        span = spans[name]
        assert span.context.trace_id == root.context.trace_id
        assert span.parent is not None and span.parent.span_id == root.context.span_id, name
    decide = spans["conductor.decide"].attributes or {}
    assert decide["conductor.prefill"] == "prefill-0" and decide["conductor.decode"] == "decode-0"
    assert spans["conductor.prefill_leg"].attributes["conductor.instance"] == "prefill-0"
    # both legs carried the request's context to the workers
    for worker in (c.prefills[0], c.decodes[0]):
        tp = worker.requests[-1].headers["traceparent"]
        _, trace, parent, _ = tp.split("-")
        assert trace == CLIENT_TRACE and parent == f"{root.context.span_id:016x}"


def test_decision_span_carries_the_prediction() -> None:
    from policies.kvcache_aware import KvCacheAwarePolicy

    tracing, exporter = _tracing()
    with cluster("nixl", tracing=tracing, policy=KvCacheAwarePolicy(admission="none")) as c:
        assert (
            httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 64, "max_tokens": 2}).status_code == 200
        )
    decide = next(s for s in exporter.get_finished_spans() if s.name == "conductor.decide").attributes or {}
    assert decide["conductor.policy"] == "kvcache_aware"
    assert decide["conductor.predicted_ttft_s"] > 0
    assert decide["conductor.candidate.prefill.prefill-0.predicted_ttft_s"] > 0


def test_tracing_off_sends_no_traceparent() -> None:
    with cluster("nixl") as c:
        assert c.gateway.tracing is None
        httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert "traceparent" not in c.prefills[0].requests[-1].headers
