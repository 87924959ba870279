"""The admin API changes the fleet of a running gateway: an instance added takes requests, a drained
one finishes its streams and takes no new request before it goes (with its KV index entries and
metric series), a removed one goes at once without its requests being cut. Keys guard all of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.servers import ServerThread, serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The same long prefix that the index keys block by block. " * 4  # ~230 byte tokens: 14 blocks


@dataclass
class Running:
    url: str
    gateway: Gateway
    server: ServerThread

    def on_loop(self, coro: Any) -> Any:
        """Run a coroutine on the gateway's own event loop (its index is not thread-safe)."""
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout=30)

    def cached_on(self) -> set[str]:
        """The instances the gateway's KV index says hold PROMPT's leading blocks."""
        analysis = self.on_loop(self.gateway.analyzer.analyse("completions", {"prompt": PROMPT}))
        return {name for name, hit in analysis.cached.items() if hit.tokens > 0}

    def instances(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(self.url + "/admin/instances", headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return {i["name"]: i for i in r.json()["data"]}


@contextmanager
def gateway(workers: list[str], **settings: Any) -> Iterator[Running]:
    overrides: dict[str, Any] = {
        "mixed": workers,
        "models": ["tiny"],
        "health": {"interval_s": 0.3},
        "auth": {"admin_api_keys": [KEY]},
        "policy": "round_robin",
    }
    overrides = merge_settings(overrides, settings)
    gw = Gateway(load_settings(environ={}, overrides=overrides))
    with serve_gateway(gw) as server:
        yield Running(server.url, gw, server)


def _complete(url: str, n: int = 1) -> None:
    for _ in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text


def _stream(url: str, out: list[str]) -> threading.Thread:
    def run() -> None:
        with httpx.stream(
            "POST", url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True}
        ) as r:
            out.append(r.read().decode())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _completions(worker: StandIn) -> int:
    return len(worker.bodies())


def test_the_admin_api_is_off_without_an_admin_key() -> None:
    with serve(StandIn(model="tiny")) as w, gateway([w.url], auth={"admin_api_keys": []}) as g:
        r = httpx.get(g.url + "/admin/instances", headers=AUTH)
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "admin_api_disabled" and "admin_api_keys" in r.json()["error"]["message"]


def test_the_admin_api_wants_the_admin_key() -> None:
    with serve(StandIn(model="tiny")) as w, gateway([w.url], auth={"api_keys": ["client-key"]}) as g:
        for headers in ({}, {"Authorization": "Bearer client-key"}, {"Authorization": "Bearer wrong"}):
            for method, path in (("GET", ""), ("POST", ""), ("POST", "/mixed-0/drain"), ("DELETE", "/mixed-0")):
                r = httpx.request(method, g.url + "/admin/instances" + path, headers=headers, json={})
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
        assert g.instances()["mixed-0"]["state"] != "draining"  # nothing above took effect


def test_an_instance_added_at_run_time_takes_requests() -> None:
    first, second = StandIn(model="tiny"), StandIn(model="tiny")
    with serve(first) as w1, serve(second) as w2, gateway([w1.url]) as g:
        r = httpx.post(g.url + "/admin/instances", headers=AUTH, json={"url": w2.url, "role": "mixed", "name": "late"})
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "late" and r.json()["origin"] == "admin"
        assert wait_for(lambda: g.instances()["late"]["state"] == "healthy", timeout=20)
        _complete(g.url, 6)
        assert _completions(second) >= 2 and _completions(first) >= 2  # round robin over both
        # the same name or URL again: a conflict
        for body in ({"url": w2.url, "role": "mixed"}, {"url": "http://127.0.0.1:1", "role": "mixed", "name": "late"}):
            r = httpx.post(g.url + "/admin/instances", headers=AUTH, json=body)
            assert r.status_code == 409 and r.json()["error"]["code"] == "instance_exists", r.text


@pytest.mark.parametrize(
    "body",
    [
        {"url": "ftp://x:1", "role": "mixed"},  # the same rules as the settings' instances
        {"url": "http://127.0.0.1:9"},  # no role
        {"url": "http://127.0.0.1:9", "role": "prefill"},  # a mixed gateway takes no prefill
        {"url": "http://127.0.0.1:9", "role": "mixed", "name": "a/b"},
        {"url": "http://127.0.0.1:9", "role": "mixed", "colour": "red"},
        ["not", "an", "object"],
        "{not json",
    ],
)
def test_a_bad_instance_is_a_400(body: Any) -> None:
    with serve(StandIn(model="tiny")) as w, gateway([w.url]) as g:
        if isinstance(body, str):
            r = httpx.post(g.url + "/admin/instances", headers={**AUTH, "content-type": "application/json"}, content=body)
        else:
            r = httpx.post(g.url + "/admin/instances", headers=AUTH, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert set(g.instances()) == {"mixed-0"}


def test_unknown_names_are_404() -> None:
    with serve(StandIn(model="tiny")) as w, gateway([w.url]) as g:
        for method, path in (("POST", "/nope/drain"), ("DELETE", "/nope")):
            r = httpx.request(method, g.url + "/admin/instances" + path, headers=AUTH)
            assert r.status_code == 404 and r.json()["error"]["code"] == "instance_not_found", r.text


def test_a_drained_instance_finishes_its_stream_then_goes_with_its_index_entries() -> None:
    workers = [StandIn(model="tiny", token_delay_s=0.25), StandIn(model="tiny", token_delay_s=0.25)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve(w)).url for w in workers]
        g = stack.enter_context(gateway(urls, kv={"enabled": True}, timeouts={"drain_grace_s": 60}))
        assert wait_for(lambda: all(i["state"] == "healthy" for i in g.instances().values()), timeout=20)
        out: list[str] = []
        thread = _stream(g.url, out)
        assert wait_for(lambda: sum(map(_completions, workers)) == 1, timeout=10)
        busy = 0 if _completions(workers[0]) else 1
        name, other = f"mixed-{busy}", f"mixed-{1 - busy}"
        assert name in g.cached_on()  # the dispatch put the prompt's blocks there
        assert f'instance="{name}"' in httpx.get(g.url + "/metrics").text

        r = httpx.post(f"{g.url}/admin/instances/{name}/drain", headers=AUTH)
        assert r.status_code == 202 and r.json()["state"] == "draining", r.text
        assert r.json()["inflight"] == 1
        _complete(g.url, 4)  # while the stream runs: none of these may go to the draining one
        assert _completions(workers[busy]) == 1 and _completions(workers[1 - busy]) == 4

        thread.join(timeout=60)
        assert out and out[0].count("data: {") == 8 and out[0].rstrip().endswith("data: [DONE]")
        # it ran to its end; the stand-in records that after its last write returns, which a loaded
        # box lets the client read first (a clean-clone CI run found the list still empty)
        assert wait_for(lambda: bool(workers[busy].finished), timeout=10) and not workers[busy].cancelled
        assert wait_for(lambda: name not in g.instances(), timeout=20)
        assert name not in g.cached_on()
        assert f'instance="{name}"' not in httpx.get(g.url + "/metrics").text
        assert other in g.instances()


def test_a_removed_instance_goes_at_once_without_cutting_its_stream() -> None:
    workers = [StandIn(model="tiny", token_delay_s=0.25), StandIn(model="tiny", token_delay_s=0.25)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve(w)).url for w in workers]
        g = stack.enter_context(gateway(urls))
        assert wait_for(lambda: all(i["state"] == "healthy" for i in g.instances().values()), timeout=20)
        out: list[str] = []
        thread = _stream(g.url, out)
        assert wait_for(lambda: sum(map(_completions, workers)) == 1, timeout=10)
        busy = 0 if _completions(workers[0]) else 1
        r = httpx.delete(f"{g.url}/admin/instances/mixed-{busy}", headers=AUTH)
        assert r.status_code == 200 and r.json() == {"name": f"mixed-{busy}", "deleted": True}
        assert f"mixed-{busy}" not in g.instances()
        _complete(g.url, 3)
        assert _completions(workers[busy]) == 1
        thread.join(timeout=60)
        assert out and out[0].rstrip().endswith("data: [DONE]") and not workers[busy].cancelled
        assert wait_for(lambda: not g.gateway.registry.retired, timeout=20)  # its connections then closed


