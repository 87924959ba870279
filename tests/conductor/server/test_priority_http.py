"""Priority classes and tenants through the HTTP path (real sockets, stand-in workers): where a
request's class comes from, a class's SLO in admission, a sheddable class shed first as the in-flight
limit fills, a flooding tenant held to its fair share while another tenant's requests get through, a
lone tenant using everything, and how each refusal says why. Without `priority` and tenants the
gateway behaves as before (the last tests)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from conductor.core.types import ClusterSnapshot, Decision, RequestView, Role
from policies.base import BasePolicy
from policies.registry import load_policy
from tests.support.cluster import Cluster, cluster
from tests.support.prom import scrape
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

PRIORITY = {
    "classes": {
        "interactive": {"slo": {"ttft_s": 1.0, "tbt_s": 0.05}, "rank": 0},
        "batch": {"slo": {"ttft_s": 30.0}, "rank": 2, "sheddable": True},
    },
    "default": "interactive",
}
TENANTS = {
    "team-a": {"api_keys": ["sk-a"]},
    "team-b": {"api_keys": ["sk-b"], "priority": "batch"},
}
AUTH = {"api_keys": ["sk-plain"], "tenants": TENANTS}


class _Recording(BasePolicy):
    """Sends every request to the one mixed worker and keeps what it was shown."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[RequestView] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.seen.append(request)
        return Decision(request.request_id, self.name, prefill=cluster.by_role(Role.MIXED)[0].id)


@contextmanager
def _mixed(policy: Any = None, hold: threading.Event | None = None, **settings: Any) -> Iterator[Cluster]:
    """One stand-in mixed worker (answering only once `hold` is set, when given) behind a gateway."""
    standin = {"mixed": {"answer_after": hold}} if hold is not None else None
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, policy=policy, standin=standin, **settings) as c:
        yield c


def _post(url: str, key: str | None = None, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": "tiny", "prompt": "hello there", "max_tokens": 2, **body}
    return httpx.post(url + "/v1/completions", json=payload, headers={**sent, **(headers or {})}, timeout=60)


def _decisions(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "conductor.decisions"]


def test_a_requests_class_comes_from_the_header_the_body_the_keys_tenant_or_the_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="conductor.decisions")
    policy = _Recording()
    with _mixed(policy, priority=PRIORITY, auth=AUTH) as c:
        cases = [
            ("sk-plain", {"x-priority": "batch"}, {}, "batch", None),
            ("sk-plain", {}, {"priority": "batch"}, "batch", None),
            ("sk-plain", {}, {"priority": 5}, "interactive", None),  # vLLM's integer: no class, the default one
            ("sk-b", {}, {}, "batch", "team-b"),  # the tenant's default class
            ("sk-b", {"x-priority": "interactive"}, {}, "interactive", "team-b"),  # the header first
            ("sk-b", {}, {"priority": "interactive"}, "interactive", "team-b"),  # then the body
            ("sk-a", {}, {}, "interactive", "team-a"),  # a tenant without a class of its own: priority.default
            ("sk-plain", {}, {}, "interactive", None),
        ]
        for key, headers, body, _, _ in cases:
            r = _post(c.url, key, headers, **body)
            assert r.status_code == 200, r.text
    got = [(view.priority, view.tenant) for view in policy.seen]
    assert got == [(cls, tenant) for *_, cls, tenant in cases]
    # each class's SLO, over the gateway-wide one (none here) field by field
    assert (policy.seen[0].slo.ttft_s, policy.seen[0].slo.tbt_s) == (30.0, None)
    assert (policy.seen[2].slo.ttft_s, policy.seen[2].slo.tbt_s) == (1.0, 0.05)
    # a string `priority` is the gateway's and is not forwarded; nor is a client's integer (vLLM's):
    # the gateway alone sets it, for workers that schedule by priority (test_engine_priority.py)
    bodies = c.mixed[0].bodies()
    assert "priority" not in bodies[1] and "priority" not in bodies[2]
    logged = [(line.get("priority"), line.get("tenant")) for line in _decisions(caplog)]
    assert logged == got


