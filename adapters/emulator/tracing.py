"""The emulated worker's OpenTelemetry spans, made the way vLLM makes them when started with
`--otlp-traces-endpoint`: one `llm_request` span per request, a child of the `traceparent` the
request carries (the gateway's), exported over OTLP/HTTP. opentelemetry is optional and imported
only when an endpoint is given."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any


class EmulatorTracing:
    def __init__(self, endpoint: str, service_name: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("vllm.llm_engine")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER

    @contextmanager
    def request(self, headers: Mapping[str, str], request_id: str, model: str) -> Iterator[Any]:
        parent = self.propagator.extract(carrier={k.lower(): v for k, v in headers.items()})
        with self.tracer.start_as_current_span(
            "llm_request",
            context=parent,
            kind=self.kind,
            attributes={
                "gen_ai.request.id": request_id,
                "gen_ai.response.model": model,
            },
        ) as span:
            yield span

    def shutdown(self) -> None:
        self.provider.shutdown()


def request_span(tracing: EmulatorTracing | None, headers: Mapping[str, str], request_id: str, model: str) -> Any:
    """The request's span, or a no-op context when tracing is off."""
    return nullcontext() if tracing is None else tracing.request(headers, request_id, model)
