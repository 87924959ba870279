"""The registry's probe schedule: instances out of rotation are probed often, the others each
health_interval_s; real gateways and stand-in workers on loopback."""

from __future__ import annotations

from typing import Any

import httpx

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from tests.support.servers import free_port, serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

# the full round comes after 600 s: nothing below may wait for it; what happens sooner is the
# fast probing of instances out of rotation, every 50 ms
SLOW_FULL_ROUND = {"health_interval_s": 600.0, "health_unhealthy_interval_s": 0.05, "models": ["tiny"]}


def _gateway(mixed: list[str], **overrides: Any) -> Gateway:
    return Gateway(load_settings(environ={}, overrides={"mixed": mixed, **SLOW_FULL_ROUND, **overrides}))


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
    # health_unhealthy_interval_s above health_interval_s: the full interval is the only schedule
    gw = _gateway([f"http://127.0.0.1:{free_port()}"], health_unhealthy_interval_s=1200.0)
    with serve_gateway(gw, ready_timeout_s=None):
        [state] = gw.registry.states.values()
        with serve(StandIn(model="tiny"), int(state.spec.url.rsplit(":", 1)[1])):
            # up and answering, yet not probed again before the full round
            assert not wait_for(lambda: state.health.probes_total > 1, 1.0)
            assert not state.health.available
