"""A request's class priority reaches the workers that schedule by priority, and only those, over real
HTTP through a real gateway to emulated vLLM workers (conductor/routing/priority.py
`Classifier.engine_priority`, adapters/pd/base.py `leg_body`).

The emulators follow vLLM's documented rule: an engine started without `--scheduling-policy
priority` answers 400 "Priority scheduling is not enabled" to a non-zero `priority`. So a request
that reaches an "fcfs" worker with one fails, and each worker's request log shows what it was sent.
The real engine's side (vLLM serving the urgent class first) is tests/e2e_vllm/test_priority.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.core.types import ClusterSnapshot, Decision, RequestView
from conductor.gateway import Gateway
from policies.base import BasePolicy
from tests.support.emulator import Emulator, start_emulator
from tests.support.servers import serve_gateway
from tests.support.waiting import wait_for

# worker subprocesses and gateways: the figures are the workers' records, not times
pytestmark = pytest.mark.timeout(300)

COMMON: dict[str, Any] = {"time_scale": 0.01, "model": "tiny"}
CLASSES = {
    "interactive": {"rank": 0},  # engine priority 0: its rank
    "standard": {"rank": 1, "engine_priority": 2},
    "batch": {"rank": 3, "sheddable": True},  # 3
}
PRIORITY = {"classes": CLASSES, "default": "standard"}
SENT = {"interactive": 0, "standard": 2, "batch": 3}


class Pick(BasePolicy):
    """Every request to the mixed instance the test names in `target`."""

    name = "pick"

    def __init__(self) -> None:
        self.target = "by-priority"

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return Decision(request.request_id, self.name, prefill=self.target)


@dataclass
class Mixed:
    workers: dict[str, Emulator]  # by instance name: "by-priority", "fcfs"
    policy: Pick


@pytest.fixture(scope="module")
def mixed() -> Iterator[Mixed]:
    with ExitStack() as stack:
        workers = {
            "by-priority": stack.enter_context(start_emulator("mixed", scheduling_policy="priority", **COMMON)),
            "fcfs": stack.enter_context(start_emulator("mixed", **COMMON)),
        }
        yield Mixed(workers, Pick())


@contextmanager
def gateway(m: Mixed, **overrides: Any) -> Iterator[str]:
    """A gateway in front of both mixed workers, only "by-priority" said to schedule by priority."""
    instances = [
        {"url": m.workers["by-priority"].url, "name": "by-priority", "scheduling_policy": "priority"},
        {"url": m.workers["fcfs"].url, "name": "fcfs"},
    ]
    settings = load_settings(environ={}, overrides=merge_settings({"health": {"interval_s": 1.0}, "mixed": instances}, overrides))
    with serve_gateway(Gateway(settings, policy=m.policy)) as server:
        yield server.url


def last_body(emu: Emulator) -> dict[str, Any]:
    """The body of the last request the worker received."""
    return dict(httpx.get(emu.url + "/emulator/requests", timeout=30).json()[-1]["body"])


def post(url: str, path: str = "/v1/completions", headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": "tiny", "max_tokens": 2, **body}
    if path == "/v1/completions":
        payload.setdefault("prompt", "hello there")
    else:
        payload.setdefault("messages", [{"role": "user", "content": "hello there"}])
    return httpx.post(url + path, json=payload, headers=headers or {}, timeout=30)


def test_the_emulated_workers_refuse_a_priority_unless_they_schedule_by_it(mixed: Mixed) -> None:
    # what makes the tests below fail should the gateway send a priority where it must not
    refused = post(mixed.workers["fcfs"].url, priority=3)
    assert refused.status_code == 400 and "Priority scheduling is not enabled" in refused.text
    assert post(mixed.workers["fcfs"].url, priority=0).status_code == 200  # vLLM's default
    assert post(mixed.workers["by-priority"].url, priority=3).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_class_sends_its_engine_priority_to_a_priority_worker_and_none_to_an_fcfs_one(mixed: Mixed, path: str) -> None:
    with gateway(mixed, priority=PRIORITY) as url:
        for target in ("by-priority", "fcfs"):
            mixed.policy.target = target
            for cls, expected in SENT.items():
                # the client's own integer never passes: the class decides
                r = post(url, path, {"x-priority": cls}, priority=-9, stream=cls == "batch")
                assert r.status_code == 200, (target, cls, r.text)
                body = last_body(mixed.workers[target])
                assert body.get("priority") == (expected if target == "by-priority" else None), (target, cls)
            # the default class (standard) when the request names none
            assert post(url, path).status_code == 200
            assert last_body(mixed.workers[target]).get("priority") == (2 if target == "by-priority" else None)


def test_a_class_without_an_engine_priority_sends_none(mixed: Mixed) -> None:
    classes = {"interactive": {"engine_priority": None}, "batch": {"rank": 1, "engine_priority": None}}
    with gateway(mixed, priority={"classes": classes, "default": "interactive"}) as url:
        mixed.policy.target = "by-priority"
        assert post(url, headers={"x-priority": "batch"}, priority=4).status_code == 200
        assert "priority" not in last_body(mixed.workers["by-priority"])


def test_a_trusted_clients_integer_reaches_priority_workers_only(mixed: Mixed) -> None:
    with gateway(mixed, priority={"trust_client_engine_priority": True}) as url:
        mixed.policy.target = "by-priority"
        assert post(url, priority=-4).status_code == 200
        assert last_body(mixed.workers["by-priority"])["priority"] == -4
        mixed.policy.target = "fcfs"
        r = post(url, priority=-4)
        assert r.status_code == 200, r.text  # sent on, the worker would have refused it
        assert "priority" not in last_body(mixed.workers["fcfs"])
    # not trusted (the default): dropped everywhere
    with gateway(mixed) as url:
        mixed.policy.target = "by-priority"
        assert post(url, priority=-4).status_code == 200
        assert "priority" not in last_body(mixed.workers["by-priority"])


@pytest.mark.parametrize(
    ("protocol", "prefill_policy", "decode_policy"),
    [("nixl", "priority", "fcfs"), ("mooncake", "fcfs", "priority"), ("sglang", "priority", "priority")],
)
def test_each_pd_leg_carries_the_priority_where_its_worker_schedules_by_it(
    protocol: str, prefill_policy: str, decode_policy: str
) -> None:
    with ExitStack() as stack:
        p = stack.enter_context(start_emulator("prefill", protocol, scheduling_policy=prefill_policy, **COMMON))
        d = stack.enter_context(start_emulator("decode", protocol, scheduling_policy=decode_policy, **COMMON))
        settings = load_settings(
            environ={},
            overrides={
                "health": {"interval_s": 1.0},
                "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port, "scheduling_policy": prefill_policy}],
                "decode": [{"url": d.url, "scheduling_policy": decode_policy}],
                "pd": {"protocol": protocol},
                "priority": PRIORITY,
            },
        )
        server = stack.enter_context(serve_gateway(Gateway(settings)))
        for stream in (False, True):
            r = post(server.url, headers={"x-priority": "batch"}, priority=-1, stream=stream, max_tokens=4)
            assert r.status_code == 200, r.text
            for worker, policy in ((p, prefill_policy), (d, decode_policy)):
                assert last_body(worker).get("priority") == (3 if policy == "priority" else None), (worker.url, stream)


def test_an_instance_added_by_the_admin_api_says_how_it_schedules(mixed: Mixed) -> None:
    admin = {"Authorization": "Bearer admin-key"}
    settings = merge_settings(
        {"health": {"interval_s": 0.3}, "mixed": [{"url": mixed.workers["fcfs"].url, "name": "fcfs"}]},
        {"auth": {"admin_api_keys": ["admin-key"]}, "priority": PRIORITY},
    )
    with serve_gateway(Gateway(load_settings(environ={}, overrides=settings), policy=mixed.policy)) as server:
        added = {"url": mixed.workers["by-priority"].url, "role": "mixed", "name": "late", "scheduling_policy": "priority"}
        r = httpx.post(server.url + "/admin/instances", headers=admin, json=added)
        assert r.status_code == 201, r.text

        def healthy() -> bool:
            listed = httpx.get(server.url + "/admin/instances", headers=admin, timeout=10).json()["data"]
            return any(i["name"] == "late" and i["state"] == "healthy" for i in listed)

        assert wait_for(healthy, timeout=20)
        mixed.policy.target = "late"
        assert post(server.url, headers={"x-priority": "batch"}).status_code == 200
        assert last_body(mixed.workers["by-priority"])["priority"] == 3
        bad = httpx.post(server.url + "/admin/instances", headers=admin, json={**added, "name": "x", "scheduling_policy": "lifo"})
        assert bad.status_code == 400 and "scheduling_policy" in bad.text
