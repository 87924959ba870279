"""OpenTelemetry: one trace per request, continuing the client's traceparent, with the analysis,
the decision (its predictions as attributes) and each leg as child spans; each worker receives its
leg's context as `traceparent`, as vLLM expects it, so its span hangs under that leg. The request
span carries the HTTP and GenAI semantic conventions' attributes, and is an ERROR on a 429 or 5xx."""

from __future__ import annotations

import httpx
import pytest

from conductor.ops.tracing import Tracing
from tests.support.ci import require_import
from tests.support.cluster import cluster
from tests.support.standin import StandIn

require_import("opentelemetry.sdk", "the test extra (or the otel extra) installs opentelemetry-sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _spans(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def _parent_in(worker: StandIn) -> tuple[str, str]:
    """(trace id, parent span id) of the traceparent the worker's last request carried."""
    _, trace, parent, _ = worker.requests[-1].headers["traceparent"].split("-")
    return trace, parent


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
    spans = _spans(exporter)
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
    assert spans["conductor.decode_leg"].attributes["conductor.instance"] == "decode-0"
    # each worker's span hangs under the leg that called it, not under the request
    for worker, leg in ((c.prefills[0], "conductor.prefill_leg"), (c.decodes[0], "conductor.decode_leg")):
        assert _parent_in(worker) == (CLIENT_TRACE, f"{spans[leg].context.span_id:016x}"), leg


def test_a_mixed_worker_hangs_under_its_one_leg() -> None:
    tracing, exporter = _tracing()
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, tracing=tracing, policy_options={}) as c:
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True})
        assert r.status_code == 200
    spans = _spans(exporter)
    leg, root = spans["conductor.leg"], spans["conductor.request"]
    assert leg.parent is not None and leg.parent.span_id == root.context.span_id
    assert leg.attributes["conductor.instance"] == "mixed-0" and leg.attributes["conductor.ok"] is True
    assert _parent_in(c.mixed[0]) == (f"{root.context.trace_id:032x}", f"{leg.context.span_id:016x}")


@pytest.mark.parametrize("stream", [False, True])
def test_request_span_carries_http_and_genai_attributes(stream: bool) -> None:
    tracing, exporter = _tracing()
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with cluster("nixl", tracing=tracing, policy_options={}) as c:
        r = httpx.post(c.url + "/v1/completions", json=body)
        assert r.status_code == 200
        port = c.servers["gateway"].port
    root = _spans(exporter)["conductor.request"]
    attrs = root.attributes or {}
    assert attrs["http.request.method"] == "POST"
    assert attrs["url.path"] == attrs["http.route"] == "/v1/completions"
    assert attrs["http.response.status_code"] == 200
    assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] == port
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny" and attrs["gen_ai.request.max_tokens"] == 4
    # the stand-in decode reports the prompt's 5 ids and 4 completion tokens in its usage
    assert attrs["gen_ai.usage.input_tokens"] == 5 and attrs["gen_ai.usage.output_tokens"] == 4
    assert ("conductor.ttft_s" in attrs) is stream  # the first token of a stream, measured at the gateway
    assert root.status.status_code is StatusCode.UNSET


def test_chat_is_a_chat_operation() -> None:
    tracing, exporter = _tracing()
    with cluster("nixl", tracing=tracing, policy_options={}) as c:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}
        assert httpx.post(c.url + "/v1/chat/completions", json=body).status_code == 200
    attrs = _spans(exporter)["conductor.request"].attributes or {}
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["url.path"] == "/v1/chat/completions"
    assert attrs["gen_ai.request.max_tokens"] == 2 and attrs["gen_ai.usage.output_tokens"] == 2


def test_a_rejection_and_a_worker_failure_are_errors_a_bad_request_is_not() -> None:
    from policies.kvcache_aware import KvCacheAwarePolicy

    tracing, exporter = _tracing()
    with cluster("nixl", tracing=tracing, policy=KvCacheAwarePolicy(), standin={"decode": {"fail_status": 500}}) as c:
        tiny_slo = {"x-slo-ttft-ms": "0.001"}
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=tiny_slo).status_code == 429
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 502
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny"}).status_code == 400
    roots = [s for s in exporter.get_finished_spans() if s.name == "conductor.request"]
    by_status = {(s.attributes or {})["http.response.status_code"]: s for s in roots}
    assert set(by_status) == {429, 502, 400}
    assert by_status[429].status.status_code is StatusCode.ERROR
    assert by_status[502].status.status_code is StatusCode.ERROR
    assert (by_status[502].attributes or {})["error.type"] == "502"
    assert by_status[400].status.status_code is StatusCode.UNSET  # the client's fault, not the service's
    decode_leg = _spans(exporter)["conductor.decode_leg"]
    assert decode_leg.status.status_code is StatusCode.ERROR and decode_leg.attributes["conductor.ok"] is False


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
