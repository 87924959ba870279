"""The KV canary: an instance's KV events checked against the gateway's block keys when it joins and
when its engine restarts, before its cache counts in placement. Emulated vLLM workers over HTTP, real
ZMQ, a real gateway; each planted mismatch is named, with the setting to fix, in /ready, a metric and
one log line, and keeps the instance's cache out of placement."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from itertools import count
from typing import Any

import httpx
import pytest

from adapters.index.memory import MemoryIndex
from conductor.config.settings import load_settings
from conductor.core.block_keys import make_scheme
from conductor.gateway import Gateway
from tests.support.emulator import REPO, Emulator, start_emulator
from tests.support.ports import free_port
from tests.support.servers import serve_gateway
from tests.support.waiting import wait_for

SEED = "7"
ALGO = "sha256_cbor"
BS = 16
_tags = count(1000)  # the first token of each test's prompt: never cached by an earlier test


@pytest.fixture(scope="module")
def worker() -> Iterator[Emulator]:
    flags: dict[str, Any] = {"time_scale": 0.01, "model": "tiny", "block_size": BS, "hash_algo": ALGO, "hash_seed": SEED}
    with start_emulator("mixed", kv_events=True, kv_events_replay=True, **flags) as emu:
        yield emu


def _port(endpoint: str | None) -> str:
    assert endpoint is not None
    return endpoint.rsplit(":", 1)[1]


def _ports(worker: Emulator) -> dict[str, Any]:
    """The worker's events and replay ports, as gateway_for takes them (the replay lets a gateway
    started after earlier tests' traffic know all of it, so no late start is reported)."""
    return {"events_port": _port(worker.kv_events_endpoint), "replay_port": _port(worker.kv_events_replay_endpoint)}


def gateway_for(
    worker_url: str, events_port: str | None, *, replay_port: str | None = None, block_size: int = BS, **kv: Any
) -> Gateway:
    """A KV-aware gateway in front of one mixed worker; `kv` changes its kv settings."""
    instance: dict[str, Any] = {"url": worker_url, "name": "m0"}
    if events_port is not None:
        instance["kv_events_endpoint"] = f"tcp://*:{events_port}"
    if replay_port is not None:
        instance["kv_events_replay_endpoint"] = f"tcp://*:{replay_port}"
    settings = load_settings(
        environ={},
        overrides={
            "mixed": [instance],
            "policy": "kvcache_aware",
            "block_size": block_size,
            "logs": {"level": "warning"},
            "kv": {
                "enabled": True,
                "tokenizer": "builtin",
                "key_mode": "vllm",
                "vllm_hash_algo": ALGO,
                "vllm_hash_seed": SEED,
                "forward_token_ids": True,
                "canary_timeout_s": 3.0,
                **kv,
            },
        },
    )
    return Gateway(settings)


