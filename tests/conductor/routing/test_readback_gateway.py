"""The gateway drives a decode readback (NIXL bidirectional KV transfer) on emulated workers.

Two NIXL prefills with KV events and one decode, all started with bidirectional transfer: the decode's
full answer to turn 1 says where the request's KV stays pinned, the gateway keeps it, and turn 2
(turn 1's prompt and more) on a prefill that holds none of it is offered, planned and sent the pull.
The emulated workers read the pinned KV over their side channel and run on it: a wrong prefix would
change the answer's text (adapters/emulator/kv_content.py), so the text tells the pull was right.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from conductor.kv.analyzer import KVAwareAnalyzer
from policies.registry import load_policy
from tests.support.cluster import cluster
from tests.support.emulator import Emulator, free_port, start_emulator
from tests.support.servers import ServerThread, serve_gateway
from tests.support.waiting import wait_for

BLOCK = 16
COMMON: dict[str, Any] = {"time_scale": 0.01, "block_size": BLOCK, "noise": 0.0, "model": "tiny"}


@dataclass
class Setup:
    url: str
    gateway: Gateway
    server: ServerThread
    prefills: list[Emulator]
    decode: Emulator
    mixed: Emulator  # the same engine alone: what the answers must be


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with ExitStack() as stack:
        # vLLM reads a decode's KV into a prefill only where the prefill has bidirectional transfer on too
        prefills = [
            stack.enter_context(start_emulator("prefill", "nixl", kv_events=True, bidirectional_kv_xfer=True, **COMMON))
            for _ in range(2)
        ]
        decode = stack.enter_context(
            start_emulator("decode", "nixl", bidirectional_kv_xfer=True, side_channel_port=free_port(), **COMMON)
        )
        mixed = stack.enter_context(start_emulator("mixed", "nixl", **COMMON))
        settings = load_settings(
            environ={},
            overrides={
                "pd": {"protocol": "nixl"},
                "policy": "kvcache_aware",
                "block_size": BLOCK,
                "health": {"interval_s": 0.5},
                "prefill": [
                    {"url": p.url, "kv_events_endpoint": "tcp://*:" + str(p.kv_events_endpoint).rsplit(":", 1)[1]}
                    for p in prefills
                ],
                "decode": [decode.url],
                "kv": {"enabled": True},
            },
        )
        gateway = Gateway(settings)
        server = stack.enter_context(serve_gateway(gateway))
        url = server.url
        yield Setup(url, gateway, server, prefills, decode, mixed)


def post(s: Setup, prompt: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        s.url + "/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, **body},
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def readbacks(s: Setup, event: str) -> float:
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith(f'conductor_pd_readback_total{{event="{event}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no conductor_pd_readback_total series for {event}")


def cached_counters(s: Setup) -> tuple[float, float]:
    """(predicted, reported) cached prompt tokens the gateway has counted so far."""
    text = httpx.get(s.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        for name in ("conductor_kv_predicted_cached_tokens_total", "conductor_kv_reported_cached_tokens_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values["conductor_kv_predicted_cached_tokens_total"], values["conductor_kv_reported_cached_tokens_total"]


def last_request(emu: Emulator) -> dict[str, Any]:
    seen = httpx.get(emu.url + "/emulator/requests").json()
    return dict(seen[-1]) if seen else {}


def holders(s: Setup, prompt: str) -> dict[str, int]:
    """Instances the gateway's index says hold the prompt's leading blocks (read on its own loop)."""
    return index_holders(s.gateway, s.server, prompt)


def index_holders(gateway: Gateway, server: ServerThread, prompt: str) -> dict[str, int]:
    """The same for any gateway served by `server`."""
    analyzer = gateway.analyzer
    assert isinstance(analyzer, KVAwareAnalyzer)

    async def read() -> dict[str, int]:
        keys = analyzer.scheme.keys(await analyzer.tokenizer.encode_prompt(prompt))
        return dict((await analyzer.index.match(keys)).blocks)

    assert server.loop is not None
    return asyncio.run_coroutine_threadsafe(read(), server.loop).result(10)


def forget(s: Setup, prompt: str) -> None:
    """Both prefills drop their caches (and the index hears of it): only the decode holds the KV."""
    for p in s.prefills:
        httpx.post(p.url + "/reset_prefix_cache").raise_for_status()
    assert wait_for(lambda: not holders(s, prompt), 10.0), holders(s, prompt)


@pytest.fixture
def decisions(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    caplog.set_level(logging.INFO, logger="conductor.decisions")
    out: list[dict[str, Any]] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            out.append(json.loads(record.getMessage()))

    handler = Sink()
    logging.getLogger("conductor.decisions").addHandler(handler)
    yield out
    logging.getLogger("conductor.decisions").removeHandler(handler)


def test_turn_two_pulls_turn_ones_prompt_from_the_decode(setup: Setup, decisions: list[dict[str, Any]]) -> None:
    s = setup
    turn1 = "You are a careful assistant for our billing system. " * 60  # 3,120 bytes: 195 blocks
    first = post(s, turn1)
    assert first.get("kv_transfer_params") is None, "the decode's pinned-KV params reached the client"
    assert readbacks(s, "recorded") == 1
    forget(s, turn1)

    turn2 = turn1 + "Now, why was I charged twice?"
    pulled = len(turn1.encode()) // BLOCK * BLOCK
    before = cached_counters(s)
    second = post(s, turn2)
    record = decisions[-1]
    assert record["pull_from"] == "decode-0" and record["pull_tokens"] == pulled, record
    served = s.prefills.index(next(p for p in s.prefills if last_request(p).get("body", {}).get("prompt") == turn2))
    (modelled,) = last_request(s.prefills[served])["modelled"]
    assert modelled["external_tokens"] == pulled and modelled["transfer_s"] > 0
    # the prefill's count of cached tokens is the pull the index predicted
    assert wait_for(lambda: cached_counters(s) != before, 5.0)
    after = cached_counters(s)
    assert (after[0] - before[0], after[1] - before[1]) == (pulled, pulled)
    assert readbacks(s, "pulled") == 1
    alone = httpx.post(
        s.mixed.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": turn2, "max_tokens": 4, "ignore_eos": True}
    ).json()
    assert second["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_prompt_that_leaves_the_last_turn_early_gets_no_pull(setup: Setup, decisions: list[dict[str, Any]]) -> None:
    s = setup
    turn1 = "Summarise the incident report for the on-call engineer. " * 50
    post(s, turn1)
    forget(s, turn1)
    # shares the first half of turn 1's blocks only: the handle covers turn 1's whole prompt, and a
    # pull of it would bring KV of tokens this prompt does not have
    other = turn1[: len(turn1) // 2] + "Something else entirely. " * 40
    pulled_before = readbacks(s, "pulled")
    answer = post(s, other)
    assert decisions[-1]["pull_from"] is None
    assert readbacks(s, "pulled") == pulled_before
    alone = httpx.post(
        s.mixed.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": other, "max_tokens": 4, "ignore_eos": True}
    ).json()
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_failed_pull_is_computed_on_the_same_prefill_instead() -> None:
    # stand-ins: a decode that offers readbacks, a prefill whose every pull fails (vLLM answers 500
    # under its default kv_load_failure_policy "fail"); the gateway's own dispatch guesses expire at
    # once, so nothing but the decode holds turn 1's prefix and the policy plans the pull
    with cluster(
        "nixl",
        n_prefill=1,
        n_decode=1,
        policy=load_policy("kvcache_aware"),
        standin={"prefill": {"fail_pulls": 500}, "decode": {"bidirectional": True}},
        block_size=BLOCK,
        kv={"enabled": True, "unconfirmed_ttl_s": 0.001},
    ) as c:
        turn1 = "Tell me about the weather in Lisbon in spring. " * 20
        first = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": turn1, "max_tokens": 4})
        assert first.status_code == 200 and first.json().get("kv_transfer_params") is None
        turn2 = turn1 + "And in autumn?"
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": turn2, "max_tokens": 4})
        assert r.status_code == 200, r.text
        legs = [b for b in c.prefills[0].bodies() if b["prompt"] == turn2]
        assert [bool(b["kv_transfer_params"].get("remote_block_ids")) for b in legs] == [True, False]
        assert legs[0]["kv_transfer_params"]["remote_engine_id"] == "engine-0"
        metrics = httpx.get(c.url + "/metrics").text
        assert 'conductor_pd_readback_total{event="failed"} 1.0' in metrics
        assert 'conductor_pd_readback_total{event="pulled"} 1.0' in metrics
        assert 'conductor_upstream_errors_total{instance="prefill-0",kind="status"} 0.0' in metrics
