"""A gateway started after its workers: it catches up from their replay sockets, and when it cannot
(or is told the wrong seed), the coverage alarm says why. Emulated vLLM workers, real ZMQ, a real gateway."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from adapters.index.memory import MemoryIndex
from conductor.config.settings import load_settings
from conductor.core.block_keys import make_scheme
from conductor.gateway import Gateway
from tests.support.emulator import Emulator, start_emulator
from tests.support.servers import serve_gateway

SEED = "7"
BS = 16


@pytest.fixture(scope="module")
def worker() -> Iterator[Emulator]:
    with start_emulator(
        "mixed",
        kv_events=True,
        kv_events_replay=True,
        time_scale=0.01,
        model="tiny",
        block_size=BS,
        hash_algo="sha256_cbor",
        hash_seed=SEED,
    ) as emu:
        yield emu


def _port(endpoint: str | None) -> str:
    assert endpoint is not None
    return endpoint.rsplit(":", 1)[1]


def _gateway(worker: Emulator, *, key_mode: str = "xxhash", seed: str | None = SEED, **kv: Any) -> Gateway:
    settings = load_settings(
        environ={},
        overrides={
            "mixed": [{"url": worker.url, "name": "m0", "kv_events_endpoint": f"tcp://*:{_port(worker.kv_events_endpoint)}"}],
            "policy": "kvcache_aware",
            "block_size": BS,
            "logs": {"level": "warning"},
            "kv": {
                "enabled": True,
                "key_mode": key_mode,
                "vllm_hash_algo": "sha256_cbor",
                "vllm_hash_seed": seed,
                "forward_token_ids": True,
                "agreement_min_samples": 3,
                # the replay endpoint is the worker's --kv-events-config replay_endpoint
                "kv_events": {
                    "m0": {
                        "endpoint": f"tcp://*:{_port(worker.kv_events_endpoint)}",
                        "replay_endpoint": f"tcp://*:{_port(worker.kv_events_replay_endpoint)}",
                    }
                },
                **kv,
            },
        },
    )
    return Gateway(settings)


def _prompts(tag: int) -> list[list[int]]:
    return [[(tag * 37 + k * 11 + i) % 250 + 1 for i in range(6 * BS + 3)] for k in range(3)]


def _serve_directly(worker: Emulator, prompts: list[list[int]]) -> None:
    """Requests the workers served before the gateway existed."""
    httpx.post(worker.url + "/emulator/reset").raise_for_status()
    for prompt in prompts:
        r = httpx.post(worker.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=10)
        r.raise_for_status()


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name}{labels} not exported"
    return float(m.group(1))


def _through(url: str, prompt: list[int]) -> int:
    r = httpx.post(url + "/v1/completions", timeout=10, json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("key_mode", ["xxhash", "vllm"])
def test_gateway_started_after_the_worker_catches_up_from_its_replay_socket(worker: Emulator, key_mode: str) -> None:
    prompts = _prompts(1)
    _serve_directly(worker, prompts)
    gateway = _gateway(worker, key_mode=key_mode)
    scheme = make_scheme(key_mode, BS, algo="sha256_cbor", vllm_seed=SEED)  # type: ignore[arg-type]
    with ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        index = gateway.analyzer.index  # type: ignore[attr-defined]
        assert isinstance(index, MemoryIndex)
        for prompt in prompts:  # known at once, from events published before the gateway existed
            keys = scheme.keys(prompt)
            assert index.match_sync(keys).confirmed_blocks == {"m0": len(keys)}
        for prompt in prompts:  # so the gateway predicts the hits the worker then reports
            assert _through(url, prompt) == 6 * BS
        metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "conductor_kv_hash_coverage") == 1.0
    assert _metric(metrics, "conductor_kv_hash_agreement") == 1.0
    labels = '{instance="m0",rank="0"}'
    assert _metric(metrics, "conductor_kv_events_replayed_batches_total", labels) >= 3
    assert _metric(metrics, "conductor_kv_events_replay_requests_total", labels) >= 1
    assert _metric(metrics, "conductor_kv_events_last_seq", labels) >= 2
    assert _metric(metrics, "conductor_kv_events_blocks_stored_total", '{instance="m0"}') >= 3 * 6
    assert _metric(metrics, "conductor_kv_events_configured", '{instance="m0"}') == 1


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:  # a bound for a hang, not a speed check
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_late_start_without_catch_up_raises_the_coverage_alarm(worker: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    prompts = [*_prompts(2), *_prompts(4)]
    _serve_directly(worker, prompts)
    gateway = _gateway(worker, key_mode="vllm", replay_on_start=False)
    with caplog.at_level(logging.WARNING, logger="conductor.kv"), ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        # ZMQ subscriptions take a moment: fresh prompts (nothing cached, nothing predicted) until one
        # event has come through, so none of those below can be missed
        sub = gateway.analyzer.subscribers[0]  # type: ignore[attr-defined]
        warm = iter(_prompts(5 + k)[0] for k in range(1000))
        _wait_for(lambda: _through(url, next(warm)) == 0 and sub.stats.batches > 0, timeout=10)
        # the old prefixes, each extended by two new blocks: hits the index cannot know of, and new
        # blocks stored under parents it never saw stored
        for prompt in prompts[:3]:
            assert _through(url, prompt[: 6 * BS] + [9] * (2 * BS + 1)) == 6 * BS
        # the alarm is up; its cause is looked at again with each request, once those events are in
        _wait_for(lambda: gateway.analyzer.feeder.instance("m0").orphans >= 3 * 2)  # type: ignore[attr-defined]
        assert _through(url, prompts[3][: 6 * BS] + [9] * (2 * BS + 1)) == 6 * BS
        metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "conductor_kv_hash_coverage") == 0.0
    assert _metric(metrics, "conductor_kv_hash_alarm", '{cause="late_start",direction="under",instance="m0"}') == 1
    assert _metric(metrics, "conductor_kv_events_orphan_blocks_total", '{instance="m0"}') >= 6
    warning = next(r.getMessage() for r in caplog.records if "KV CACHE HITS UNPREDICTED" in r.getMessage())
    assert "[late_start]" in warning


def test_wrong_seed_is_named_from_the_events_own_hashes(worker: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    prompts = _prompts(3)
    _serve_directly(worker, prompts)
    gateway = _gateway(worker, key_mode="vllm", seed=None)  # the workers run with PYTHONHASHSEED=7
    with caplog.at_level(logging.WARNING, logger="conductor.kv"), ExitStack() as stack:
        url = stack.enter_context(serve_gateway(gateway)).url
        for prompt in prompts:
            assert _through(url, prompt) == 6 * BS  # cached at the worker; under keys the gateway cannot compute
        metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "conductor_kv_events_hash_mismatched_total", '{instance="m0"}') >= 3
    assert _metric(metrics, "conductor_kv_hash_alarm", '{cause="hash_seed",direction="under",instance="m0"}') == 1
    warning = next(r.getMessage() for r in caplog.records if "KV CACHE HITS UNPREDICTED" in r.getMessage())
    assert "[hash_seed]" in warning and "kv.vllm_hash_seed unset" in warning
