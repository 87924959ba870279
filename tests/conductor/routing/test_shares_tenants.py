"""Shedding by tenant (conductor/routing/shares.py, `shed_for_tenant`): a tenant flooding the gateway
does not shed the sheddable requests of a tenant that keeps within its share; the pure rule, and
`Shares` applying it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conductor.config.settings import load_settings
from conductor.core.errors import Rejected
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.request_path import InflightLimit
from conductor.routing.shares import Shares, over_share, shed, shed_for_tenant

W2 = {"a": 1.0, "b": 1.0}


@pytest.mark.parametrize(
    ("tenant", "counts", "waiting", "inflight", "refused"),
    [
        ("a", {"a": 0, "b": 3}, (), 3, False),  # under floor(0.5 x 8) = 4 in flight: the gateway-wide rule admits
        ("a", {"a": 4}, (), 4, True),  # alone: its guarantee is the limit, the gateway-wide rule
        ("a", {"a": 1, "b": 7}, (), 8, False),  # b floods; a holds 1 < floor(0.5 x 4), half its guarantee
        ("a", {"a": 2, "b": 6}, (), 8, True),  # a at half its guarantee
        ("b", {"a": 1, "b": 7}, (), 8, True),  # the flooding tenant is shed
        ("a", {"a": 1, "b": 0}, ("b",), 4, False),  # b refused by the full limit lately: it contends
        ("a", {"a": 4, "b": 0}, (), 4, True),  # b neither in flight nor waiting: a alone
    ],
)
def test_shed_for_tenant(tenant: str, counts: dict[str, int], waiting: tuple[str, ...], inflight: int, refused: bool) -> None:
    assert shed_for_tenant(0.5, tenant, counts, W2, waiting, inflight, 8) is refused


def test_each_tenant_keeps_room_for_its_urgent_requests_within_its_guarantee() -> None:
    """Random arrivals of both classes from two tenants, the rules as Shares applies them: past the
    gateway-wide cap a tenant's sheddable requests never take it beyond half its guarantee, so its
    urgent requests always find the other half; all sheddable requests stay under 2 x the cap."""
    rng = random.Random(37)
    limit, share = 16, 0.5
    held: dict[str, list[str]] = {"a": [], "b": []}
    for _ in range(20_000):
        tenant = rng.choice("aab")
        mine = held[tenant]
        if mine and rng.random() < 0.45:
            mine.pop(rng.randrange(len(mine)))
            continue
        counts = {t: len(v) for t, v in held.items()}
        inflight = sum(counts.values())
        cls = rng.choice(["interactive", "batch"])
        if cls == "batch" and shed_for_tenant(share, tenant, counts, W2, (), inflight, limit):
            continue
        if inflight < limit and not over_share(tenant, counts, W2, (), inflight, limit):
            if cls == "batch" and shed(share, inflight, limit) and counts["a"] and counts["b"]:
                assert counts[tenant] + 1 <= share * limit / 2  # admitted past the cap: within its part
            mine.append(cls)
        assert sum(v.count("batch") for v in held.values()) <= 2 * int(share * limit)


def _shares(**settings: Any) -> tuple[Shares, InflightLimit]:
    s = load_settings(environ={}, overrides={"mixed": ["http://m:1"], **settings})
    inflight = InflightLimit(8)
    return Shares(s, inflight, GatewayMetrics(), clock=lambda: 0.0), inflight


def test_a_flooding_tenant_does_not_shed_another_tenants_batch_within_its_share() -> None:
    classes = {"interactive": {"rank": 0}, "batch": {"rank": 1, "sheddable": True, "share": 0.5}}
    tenants = {"a": {"api_keys": ["ka"]}, "b": {"api_keys": ["kb"]}}
    shares, inflight = _shares(priority={"classes": classes, "default": "interactive"}, auth={"tenants": tenants})
    shares.enter("interactive", "a")
    for _ in range(4):
        shares.enter("interactive", "b")  # b's guarantee of 4; 5 in flight, over floor(0.5 x 8)
    with pytest.raises(Rejected) as refused:
        shares.enter("batch", "b")
    assert refused.value.reason == "priority_shed" and "tenant 'b' holds 4" in refused.value.message
    shares.enter("batch", "a")  # a holds 1 of the 2 its half guarantee allows: admitted
    with pytest.raises(Rejected) as refused:
        shares.enter("batch", "a")
    assert refused.value.reason == "priority_shed"
    shares.enter("interactive", "a")  # the other half of a's guarantee stays for its urgent requests
    assert shares.tenants == {"a": 3, "b": 4} and inflight.count == 7
