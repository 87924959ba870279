"""A real OTLP/HTTP trace receiver (protobuf `POST /v1/traces`, the collector's wire format), kept
in memory so a test can read back every span the gateway and the workers exported."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tests.support.asgi import lifespan, whole_body


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        request = ExportTraceServiceRequest.FromString(await whole_body(receive))
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attrs = {a.key: _value(a.value) for a in span.attributes}
                        self.spans.append(
                            ReceivedSpan(
                                service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), attrs
                            )
                        )
        payload = ExportTraceServiceResponse().SerializeToString()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-protobuf")]})
        await send({"type": "http.response.body", "body": payload})


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
