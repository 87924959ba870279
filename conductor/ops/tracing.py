"""OpenTelemetry tracing of the request path, off unless `tracing.otlp_endpoint` is set.

One span per request (`conductor.request`, SERVER kind) whose parent is the client's
`traceparent` when it sends one, with children for the prompt analysis (tokenize, block keys,
index look-up), the decision (the prediction and every candidate's score as attributes) and the
legs (`conductor.prefill_leg`, `conductor.decode_leg`; `conductor.leg` where one worker serves it
all), each started as its request is sent. Every leg's request carries that leg's own context as
`traceparent`, as vLLM expects it (vLLM started with `--otlp-traces-endpoint` makes its span a
child of it), so one trace tree spans the gateway and the engines, each engine's span under the
leg that called it.

The request span carries the HTTP semantic conventions' attributes (`http.request.method`,
`url.path`, `http.route`, `server.address`/`server.port`, `http.response.status_code`) and the
GenAI ones (`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.request.max_tokens`,
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`), plus `conductor.ttft_s` (arrival to
the first token sent, on a streamed answer). Its status is ERROR on a 429 (the gateway turned it
away) or a 5xx; a leg's is ERROR when the attempt it served failed.

opentelemetry is an optional extra (`pip install '.[otel]'` from a checkout), imported only when
tracing is on; with it off the request path pays one `is None` test per stage, and the client's own
trace context (`traceparent`, `tracestate`) is passed to the workers unchanged, as a proxy that does
not take part in a trace must (W3C Trace Context), once checked against the header's grammar
(`forwarded_trace_context`): a malformed one is dropped, never forwarded.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from conductor.core.types import Decision

# attribute values OpenTelemetry accepts; None values are left out
Attrs = Mapping[str, str | int | float | bool | None]

# gen_ai.operation.name of each OpenAI route kind (OpenTelemetry GenAI semantic conventions)
# the span of a request path step with tracing off: one reusable no-op context (a nullcontext
# made per request and step cost ~1 us each on the hot path, profiled)
NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
OPERATIONS = {"completions": "text_completion", "chat": "chat", "embeddings": "embeddings", "responses": "chat"}

# W3C Trace Context (level 1, and the future-version rule of section 3.2.4): version, trace id,
# parent id, flags, lower-case hex; a later version may append fields after a dash
_TRACEPARENT_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]{0,200})?")
# one tracestate list member: a simple or multi-tenant key, then a value of printable ASCII without
# "," and "=" whose last character is not a space (section 3.3.1)
_TRACESTATE_MEMBER_RE = re.compile(
    r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
TRACESTATE_MAX_MEMBERS = 32
TRACESTATE_MAX_CHARS = 512  # what the spec asks a proxy to pass on at least; more is dropped, not cut


def forwarded_trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's `traceparent` and `tracestate` (`headers` keyed by lower-case name) to send on to
    the workers, when the gateway does not trace itself: only a well-formed `traceparent` (version
    not ff, ids not all zero; version 00 with nothing after the flags), and its `tracestate` only
    when every list member is well-formed, at most 32 of them and 512 characters. Anything else
    is left out: a worker never receives a header the client made up."""
    parent = headers.get("traceparent")
    if parent is None:
        return {}
    match = _TRACEPARENT_RE.fullmatch(parent)
    if match is None:
        return {}
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or parent_id == "0" * 16:
        return {}
    out = {"traceparent": parent}
    state = headers.get("tracestate")
    if state is not None and len(state) <= TRACESTATE_MAX_CHARS:
        members = [m.strip(" \t") for m in state.split(",")]
        members = [m for m in members if m]  # empty members are allowed, and dropped
        if 0 < len(members) <= TRACESTATE_MAX_MEMBERS and all(_TRACESTATE_MEMBER_RE.fullmatch(m) for m in members):
            out["tracestate"] = ",".join(members)
    return out


