"""One trace tree per request across the gateway and the workers, as an OTLP collector receives it:
the gateway's spans and each emulated worker's `llm_request` span (made as vLLM makes it from the
`traceparent` the gateway sends) share the trace, each worker's span a child of the gateway's
leg span that called it (the prefill leg, the decode leg)."""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from tests.support.ci import require_import
from tests.support.emulator import start_emulator
from tests.support.otlp import OtlpReceiver
from tests.support.servers import serve, serve_gateway
from tests.support.waiting import wait_for

# the gateway imports the exporter only when tracing is on: check here that this run can
require_import("opentelemetry.exporter.otlp.proto.http", "the test extra installs opentelemetry-exporter-otlp-proto-http")


def test_trace_tree_spans_gateway_and_workers() -> None:
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        endpoint = collector.url + "/v1/traces"
        env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export the workers' spans within 0.1 s
        with ExitStack() as stack:
            p = stack.enter_context(
                start_emulator("prefill", "nixl", time_scale=0.01, model="tiny", env=env, otlp_traces_endpoint=endpoint)
            )
            d = stack.enter_context(
                start_emulator("decode", "nixl", time_scale=0.01, model="tiny", env=env, otlp_traces_endpoint=endpoint)
            )
            settings = load_settings(
                environ={},
                overrides={"prefill": [p.url], "decode": [d.url], "tracing": {"otlp_endpoint": endpoint, "service_name": "gw"}},
            )
            gateway = Gateway(settings)
            with serve_gateway(gateway) as gw:  # closing it flushes the gateway's spans
                r = httpx.post(
                    gw.url + "/v1/completions",
                    timeout=30,
                    json={"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": True},
                )
                assert r.status_code == 200
            assert wait_for(lambda: sum(s.name == "llm_request" for s in receiver.spans) == 2, timeout=15)
    spans = receiver.spans
    [root] = [s for s in spans if s.name == "conductor.request"]
    assert root.service == "gw" and root.parent_span_id == ""  # the client sent no traceparent
    tree = [s for s in spans if s.trace_id == root.trace_id]
    names = {s.name for s in tree}
    assert {"conductor.analyse", "conductor.decide", "conductor.prefill_leg", "conductor.decode_leg"} <= names
    workers = {s.service: s for s in tree if s.name == "llm_request"}
    assert set(workers) == {"vllm-emulator-prefill", "vllm-emulator-decode"}
    legs = {s.name: s for s in tree if s.name.endswith("_leg")}
    assert all(leg.parent_span_id == root.span_id for leg in legs.values())
    # each worker's span is a child of the gateway's leg that called it
    assert workers["vllm-emulator-prefill"].parent_span_id == legs["conductor.prefill_leg"].span_id
    assert workers["vllm-emulator-decode"].parent_span_id == legs["conductor.decode_leg"].span_id
    assert len({s.trace_id for s in spans}) == 1  # one request, one trace