def test_kv_events_of_an_added_instance_are_followed_and_dropped_with_it() -> None:
    with ExitStack() as stack:
        static = stack.enter_context(start_emulator("mixed", time_scale=0.05, model="tiny", block_size=16))
        emu = stack.enter_context(start_emulator("mixed", kv_events=True, time_scale=0.05, model="tiny", block_size=16))
        g = stack.enter_context(gateway([static.url], kv={"enabled": True}, block_size=16, policy="kvcache_aware"))
        port = emu.kv_events_endpoint.rsplit(":", 1)[1] if emu.kv_events_endpoint else ""
        r = httpx.post(
            g.url + "/admin/instances",
            headers=AUTH,
            json={"url": emu.url, "role": "mixed", "name": "emu", "kv_events_endpoint": f"tcp://*:{port}"},
        )
        assert r.status_code == 201, r.text
        assert [s.source.instance for s in g.gateway.analyzer.subscribers] == ["emu"]  # type: ignore[attr-defined]
        assert wait_for(lambda: g.instances()["emu"]["state"] == "healthy", timeout=20)
        # ZMQ's slow joiner: batches published before the subscription reached the worker are lost
        # (this worker has no replay socket), so probe with prompts of their own until one arrives
        sub = g.gateway.analyzer.subscribers[0]  # type: ignore[attr-defined]
        probes = iter(range(1000))

        def subscribed() -> bool:
            r = httpx.post(
                emu.url + "/v1/completions",
                timeout=30,
                json={"model": "tiny", "prompt": f"probe {next(probes)} " * 8, "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
            return wait_for(lambda: sub.stats.batches > 0, timeout=1)

        assert wait_for(subscribed, timeout=60)
        # the worker's own events (not only the gateway's dispatch) confirm what it cached
        r = httpx.post(emu.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: "emu" in g.cached_on(), timeout=20)
        assert httpx.delete(g.url + "/admin/instances/emu", headers=AUTH).status_code == 200
        assert g.gateway.analyzer.subscribers == ()  # type: ignore[attr-defined]
        assert "emu" not in g.cached_on()
        assert 'conductor_kv_events_batches_total{instance="emu"' not in httpx.get(g.url + "/metrics").text
