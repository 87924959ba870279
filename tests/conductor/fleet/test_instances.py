"""The registry's probe schedule: instances out of rotation are probed often, the others each
health_interval_s; below the panic threshold, routing goes over every instance of the role that
has answered; real gateways and stand-in workers on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.servers import ServerThread, free_port, serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

# the full round comes after 600 s: nothing below may wait for it; what happens sooner is the
# fast probing of instances out of rotation, every 50 ms
SLOW_FULL_ROUND = {"health": {"interval_s": 600.0, "unhealthy_interval_s": 0.05}, "models": ["tiny"]}
# which workers a pool in panic sends requests to is told by where they went: round robin spreads
# them over every worker it may use, where the default policy would rightly keep them on one
SPREAD = {"policy": "round_robin"}


def _gateway(mixed: list[str], **overrides: Any) -> Gateway:
    return Gateway(load_settings(environ={}, overrides=merge_settings({"mixed": mixed, **SLOW_FULL_ROUND, **SPREAD}, overrides)))


def test_an_instance_down_at_start_joins_once_it_answers_without_waiting_a_full_round() -> None:
    port = free_port()
    gw = _gateway([f"http://127.0.0.1:{port}"])
    with serve_gateway(gw, ready_timeout_s=None) as server:
        assert not gw.ready()[0]  # nothing listens there yet: its start-up probe failed
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
        assert r.status_code == 503
        with serve(StandIn(model="tiny"), port):
            # the bound is a tenth of the full round's 600 s: only the fast probes can meet it
            assert wait_for(lambda: gw.ready()[0], 60.0)
            r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
            assert r.status_code == 200


def test_only_the_instances_out_of_rotation_are_probed_between_full_rounds() -> None:
    with serve(StandIn(model="tiny")) as live:
        dead = f"http://127.0.0.1:{free_port()}"
        gw = _gateway([live.url, dead])
        with serve_gateway(gw, ready_timeout_s=None):
            states = gw.registry.states
            [live_state] = [s for s in states.values() if s.spec.url == live.url]
            [dead_state] = [s for s in states.values() if s.spec.url == dead]
            assert wait_for(lambda: dead_state.health.probes_total >= 20, 60.0)
            assert live_state.health.available
            assert live_state.health.probes_total == 1  # its start-up probe; the next in 600 s


def test_without_a_shorter_unhealthy_interval_every_instance_waits_for_the_full_round() -> None:
    # health.unhealthy_interval_s above health.interval_s: the full interval is the only schedule
    gw = _gateway([f"http://127.0.0.1:{free_port()}"], health={"unhealthy_interval_s": 1200.0})
    with serve_gateway(gw, ready_timeout_s=None):
        [state] = gw.registry.states.values()
        with serve(StandIn(model="tiny"), int(state.spec.url.rsplit(":", 1)[1])):
            # up and answering, yet not probed again before the full round
            assert not wait_for(lambda: state.health.probes_total > 1, 1.0)
            assert not state.health.available


@dataclass
class SickStandIn(StandIn):
    """A stand-in whose /health answers 503 while `sick` is set, its completions still fine: what a
    gateway sees of workers whose probes time out on a starved host."""

    sick: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/health" and self.sick.is_set():
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await super().__call__(scope, receive, send)


@contextmanager
def _two_workers(
    sick: threading.Event, *, first_only: bool = False, **health: Any
) -> Iterator[tuple[str, Gateway, list[StandIn]]]:
    workers = [
        SickStandIn(model="tiny", sick=sick),
        SickStandIn(model="tiny", sick=sick if not first_only else threading.Event()),
    ]
    with serve(workers[0]) as a, serve(workers[1]) as b:
        gw = _gateway([a.url, b.url], health={"interval_s": 0.05, **health})
        with serve_gateway(gw) as server:
            states = gw.registry.states.values()
            assert wait_for(lambda: all(s.health.available for s in states), 60.0)  # both answered once
            sick.set()
            failing = 1 if first_only else 2
            assert wait_for(lambda: sum(not s.health.available for s in states) == failing, 60.0)
            yield server.url, gw, workers


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)


def test_when_every_instance_fails_its_probes_requests_still_go_over_them_all() -> None:
    with _two_workers(threading.Event()) as (url, gw, workers):
        assert not gw.ready()[0]  # /ready tells the truth; routing does not empty the pool
        answers = [_complete(url) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4
        assert all(w.requests for w in workers)


def test_at_the_panic_threshold_the_failing_half_stays_out() -> None:
    with _two_workers(threading.Event(), first_only=True) as (url, _, workers):
        assert [_complete(url).status_code for _ in range(4)] == [200] * 4
        assert not workers[0].requests and len(workers[1].requests) == 4  # 1 of 2 available: no panic


def test_without_a_panic_threshold_a_pool_failing_its_probes_answers_503() -> None:
    with _two_workers(threading.Event(), panic_threshold=0.0) as (url, _, workers):
        r = _complete(url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_instance"
        assert not any(w.requests for w in workers)


def test_in_panic_a_worker_that_refuses_connections_stays_out() -> None:
    sick = threading.Event()
    slow, stopped = SickStandIn(model="tiny", sick=sick), StandIn(model="tiny")
    with serve(slow) as a:
        b = ServerThread(stopped).start()
        gw = _gateway([a.url, b.url], health={"interval_s": 0.05})
        with serve_gateway(gw) as server:
            states = gw.registry.states.values()
            assert wait_for(lambda: all(s.health.available for s in states), 60.0)  # both answered once
            sick.set()
            b.stop()  # nothing listens there any more: its probes are refused, not slow
            assert wait_for(lambda: not any(s.health.available for s in states), 60.0)
            assert [_complete(server.url).status_code for _ in range(4)] == [200] * 4
            assert len(slow.requests) == 4 and not stopped.requests