class Tracing:
    """The gateway's tracer. Build with `from_settings`; `provider` lets tests pass an SDK
    TracerProvider with an in-memory exporter."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("conductor")
        self.propagator = TraceContextTextMapPropagator()
        self.api = trace  # the opentelemetry.trace module, imported only with tracing on
        self._context = context

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
    def request(
        self,
        headers: Mapping[str, str],
        path: str,
        request_id: str,
        *,
        operation: str | None = None,
        server: tuple[str, int] | None = None,
    ) -> Iterator[Any]:
        """The request's span, a child of the client's `traceparent` if it sent one. `server`:
        the address and port the client reached (the ASGI scope's, when the server tells).
        Its status is set by `request_ended`, not by an exception passing through."""
        parent = self.propagator.extract(carrier=dict(headers))
        attributes = {
            "http.request.method": "POST",
            "url.path": path,
            "http.route": path,
            "server.address": server[0] if server else None,
            "server.port": server[1] if server else None,
            "gen_ai.operation.name": operation,
            "conductor.request_id": request_id,
        }
        with self.tracer.start_as_current_span(
            "conductor.request",
            context=parent,
            kind=self.api.SpanKind.SERVER,
            attributes=_clean(attributes),
            set_status_on_exception=False,
        ) as span:
            yield span

    def request_ended(self, span: Any, status: int) -> None:
        """The request's HTTP status on its span: ERROR for a 429 (turned away: the operator's
        signal that the fleet is short) and any 5xx; other 4xx are the client's (semantic conventions)."""
        span.set_attribute("http.response.status_code", status)
        if status == 429 or status >= 500:
            span.set_attribute("error.type", str(status))
            span.set_status(self.api.Status(self.api.StatusCode.ERROR, f"HTTP {status}"))

    def annotate(self, attrs: Attrs) -> None:
        """Attributes on the current span (in the request path: the request's span)."""
        self.api.get_current_span().set_attributes(_clean(attrs))

    @contextmanager
    def child(self, name: str, attrs: Attrs | None = None) -> Iterator[Any]:
        with self.tracer.start_as_current_span(name, attributes=_clean(attrs)) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """`traceparent` (and `tracestate`) of the current span into a worker request's headers."""
        self.propagator.inject(headers)

    def legs(self, instances: Mapping[str, str], one_leg: bool) -> LegSpans:
        """The spans of one attempt's legs, children of the current span (see LegSpans)."""
        return LegSpans(self, self._context.get_current(), instances, one_leg)


class LegSpans:
    """The legs of one attempt as CLIENT spans, each started the moment its request is sent
    (`headers`, which the P/D protocol asks for as it sends a leg: adapters/pd/base.py,
    `Outgoing.headers_for`) and ended with the attempt (`end`). The headers carry the leg's own
    context, so the worker's span hangs under the leg that called it."""

    def __init__(self, tracing: Tracing, parent: Any, instances: Mapping[str, str], one_leg: bool) -> None:
        self._tracing = tracing
        self._parent = parent  # the request span's context
        self._instances = instances  # leg ("prefill", "decode") -> the instance it goes to
        self._one_leg = one_leg  # one worker serves it all (mixed, or a decode that prefills)
        self.started: list[tuple[str, Any, int]] = []  # (leg, span, start ns)

    def headers(self, leg: str) -> dict[str, str]:
        """`leg` ("prefill", "decode") is being sent: its span starts now; the headers that carry it."""
        trace = self._tracing.api
        start = time.time_ns()
        name = "conductor.leg" if self._one_leg else f"conductor.{leg}_leg"
        span = self._tracing.tracer.start_span(
            name,
            context=self._parent,
            kind=trace.SpanKind.CLIENT,
            start_time=start,
            attributes=_clean({"conductor.instance": self._instances.get(leg), "conductor.leg": leg}),
        )
        self.started.append((leg, span, start))
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=trace.set_span_in_context(span, self._parent))
        return carrier

    def end(self, ok: bool, prefill_s: float | None = None) -> None:
        """End every leg started: now, but a prefill leg whose time to its answer was measured
        (`prefill_s`: one exchange's) when it answered."""
        trace = self._tracing.api
        now = time.time_ns()
        for leg, span, start in self.started:
            end = now
            if leg == "prefill" and prefill_s is not None:
                end = min(now, start + int(prefill_s * 1e9))
                span.set_attribute("conductor.prefill_s", prefill_s)
            span.set_attribute("conductor.ok", ok)
            if not ok:
                span.set_status(trace.Status(trace.StatusCode.ERROR, "the attempt failed"))
            span.end(end_time=max(end, start))
        self.started.clear()


def request_attributes(body: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """What a request span says of the body once it is read and checked: the GenAI request attributes."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    return _clean(
        {
            "gen_ai.request.model": body.get("model") if isinstance(body.get("model"), str) else None,
            "gen_ai.request.max_tokens": max_tokens if type(max_tokens) is int else None,
            "conductor.stream": bool(body.get("stream", False)),
        }
    )


def usage_attributes(input_tokens: int | None, output_tokens: int | None, ttft_s: float | None) -> Attrs:
    """What a request span says of its answer: tokens in and out, and the TTFT of a stream."""
    return {"gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens, "conductor.ttft_s": ttft_s}


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


def _clean(attrs: Attrs | None) -> dict[str, str | int | float | bool]:
    return {k: v for k, v in (attrs or {}).items() if v is not None}