def metric(text: str, name: str, **labels: str) -> float:
    """The sample of `name` with exactly these labels (0 when it is not exported)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _through(url: str, prompt: list[int]) -> None:
    r = httpx.post(url + "/v1/completions", timeout=10, json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def _predicted_twice(url: str) -> float:
    """A prompt of its own sent through the gateway twice: the cached tokens the index predicted in
    all (the second time its own dispatch, and the worker's events when trusted, say it is cached)."""
    tag = next(_tags)
    prompt = [tag % 250 + 1, tag // 250 + 1, *((tag * 31 + i) % 250 + 1 for i in range(4 * BS - 1))]
    _through(url, prompt)
    _through(url, prompt)
    return metric(httpx.get(url + "/metrics").text, "conductor_kv_predicted_cached_tokens_total")


def _canary_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV CANARY")]


@pytest.mark.parametrize("key_mode", ["vllm", "xxhash"])
def test_a_gateway_set_up_right_verifies_its_worker_at_start_up(worker: Emulator, key_mode: str) -> None:
    gateway = gateway_for(worker.url, **_ports(worker), key_mode=key_mode)
    with ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        ready = httpx.get(url + "/ready").json()
        predicted = _predicted_twice(url)
        text = httpx.get(url + "/metrics").text
    m0 = ready["kv_canary"]["instances"]["m0"]
    assert (m0["state"], m0["result"], ready["kv_canary"]["unverified"]) == ("verified", "verified", 0), ready
    print(f"emulated worker, key mode {key_mode}: join to verified {m0['seconds'] * 1000:.1f} ms")
    assert metric(text, "conductor_kv_canary_total", instance="m0", result="verified") == 1
    assert metric(text, "conductor_kv_canary_unverified") == 0
    assert predicted == 4 * BS  # the worker's cache counts in placement


@pytest.mark.parametrize(
    ("changes", "result", "setting"),
    [
        ({"vllm_hash_seed": "8"}, "hash_seed", "kv.vllm_hash_seed '8'"),
        ({"vllm_hash_seed": None}, "hash_seed", "kv.vllm_hash_seed is unset"),  # told the workers run without one
        ({"vllm_hash_algo": "sha256"}, "hash_algo", "set kv.vllm_hash_algo to 'sha256_cbor'"),
        ({"block_size": 32}, "block_size", "set block_size (kv.block_size) to 16"),
    ],
)
def test_a_planted_mismatch_is_named_and_keeps_the_cache_out_of_placement(
    worker: Emulator, caplog: pytest.LogCaptureFixture, changes: dict[str, Any], result: str, setting: str
) -> None:
    changes = dict(changes)
    block_size = changes.pop("block_size", BS)
    gateway = gateway_for(worker.url, **_ports(worker), block_size=block_size, **changes)
    with caplog.at_level(logging.WARNING, logger="conductor.kv"), ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        ready = httpx.get(url + "/ready")  # before any client request
        predicted = _predicted_twice(url)
        text = httpx.get(url + "/metrics").text
    assert ready.status_code == 200  # it still serves
    m0 = ready.json()["kv_canary"]["instances"]["m0"]
    assert (m0["state"], m0["result"]) == ("failed", result), m0
    assert setting in m0["detail"], m0["detail"]
    assert metric(text, "conductor_kv_canary_total", instance="m0", result=result) == 1
    assert metric(text, "conductor_kv_canary_unverified") == 1
    assert metric(text, "conductor_kv_canary_excluded", instance="m0") == 1
    (line,) = _canary_warnings(caplog)
    assert line.startswith(f"KV CANARY FAILED on m0 [{result}]") and setting in line, line
    # its own dispatch of the prompt is in the index, yet placement is not told of it
    assert predicted == 0


def test_kv_events_that_never_arrive_are_named(worker: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    silent = str(free_port())  # an endpoint nothing publishes on: a worker without --kv-events-config
    gateway = gateway_for(worker.url, silent, canary_timeout_s=0.6)
    with caplog.at_level(logging.WARNING, logger="conductor.kv"), ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        m0 = httpx.get(url + "/ready").json()["kv_canary"]["instances"]["m0"]
        text = httpx.get(url + "/metrics").text
    # start-up waited for the verdict (at most twice kv.canary_timeout_s): no client request came before it
    assert (m0["state"], m0["result"]) == ("failed", "no_events"), m0
    assert "--kv-events-config" in m0["detail"]
    assert metric(text, "conductor_kv_canary_excluded", instance="m0") == 1
    (line,) = _canary_warnings(caplog)
    assert "[no_events]" in line


def test_events_later_than_one_attempts_wait_still_verify(caplog: pytest.LogCaptureFixture) -> None:
    # a loaded engine publishes its events seconds late: each canary (ids, then text) is sent again
    # after 2 s, and the first one's event, 3 s late, arrives while the second is waited on; it
    # still counts (a canary that waited only for its latest send read this as missing events, or
    # on the text canary as a wrong tokenizer)
    flags: dict[str, Any] = {"time_scale": 0.01, "model": "tiny", "block_size": BS, "hash_algo": ALGO, "hash_seed": SEED}
    with ExitStack() as stack:
        late = stack.enter_context(start_emulator("mixed", kv_events=True, kv_events_delay_s=3.0, **flags))
        gateway = gateway_for(late.url, _port(late.kv_events_endpoint), canary_timeout_s=6.0, canary_attempts=3)
        stack.enter_context(caplog.at_level(logging.WARNING, logger="conductor.kv"))
        url = stack.enter_context(serve_gateway(gateway)).url
        m0 = httpx.get(url + "/ready").json()["kv_canary"]["instances"]["m0"]
        sent = len(httpx.get(late.url + "/emulator/requests", timeout=30).json())
    assert (m0["state"], m0["result"]) == ("verified", "verified"), m0
    assert "gives the worker's token ids" in m0["detail"]  # the text canary verified too
    assert sent >= 3  # at least one canary was sent again before the late event came
    assert not _canary_warnings(caplog)


def test_an_instance_without_an_events_endpoint_is_reported_not_excluded(worker: Emulator) -> None:
    gateway = gateway_for(worker.url, None)
    with ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        ready = httpx.get(url + "/ready").json()["kv_canary"]
        predicted = _predicted_twice(url)
    assert ready["instances"]["m0"]["state"] == "unverifiable"
    assert ready["instances"]["m0"]["result"] == "no_events"
    assert ready["unverified"] == 0
    assert predicted == 4 * BS  # its own dispatches still count: keyed as the gateway keys them


def test_the_canary_can_be_turned_off(worker: Emulator) -> None:
    gateway = gateway_for(worker.url, **_ports(worker), vllm_hash_seed="8", canary=False)
    with ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        ready = httpx.get(url + "/ready").json()
    assert "kv_canary" not in ready


def test_a_worker_that_cached_before_the_gateway_listened_is_told_not_excluded(
    worker: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    httpx.post(worker.url + "/v1/completions", json={"prompt": list(range(1, 2 * BS + 2)), "max_tokens": 1}).raise_for_status()
    gateway = gateway_for(worker.url, _port(worker.kv_events_endpoint))  # no replay endpoint
    with caplog.at_level(logging.WARNING, logger="conductor.kv"), ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        ready = httpx.get(url + "/ready").json()["kv_canary"]
    m0 = ready["instances"]["m0"]
    assert (m0["state"], m0["result"], ready["unverified"]) == ("verified", "late_start", 0), m0
    assert "kv_events_replay_endpoint" in m0["detail"]
    (line,) = _canary_warnings(caplog)
    assert line.startswith("KV CANARY on m0 [late_start]")


@contextmanager
def _emulator_on(port: int, events_port: int) -> Iterator[subprocess.Popen[bytes]]:
    """An emulated worker on these ports (what a restarted engine keeps: its address and endpoint)."""
    args = [sys.executable, "-m", "adapters.emulator", "--role", "mixed", "--port", str(port), "--model", "tiny"]
    args += ["--kv-events-endpoint", f"tcp://*:{events_port}", "--block-size", str(BS), "--time-scale", "0.01"]
    args += ["--hash-algo", ALGO, "--hash-seed", SEED]
    proc = subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: _answers(f"http://127.0.0.1:{port}"), 60.0), "the emulator did not start"
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_engine_restart_drops_its_entries_at_its_first_event_and_is_checked_again() -> None:
    port, events_port = free_port(), free_port()
    worker_url = f"http://127.0.0.1:{port}"
    prompt = [(7 * i) % 250 + 1 for i in range(4 * BS + 1)]
    keys = make_scheme("vllm", BS, algo=ALGO, vllm_seed=SEED).keys(prompt)
    gateway = gateway_for(worker_url, str(events_port))
    analyzer: Any = gateway.analyzer
    with ExitStack() as stack:
        engine = stack.enter_context(_emulator_on(port, events_port))
        url = stack.enter_context(serve_gateway(gateway)).url
        index, sub = analyzer.index, analyzer.subscribers[0]
        assert isinstance(index, MemoryIndex)
        assert analyzer.canary.states["m0"].state == "verified"
        httpx.post(worker_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).raise_for_status()
        assert wait_for(lambda: index.match_sync(keys).confirmed_blocks == {"m0": 4}, 10.0)
        engine.terminate()  # the engine restarts: same address, same endpoint, an empty cache
        engine.wait(timeout=10)
        with _emulator_on(port, events_port):
            # still credited: nothing has told the gateway yet
            assert index.match_sync(keys).confirmed_blocks == {"m0": 4}
            resyncs, fresh, sent_at = sub.stats.resyncs, iter(range(3, 250)), [0.0]

            def restart_seen() -> bool:  # a request straight to the new engine, until its event comes
                sent_at[0] = time.monotonic()
                other = [next(fresh), *range(1, 2 * BS + 1)]
                httpx.post(worker_url + "/v1/completions", json={"prompt": other, "max_tokens": 1}).raise_for_status()
                return wait_for(lambda: sub.stats.resyncs > resyncs, 0.5)

            assert wait_for(restart_seen, 30.0)
            dropped_after = time.monotonic() - sent_at[0]
            assert index.match_sync(keys).confirmed_blocks == {}  # gone with the first new event
            m0 = analyzer.canary.states["m0"]
            assert wait_for(lambda: m0.state == "verified" and m0.settled == 2, 10.0), m0
            text = httpx.get(url + "/metrics").text
    print(f"emulated engine restart: entries dropped {dropped_after * 1000:.1f} ms after the request of its first event")
    assert metric(text, "conductor_kv_canary_total", instance="m0", result="verified") == 2