def test_an_unknown_class_is_a_400_naming_the_classes() -> None:
    with _mixed(priority=PRIORITY) as c:
        for headers, body, where in (({"x-priority": "urgent"}, {}, "x-priority"), ({}, {"priority": "gold"}, "priority")):
            r = _post(c.url, None, headers, **body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_priority" and err["param"] == where
            assert "interactive, batch" in err["message"]  # most urgent first
        assert not c.mixed[0].requests


def test_a_classs_slo_is_what_admission_holds_its_requests_to() -> None:
    # (a less urgent class is judged by the tighter of its SLO and half the urgent one, policies/classes.py:
    # here its own is the tighter)
    classes = {
        "interactive": {"slo": {"ttft_s": 60.0}},
        "batch": {"slo": {"ttft_s": 0.0001}, "rank": 1, "sheddable": True},  # no prefill of 1,000 tokens meets it
    }
    priority = {"classes": classes, "default": "interactive"}
    kv = {"enabled": False, "tokenizer": "builtin"}
    with _mixed(load_policy("kvcache_aware"), priority=priority, slo={"ttft_s": 60.0}, kv=kv) as c:
        long = {"prompt": "x" * 4000, "max_tokens": 4}
        rejected = _post(c.url, None, {"x-priority": "batch"}, **long)
        assert rejected.status_code == 429, rejected.text
        assert rejected.json()["error"]["code"] == "ttft_slo" and rejected.headers["x-conductor-reject-reason"] == "ttft_slo"
        assert _post(c.url, **long).status_code == 200
        # the per-request header still overrides the class's SLO
        assert _post(c.url, None, {"x-priority": "batch", "x-slo-ttft-ms": "60000"}, **long).status_code == 200
        assert len(c.mixed[0].requests) == 2
        assert scrape(c.url, "conductor_priority_requests_total", **{"class": "batch", "status": "429"}) == 1
        assert scrape(c.url, "conductor_priority_requests_total", **{"class": "interactive", "status": "200"}) == 1


class _Held:
    """Requests sent from threads to a gateway whose worker holds every answer until released."""

    def __init__(self, c: Cluster, hold: threading.Event) -> None:
        self.c, self.hold = c, hold
        self.pool = ThreadPoolExecutor(16)
        self.held: list[Future[httpx.Response]] = []

    def admit(self, key: str | None = None, headers: dict[str, str] | None = None) -> None:
        """Send one that must be admitted: it is in flight at the gateway before this returns."""
        before = self.c.gateway.inflight.count
        self.held.append(self.pool.submit(_post, self.c.url, key, headers))
        assert wait_for(lambda: self.c.gateway.inflight.count == before + 1), "not admitted"

    def release(self) -> list[int]:
        self.hold.set()
        statuses = [f.result(timeout=60).status_code for f in self.held]
        self.pool.shutdown()
        return statuses


def _refusal(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.headers["retry-after"] == "1" and r.headers["x-conductor-reject-reason"] == code
    if status == 429:
        assert r.json()["error"]["type"] == "rate_limit_error"


def test_a_sheddable_class_is_shed_first_as_the_in_flight_limit_fills() -> None:
    hold = threading.Event()
    # limit 4, batch admitted only while fewer than floor(0.5 x 4) = 2 requests are in flight
    with _mixed(hold=hold, priority={**PRIORITY, "sheddable_share": 0.5}, limits={"max_inflight_requests": 4}) as c:
        held = _Held(c, hold)
        try:
            held.admit(headers={"x-priority": "batch"})  # 1 in flight: batch still admitted
            held.admit()  # interactive
            shed = _post(c.url, None, {"x-priority": "batch"})
            _refusal(shed, 429, "priority_shed")
            assert "batch" in shed.json()["error"]["message"]
            held.admit()  # the room batch may not take is the urgent class's
            held.admit()
            _refusal(_post(c.url), 503, "overloaded")  # the limit itself
        finally:
            statuses = held.release()
        assert statuses == [200] * 4
        assert scrape(c.url, "conductor_rejections_total", reason="priority_shed") == 1
        assert scrape(c.url, "conductor_priority_requests_total", **{"class": "batch", "status": "429"}) == 1
        assert c.gateway.inflight.count == 0


def test_a_flooding_tenant_is_held_to_its_share_while_the_others_requests_get_through() -> None:
    hold = threading.Event()
    tenants = {"team-a": {"api_keys": ["sk-a"]}, "team-b": {"api_keys": ["sk-b"]}}
    with _mixed(hold=hold, auth={"tenants": tenants, "public_metrics": True}, limits={"max_inflight_requests": 4}) as c:
        held = _Held(c, hold)
        try:
            held.admit("sk-b")  # team-b is active: team-a's share is 4 x 1/2
            held.admit("sk-a")
            held.admit("sk-a")
            for _ in range(3):  # the flood: team-a's third and later wait for its own to finish
                flood = _post(c.url, "sk-a")
                _refusal(flood, 429, "tenant_share")
                assert "team-a" in flood.json()["error"]["message"]
            held.admit("sk-b")  # team-b still finds its room
            assert c.gateway.request_path.shares.tenants == {"team-a": 2, "team-b": 2}
        finally:
            statuses = held.release()
        assert statuses == [200] * 4
        assert c.gateway.request_path.shares.tenants == {"team-a": 0, "team-b": 0}  # each left exactly once
        assert scrape(c.url, "conductor_tenant_rejections_total", tenant="team-a", reason="tenant_share") == 3
        assert scrape(c.url, "conductor_tenant_rejections_total", tenant="team-b") == 0


def test_a_lone_tenant_may_use_everything_until_another_waits() -> None:
    hold = threading.Event()
    tenants = {"team-a": {"api_keys": ["sk-a"], "weight": 3}, "team-b": {"api_keys": ["sk-b"]}}
    with _mixed(hold=hold, auth={"tenants": tenants, "public_metrics": True}, limits={"max_inflight_requests": 4}) as c:
        held = _Held(c, hold)
        try:
            for _ in range(4):
                held.admit("sk-a")  # alone: the whole limit
            _refusal(_post(c.url, "sk-a"), 503, "overloaded")
            # team-b finds the limit full: it waits, and team-a (over its 3/4 now) may not take its room back
            _refusal(_post(c.url, "sk-b"), 503, "overloaded")
            _refusal(_post(c.url, "sk-a"), 429, "tenant_share")
        finally:
            statuses = held.release()
        assert statuses == [200] * 4
        assert scrape(c.url, "conductor_tenant_rejections_total", tenant="team-b", reason="overloaded") == 1
        assert _post(c.url, "sk-b").status_code == 200 and _post(c.url, "sk-a").status_code == 200


def test_without_priority_and_tenants_requests_are_as_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conductor.decisions")
    policy = _Recording()
    with _mixed(policy, auth={"api_keys": ["sk-plain"], "public_metrics": True}) as c:
        # the class header means nothing; a client's `priority`, string or vLLM's integer, is not
        # passed on (priority.trust_client_engine_priority would pass the integer: test_engine_priority.py)
        assert _post(c.url, "sk-plain", {"x-priority": "nonsense"}, priority="batch").status_code == 200
        assert _post(c.url, "sk-plain", priority=3).status_code == 200
        assert [b.get("priority") for b in c.mixed[0].bodies()] == [None, None]
        assert [(v.priority, v.tenant) for v in policy.seen] == [(None, None), (None, None)]
        assert all("priority" not in line and "tenant" not in line for line in _decisions(caplog))
        assert "conductor_priority_requests_total{" not in httpx.get(c.url + "/metrics", timeout=30).text
