"""OpenTelemetry tracing of the request path, off unless `tracing.otlp_endpoint` is set.

One span per request (`conductor.request`, SERVER kind) whose parent is the client's
`traceparent` when it sends one, with children for the prompt analysis (tokenize, block keys,
index look-up), the decision (the prediction and every candidate's score as attributes) and the
prefill and decode legs. The request's context goes to the workers as `traceparent`, as vLLM
expects it (vLLM started with `--otlp-traces-endpoint` makes its own span a child of it), so one
trace tree spans the gateway and the engines.

opentelemetry is an optional extra (`pip install 'conductor-scheduler[otel]'`), imported only when
tracing is on; with it off the request path pays one `is None` test per stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from conductor.core.types import Decision

# attribute values OpenTelemetry accepts; None values are left out
Attrs = Mapping[str, str | int | float | bool | None]


class Tracing:
    """The gateway's tracer. Build with `from_settings`; `provider` lets tests pass an SDK
    TracerProvider with an in-memory exporter."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("conductor")
        self.propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._client = SpanKind.CLIENT

    @classmethod
    def from_settings(cls, endpoint: str | None, sample_ratio: float, service_name: str) -> Tracing | None:
        if not endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), sampler=ParentBasedTraceIdRatio(sample_ratio)
        )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def shutdown(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if callable(shutdown):
            shutdown()

    @contextmanager
    def request(self, headers: Mapping[str, str], path: str, request_id: str) -> Iterator[Any]:
        """The request's span, a child of the client's `traceparent` if it sent one."""
        parent = self.propagator.extract(carrier=dict(headers))
        with self.tracer.start_as_current_span(
            "conductor.request",
            context=parent,
            kind=self._server,
            attributes={"http.route": path, "conductor.request_id": request_id},
        ) as span:
            yield span

    @contextmanager
    def child(self, name: str, attrs: Attrs | None = None) -> Iterator[Any]:
        with self.tracer.start_as_current_span(name, attributes=_clean(attrs)) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """`traceparent` (and `tracestate`) of the current span into a worker request's headers."""
        self.propagator.inject(headers)

    def leg(self, name: str, instance: str, start_ns: int, end_ns: int, attrs: Attrs | None = None) -> None:
        """A leg measured after the fact (the P/D exchange runs both legs inside one call)."""
        span = self.tracer.start_span(
            name, kind=self._client, start_time=start_ns, attributes=_clean({"conductor.instance": instance, **(attrs or {})})
        )
        span.end(end_time=max(end_ns, start_ns))


def decision_attributes(decision: Decision, prompt_tokens: int) -> dict[str, str | int | float | bool]:
    """What a decision span carries: the choice, the prediction, each candidate's score."""
    attrs: dict[str, str | int | float | bool | None] = {
        "conductor.policy": decision.policy,
        "conductor.prompt_tokens": prompt_tokens,
        "conductor.prefill": decision.prefill,
        "conductor.decode": decision.decode,
        "conductor.rejected": decision.rejected,
        "conductor.rejection": decision.rejection.reason if decision.rejection else None,
        "conductor.predicted_ttft_s": decision.predicted_ttft_s,
        "conductor.predicted_tbt_s": decision.predicted_tbt_s,
        "conductor.pull_from": decision.pull_from,
        "conductor.pull_tokens": decision.pull_tokens,
    }
    for c in decision.candidates:
        prefix = f"conductor.candidate.{c.role.value}.{c.instance_id}"
        attrs[f"{prefix}.score"] = c.score
        attrs[f"{prefix}.predicted_ttft_s"] = c.predicted_ttft_s
        attrs[f"{prefix}.predicted_tbt_s"] = c.predicted_tbt_s
    return _clean(attrs)


def now_ns() -> int:
    return time.time_ns()


def _clean(attrs: Attrs | None) -> dict[str, str | int | float | bool]:
    return {k: v for k, v in (attrs or {}).items() if v is not None}
