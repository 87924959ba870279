"""A client's W3C trace context reaches the workers unchanged when the gateway does not trace
itself (a proxy that takes no part in a trace passes it on), on both legs of a P/D request; a
malformed `traceparent` or `tracestate` is dropped, never forwarded."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from conductor.ops.tracing import forwarded_trace_context
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE,tenant@vendor=x y"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"traceparent": PARENT, "tracestate": STATE}, {"traceparent": PARENT, "tracestate": STATE}),
        ({"traceparent": PARENT, "tracestate": " rojo=1 , ,congo=2"}, {"traceparent": PARENT, "tracestate": "rojo=1,congo=2"}),
        ({"traceparent": PARENT}, {"traceparent": PARENT}),
        ({"tracestate": STATE}, {}),  # a state without a parent is nobody's
        ({"traceparent": PARENT.upper()}, {}),  # upper-case hex is not the grammar
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, {}),  # all-zero trace id
        ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01"}, {}),  # all-zero parent id
        ({"traceparent": "ff" + PARENT[2:]}, {}),  # version ff is forbidden
        ({"traceparent": PARENT + "-extra"}, {}),  # version 00 has exactly four fields
        ({"traceparent": "01" + PARENT[2:] + "-extra"}, {"traceparent": "01" + PARENT[2:] + "-extra"}),  # a later version may add
        ({"traceparent": PARENT[:-1]}, {}),
        ({"traceparent": PARENT, "tracestate": "Rojo=1"}, {"traceparent": PARENT}),  # keys are lower case
        ({"traceparent": PARENT, "tracestate": "rojo=a,b"}, {"traceparent": PARENT}),  # a member without "="
        ({"traceparent": PARENT, "tracestate": "rojo=caf\u00e9"}, {"traceparent": PARENT}),  # printable ASCII only
        ({"traceparent": PARENT, "tracestate": ",".join(f"k{i}=v" for i in range(33))}, {"traceparent": PARENT}),
        ({"traceparent": PARENT, "tracestate": "k=" + "v" * 511}, {"traceparent": PARENT}),  # over 512 characters
    ],
)
def test_trace_context_is_passed_on_only_when_well_formed(headers: dict[str, str], expected: dict[str, str]) -> None:
    assert forwarded_trace_context(headers) == expected


def test_the_client_trace_context_reaches_both_legs_unchanged() -> None:
    prefill, decode = StandIn(role="prefill"), StandIn(role="decode")
    with ExitStack() as stack:
        p, d = stack.enter_context(serve(prefill)), stack.enter_context(serve(decode))
        settings = load_settings(environ={}, overrides={"prefill": [p.url], "decode": [d.url], "model": None})
        gateway = Gateway(settings)
        server = stack.enter_context(serve_gateway(gateway))
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        ok = httpx.post(server.url + "/v1/completions", json=body, headers={"traceparent": PARENT, "tracestate": STATE})
        assert ok.status_code == 200
        legs = prefill.requests + decode.requests
        assert len(legs) == 2
        assert all(r.headers.get("traceparent") == PARENT and r.headers.get("tracestate") == STATE for r in legs)
        bad = httpx.post(server.url + "/v1/completions", json=body, headers={"traceparent": PARENT.upper(), "tracestate": STATE})
        assert bad.status_code == 200
        later = prefill.requests[1:] + decode.requests[1:]
        assert len(later) == 2
        assert all("traceparent" not in r.headers and "tracestate" not in r.headers for r in later)
