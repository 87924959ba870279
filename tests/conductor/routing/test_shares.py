"""The admission rules over the in-flight limit (conductor/routing/shares.py) as pure functions, and
what they promise checked over random arrivals and departures; `Shares` counting each request in and
out exactly once; a request's class (conductor/routing/priority.py); a tenant's keys naming it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conductor.config.keys import ApiKeys
from conductor.config.settings import load_settings
from conductor.core.errors import BadRequest, Overloaded, Rejected, Unauthorized
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.priority import Classifier
from conductor.routing.request_path import InflightLimit
from conductor.routing.shares import WAITING_S, Shares, over_share, shed
from tests.support.prom import metric_sum

CLASSES = {
    "interactive": {"rank": 0},
    "batch": {"rank": 2, "sheddable": True, "share": 0.5},
    "bulk": {"rank": 3, "sheddable": True, "share": 0.25},
}


# ---- shedding -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("share", "inflight", "limit", "refused"),
    [
        (0.5, 0, 4, False),
        (0.5, 1, 4, False),
        (0.5, 2, 4, True),  # at floor(0.5 x 4) = 2 in flight
        (0.5, 3, 4, True),
        (0.5, 2, 5, True),  # floor(2.5) = 2
        (1.0, 3, 4, False),
        (0.1, 0, 4, True),  # floor(0.4) = 0: never admitted
    ],
)
def test_shed_at_the_classs_share_of_the_limit(share: float, inflight: int, limit: int, refused: bool) -> None:
    assert shed(share, inflight, limit) is refused


def test_sheddable_requests_never_hold_more_than_their_share_and_the_urgent_class_keeps_its_room() -> None:
    """The docstring's argument, run: random arrivals of each class and departures, the limit and
    the rule as Shares applies them; at every step the sheddable requests in flight are at most
    floor(share x limit), and a more urgent class is refused only when the rule says so."""
    rng = random.Random(37)
    limit, shares = 20, {"batch": 0.5, "bulk": 0.25}
    caps = {name: int(share * limit) for name, share in shares.items()}
    inflight: list[str] = []
    for _ in range(20_000):
        if inflight and rng.random() < 0.45:
            inflight.pop(rng.randrange(len(inflight)))
            continue
        cls = rng.choice(["interactive", "batch", "bulk"])
        if cls in shares and shed(shares[cls], len(inflight), limit):
            continue
        if len(inflight) < limit:
            inflight.append(cls)
        assert inflight.count("bulk") <= caps["bulk"]
        assert inflight.count("batch") + inflight.count("bulk") <= caps["batch"]
        assert limit - (inflight.count("batch") + inflight.count("bulk")) >= limit - caps["batch"]


# ---- fair share ---------------------------------------------------------------------------------

W2 = {"a": 1.0, "b": 1.0}


@pytest.mark.parametrize(
    ("tenant", "counts", "weights", "waiting", "inflight", "refused"),
    [
        ("a", {"a": 7}, W2, (), 7, False),  # alone: every slot
        ("a", {"a": 1, "b": 1}, W2, (), 2, False),  # within its share of 4 x 1/2
        ("a", {"a": 2, "b": 1}, W2, (), 3, True),  # one more would take b's unused room
        ("a", {"a": 2, "b": 2}, W2, (), 4, True),
        ("a", {"a": 2, "b": 0}, W2, ("b",), 2, True),  # b is waiting: its share is kept
        ("a", {"a": 2, "b": 0}, W2, (), 2, False),  # b neither in flight nor waiting: a is alone
        ("a", {"a": 2, "b": 1}, {"a": 3.0, "b": 1.0}, (), 3, False),  # weight 3 of 4: a share of 3
        ("b", {"a": 3, "b": 1}, {"a": 3.0, "b": 1.0}, (), 4, True),
        # three tenants: shares of 4/3; b and c use theirs as far as whole requests go, a may take the rest
        ("a", {"a": 1, "b": 1, "c": 1}, {"a": 1.0, "b": 1.0, "c": 1.0}, (), 3, False),
        ("a", {"a": 1, "b": 1, "c": 0}, {"a": 1.0, "b": 1.0, "c": 1.0}, ("c",), 2, False),  # c's one slot stays free
        ("a", {"a": 2, "b": 1, "c": 0}, {"a": 1.0, "b": 1.0, "c": 1.0}, ("c",), 3, True),
        ("a", {"a": 0, "b": 3}, {"a": 0.1, "b": 1.0}, (), 3, False),  # a share under one request: one guaranteed
    ],
)
def test_over_share(
    tenant: str, counts: dict[str, int], weights: dict[str, float], waiting: tuple[str, ...], inflight: int, refused: bool
) -> None:
    assert over_share(tenant, counts, weights, waiting, inflight, 4) is refused


def test_a_tenant_within_its_guarantee_always_finds_room_while_the_same_tenants_contend() -> None:
    """The docstring's argument, run: three weighted tenants, each always holding a request (so all
    contend), random arrivals and departures; the free slots never fall below the unused guarantees,
    so a tenant under its guarantee is never turned away by a full limit."""
    rng = random.Random(11)
    limit, weights = 12, {"a": 2.0, "b": 1.0, "c": 1.0}
    guaranteed = {"a": 6, "b": 3, "c": 3}
    counts = dict.fromkeys(weights, 1)
    for _ in range(20_000):
        tenant = rng.choice(["a", "a", "a", "b", "c"])
        if rng.random() < 0.4:
            if counts[tenant] > 1:
                counts[tenant] -= 1
            continue
        total = sum(counts.values())
        unused = sum(max(0, guaranteed[t] - n) for t, n in counts.items())
        assert limit - total >= unused, counts
        if counts[tenant] < guaranteed[tenant]:
            assert total < limit and not over_share(tenant, counts, weights, (), total, limit), counts
        if total < limit and not over_share(tenant, counts, weights, (), total, limit):
            counts[tenant] += 1


# ---- Shares: the rules over the limit, each request counted once ---------------------------------


def _shares(limit: int = 4, clock: Any = None, **settings: Any) -> tuple[Shares, InflightLimit, GatewayMetrics]:
    s = load_settings(environ={}, overrides={"mixed": ["http://m:1"], **settings})
    inflight, metrics = InflightLimit(limit), GatewayMetrics()
    return Shares(s, inflight, metrics, clock=clock or (lambda: 0.0)), inflight, metrics


def _metric(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    from prometheus_client import generate_latest

    return metric_sum(generate_latest(metrics.registry).decode(), name, **labels)


def test_shares_counts_each_tenant_in_and_out_once_and_refuses_without_counting() -> None:
    now = [0.0]
    tenants = {"a": {"api_keys": ["ka"]}, "b": {"api_keys": ["kb"]}}
    shares, inflight, metrics = _shares(clock=lambda: now[0], auth={"tenants": tenants})
    for _ in range(4):
        shares.enter(None, "a")
    assert shares.tenants == {"a": 4, "b": 0} and inflight.count == 4
    with pytest.raises(Overloaded):
        shares.enter(None, "b")  # b waits from now
    with pytest.raises(Overloaded):
        shares.enter(None, None)  # a request of no tenant: the limit only
    shares.leave("a")
    with pytest.raises(Rejected) as refused:
        shares.enter(None, "a")  # b's room
    assert refused.value.reason == "tenant_share" and refused.value.headers()["x-conductor-reject-reason"] == "tenant_share"
    assert shares.tenants == {"a": 3, "b": 0} and inflight.count == 3
    shares.enter(None, "b")
    now[0] = WAITING_S + 1  # b's wait is long over, but it is in flight
    with pytest.raises(Rejected):
        shares.enter(None, "a")
    shares.leave("b")
    shares.enter(None, "a")  # b neither in flight nor waiting: a alone again
    for _ in range(4):
        shares.leave("a")
    assert shares.tenants == {"a": 0, "b": 0} and inflight.count == 0
    assert _metric(metrics, "conductor_tenant_rejections_total", tenant="a", reason="tenant_share") == 2
    assert _metric(metrics, "conductor_tenant_rejections_total", tenant="b", reason="overloaded") == 1
    assert _metric(metrics, "conductor_rejections_total", reason="tenant_share") == 2


def test_shares_sheds_the_least_urgent_class_first() -> None:
    shares, inflight, metrics = _shares(limit=8, priority={"classes": CLASSES, "default": "interactive"})
    shares.enter("bulk", None)
    shares.enter("bulk", None)  # 2 = floor(0.25 x 8) in flight: bulk shed from here
    with pytest.raises(Rejected) as refused:
        shares.enter("bulk", None)
    assert refused.value.reason == "priority_shed" and "'bulk'" in refused.value.message
    shares.enter("batch", None)
    shares.enter("batch", None)  # 4 = floor(0.5 x 8): batch shed from here
    with pytest.raises(Rejected):
        shares.enter("batch", None)
    for _ in range(4):
        shares.enter("interactive", None)  # the urgent class's room
    with pytest.raises(Overloaded):
        shares.enter("interactive", None)
    assert inflight.count == 8
    assert _metric(metrics, "conductor_rejections_total", reason="priority_shed") == 2


def test_without_classes_or_tenants_shares_is_the_limit_alone() -> None:
    shares, inflight, _ = _shares(limit=2)
    shares.enter(None, None)
    shares.enter(None, None)
    with pytest.raises(Overloaded):
        shares.enter(None, None)
    shares.leave(None)
    assert inflight.count == 1 and shares.tenants == {}


# ---- a request's class -----------------------------------------------------------------------------


def _classifier(**priority: Any) -> Classifier:
    tenants = {"t": {"api_keys": ["k"], "priority": "batch" if priority else None}, "u": {"api_keys": ["k2"]}}
    s = load_settings(environ={}, overrides={"mixed": ["http://m:1"], "priority": priority, "auth": {"tenants": tenants}})
    return Classifier(s.priority, {name: t.priority for name, t in s.auth.tenants.items()})


def test_the_class_from_the_header_the_body_the_tenant_or_the_default() -> None:
    c = _classifier(classes=CLASSES, default="interactive", header="X-Class")
    assert c.header == "x-class" and c.read_headers(frozenset({b"a"})) == {b"a", b"x-class"}
    body: dict[str, Any] = {"priority": "bulk"}
    assert c.classify(" batch ", body, "t") == "batch" and body == {}  # the header wins; the string goes
    body = {"priority": "bulk"}
    assert c.classify(None, body, "t") == "bulk" and body == {}
    body = {"priority": -3}
    assert c.classify(None, body, "t") == "batch" and body == {"priority": -3}  # vLLM's integer stays
    assert c.classify(None, {}, "u") == "interactive"  # a tenant with no class of its own
    assert c.classify(None, {}, None) == "interactive"
    for header, body in (("gold", {}), (None, {"priority": "Batch"})):
        with pytest.raises(BadRequest, match="the classes are: interactive, batch, bulk") as err:
            c.classify(header, body, None)
        assert err.value.code == "invalid_priority"


def test_no_classes_no_class() -> None:
    c = _classifier()
    body: dict[str, Any] = {"priority": "batch"}
    assert not c.enabled and c.classify("batch", body, "t") is None and body == {"priority": "batch"}
    assert c.read_headers(frozenset({b"a"})) == {b"a"}


# ---- a tenant's keys ------------------------------------------------------------------------------


def test_a_key_names_its_tenant_and_a_plain_key_none() -> None:
    keys = ApiKeys(["sk-plain", "sk-a1"], owners={"sk-a1": "a", "sk-a2": "a", "sk-b": "b"})
    assert len(keys) == 4
    assert [keys.check(f"Bearer {k}") for k in ("sk-plain", "sk-a1", "sk-a2", "sk-b")] == [None, "a", "a", "b"]
    with pytest.raises(Unauthorized, match="invalid API key"):
        keys.check("Bearer sk-c")
    assert ApiKeys([]).check(None) is None
