"""In P/D the client's `usage.prompt_tokens_details.cached_tokens` is the prefill's figure, not the
decode's: a decode computed none of the prompt and counts every prompt token it received over the
KV transfer as cached, so relaying its figure said "100% cache read" on random prompts.

Emulated P/D workers (subprocesses, over HTTP) keep a real prefix cache: a random prompt is a miss
on the prefill (0 cached), the same prompt again hits all its whole blocks short of the last token;
the emulated decode reports every prompt token as cached, as vLLM's does. Sequential (nixl: the
prefill has answered before the decode starts) and concurrent (mooncake: both legs at once, the
decode's answer may come first) handshakes, streamed and not, single prompts and batches."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from tests.support.emulator import Emulator, start_emulator
from tests.support.servers import serve_gateway

pytestmark = pytest.mark.timeout(300)  # worker subprocesses on a busy box: a bound, not a speed check

BLOCK = 16
PROMPT_TOKENS = 256  # 16 whole blocks: a repeat hits 15 of them (never the last token's block)
HIT = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


@dataclass
class PD:
    url: str
    prefill: Emulator
    decode: Emulator


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pd(request: pytest.FixtureRequest) -> Iterator[PD]:
    protocol = request.param
    with ExitStack() as stack:
        emu = {"model": "tiny", "time_scale": 0.01, "block_size": BLOCK, "log_level": "warning"}
        p = stack.enter_context(start_emulator("prefill", protocol, **emu))
        d = stack.enter_context(start_emulator("decode", protocol, **emu))
        settings = load_settings(
            environ={},
            overrides={
                "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port}],
                "decode": [d.url],
                "pd": {"protocol": protocol},
                "logs": {"level": "warning"},
            },
        )
        server = stack.enter_context(serve_gateway(Gateway(settings)))
        yield PD(server.url, p, d)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)  # random ids: nothing of it is in any cache before
    return [rng.randrange(1, 250) for _ in range(PROMPT_TOKENS)]


def _usages(r: httpx.Response, stream: bool) -> list[dict[str, Any]]:
    """Every usage object of the answer (a stream's usage chunk, or the whole answer's)."""
    assert r.status_code == 200, r.text
    if not stream:
        return [r.json()["usage"]]
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [e["usage"] for e in map(json.loads, events[:-1]) if e.get("usage")]


def _send(pd: PD, prompt: list[int] | list[list[int]], stream: bool) -> int:
    """The cached tokens the client is told (the stream's usage chunk, the one it carries)."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    (usage,) = _usages(httpx.post(pd.url + "/v1/completions", json=body, timeout=60), stream)
    cached: int = usage["prompt_tokens_details"]["cached_tokens"]
    return cached


def _last_cached(emu: Emulator) -> int:
    """The cached tokens the worker itself counted for the last leg it served (local hit + received)."""
    (times,) = httpx.get(emu.url + "/emulator/requests", timeout=30).json()[-1]["modelled"]
    return int(times["cached_tokens"]) + int(times["external_tokens"] or 0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_client_is_told_the_prefills_cached_tokens(pd: PD, stream: bool) -> None:
    prompt = _prompt(1 + stream)
    assert _send(pd, prompt, stream) == 0  # a random prompt: nothing was cached
    assert _last_cached(pd.prefill) == 0
    assert _last_cached(pd.decode) == PROMPT_TOKENS  # what the gateway relayed before: "all cached"
    assert _send(pd, prompt, stream) == HIT  # the same prompt again: the prefill's hit
    assert _last_cached(pd.prefill) == HIT


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_is_told_the_sum_of_its_prefills(pd: PD, stream: bool) -> None:
    seen, fresh = _prompt(10 + stream), _prompt(20 + stream)
    assert _send(pd, seen, stream) == 0
    # one exchange per prompt (conductor/routing/batch_relay.py): their usages summed, each the
    # prefill's -- a hit on the first, a miss on the second; the decodes would say 2 x 256
    assert _send(pd, [seen, fresh], stream) == HIT
