"""The lock-free metrics expose exactly what prometheus_client's own Counter and Histogram would
after the same updates (one registry of each, the text format compared line by line, creation
timestamps aside), and refuse what those refuse."""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from conductor.ops.loop_metrics import LoopCounter, LoopHistogram
from conductor.ops.metrics import GatewayMetrics

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)
_CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$")


def exposition(registry: CollectorRegistry) -> list[str]:
    """The registry's text format, with each `_created` timestamp replaced by a marker."""
    lines = generate_latest(registry).decode().splitlines()
    return sorted(_CREATED.sub(r"\1 T", line) for line in lines)


def test_same_exposition_as_prometheus_client_after_the_same_updates() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    pairs = [
        (
            LoopCounter("t_requests", "requests", ["route", "status"], registry=ours),
            Counter("t_requests", "requests", ["route", "status"], registry=theirs),
        ),
        (LoopCounter("t_plain", "no labels", registry=ours), Counter("t_plain", "no labels", registry=theirs)),
    ]
    hists = [
        (
            LoopHistogram("t_latency", "latency", buckets=BUCKETS, registry=ours),
            Histogram("t_latency", "latency", buckets=BUCKETS, registry=theirs),
        ),
        (
            LoopHistogram("t_leg", "by instance", ["instance"], buckets=BUCKETS, registry=ours),
            Histogram("t_leg", "by instance", ["instance"], buckets=BUCKETS, registry=theirs),
        ),
    ]
    rng = random.Random(7)
    for _ in range(2000):
        route, status = rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice(["200", "429", "502"])
        amount = rng.choice([1.0, 3.0, 0.5])
        pairs[0][0].labels(route, status).inc(amount)
        pairs[0][1].labels(route, status).inc(amount)
        pairs[1][0].inc()
        pairs[1][1].inc()
        # on the bounds themselves too: a bucket counts what is <= its bound
        x = rng.choice([*BUCKETS, 0.0, 3.0, rng.random(), rng.expovariate(20.0)])
        hists[0][0].observe(x)
        hists[0][1].observe(x)
        inst = rng.choice(["prefill-0", "prefill-1"])
        hists[1][0].labels(inst).observe(x)
        hists[1][1].labels(inst).observe(x)
    assert exposition(ours) == exposition(theirs)
    assert any(line.startswith('t_latency_bucket{le="0.005"}') for line in exposition(ours))


def test_label_values_are_made_strings_once() -> None:
    registry = CollectorRegistry()
    c = LoopCounter("t_status", "by status", ["status"], registry=registry)
    c.labels(200).inc()  # type: ignore[arg-type]
    c.labels("200").inc()
    assert registry.get_sample_value("t_status_total", {"status": "200"}) == 2.0


def test_refuses_what_prometheus_client_refuses() -> None:
    registry = CollectorRegistry()
    c = LoopCounter("t_c", "c", ["a"], registry=registry)
    with pytest.raises(ValueError):
        c.labels("x", "y")
    with pytest.raises(ValueError):
        c.labels("x").inc(-1)
    with pytest.raises(ValueError):
        c.inc()  # labelled: a child must be named
    with pytest.raises(ValueError):
        LoopHistogram("t_h", "h", buckets=(1.0, 0.5), registry=registry)
    with pytest.raises(ValueError):  # the name is taken on this registry
        LoopCounter("t_c", "again", registry=registry)


def test_gateway_metrics_keep_their_names() -> None:
    """Dashboards and alerts query these names: the switch of implementation must not move them."""
    m = GatewayMetrics()
    m.requests.labels("/v1/completions", "200").inc()
    m.e2e.observe(0.2)
    m.prefill_leg.labels("prefill-0").observe(0.04)
    sample = m.registry.get_sample_value
    assert sample("conductor_requests_total", {"route": "/v1/completions", "status": "200"}) == 1.0
    assert sample("conductor_request_seconds_count") == 1.0
    assert sample("conductor_request_seconds_bucket", {"le": "0.25"}) == 1.0
    assert sample("conductor_request_seconds_bucket", {"le": "0.1"}) == 0.0
    assert sample("conductor_prefill_leg_seconds_sum", {"instance": "prefill-0"}) == pytest.approx(0.04)


def test_remove_by_labels_drops_the_series_prometheus_client_drops() -> None:
    """An instance that leaves takes its series with it (conductor.fleet.membership)."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a = LoopCounter("t_err", "errors", ["instance", "kind"], registry=ours)
    b = Counter("t_err", "errors", ["instance", "kind"], registry=theirs)
    ha = LoopHistogram("t_leg", "legs", ["instance"], buckets=BUCKETS, registry=ours)
    hb = Histogram("t_leg", "legs", ["instance"], buckets=BUCKETS, registry=theirs)
    for inst in ("p0", "p1"):
        for kind in ("status", "transport"):
            a.labels(inst, kind).inc()
            b.labels(inst, kind).inc()
        ha.labels(inst).observe(0.02)
        hb.labels(inst).observe(0.02)
    for m in (a, b, ha, hb):
        m.remove_by_labels({"instance": "p0"})
    assert exposition(ours) == exposition(theirs)
    assert not any('instance="p0"' in line for line in exposition(ours))
    assert any('instance="p1"' in line for line in exposition(ours))
    with pytest.raises(ValueError):
        a.remove_by_labels({"model": "x"})
