"""The gateway carries out a local prefill (policies/local_prefill.py) on emulated NIXL workers:
a decision naming the decode instance as its prefill too goes to that decode alone, as one plain
leg without kv_transfer_params, which a vLLM kv_both engine (and the emulator) computes itself.

The policy is a scripted one (prompts starting "local:" go to the decode); what is under test is
that the gateway carries the decision out, streamed and not, and that the answer is the same as
a mixed engine's (the emulated KV carries its content: a wrong leg would change the text)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.core.errors import ConfigError
from conductor.core.types import ClusterSnapshot, Decision, RequestView, Role
from conductor.gateway import Gateway
from policies.base import BasePolicy
from policies.kvcache_aware import KvCacheAwarePolicy
from tests.support.emulator import Emulator, start_emulator
from tests.support.servers import serve_gateway

COMMON: dict[str, Any] = {"time_scale": 0.01, "block_size": 16, "noise": 0.0, "model": "tiny"}


class LocalWhenAsked(BasePolicy):
    name = "local_when_asked"

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        d = cluster.by_role(Role.DECODE)[0].id
        local = request.prompt_tokens < 400  # the local prompts here are short, the others long
        decision = Decision(
            request.request_id,
            self.name,
            prefill=d if local else cluster.by_role(Role.PREFILL)[0].id,
            decode=d,
            predicted_ttft_s=0.05,
        )
        self.decisions.append(decision)
        return decision


@dataclass
class Setup:
    url: str
    prefill: Emulator
    decode: Emulator
    mixed: Emulator


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with ExitStack() as stack:
        prefill = stack.enter_context(start_emulator("prefill", "nixl", **COMMON))
        decode = stack.enter_context(start_emulator("decode", "nixl", **COMMON))
        mixed = stack.enter_context(start_emulator("mixed", "nixl", **COMMON))
        settings = load_settings(
            environ={},
            overrides={
                "pd": {"protocol": "nixl"},
                "block_size": 16,
                "health": {"interval_s": 0.5},
                "prefill": [prefill.url],
                "decode": [decode.url],
            },
        )
        server = stack.enter_context(serve_gateway(Gateway(settings, policy=LocalWhenAsked())))
        yield Setup(server.url, prefill, decode, mixed)


def bodies(emu: Emulator) -> list[dict[str, Any]]:
    return [r["body"] for r in httpx.get(emu.url + "/emulator/requests").json()]


def completion(url: str, prompt: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, **extra},
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_local_prefill_is_one_plain_leg_to_the_decode(setup: Setup, stream: bool) -> None:
    s = setup
    prompt = f"local: a short question, streamed={stream}"
    before = len(bodies(s.prefill))
    r = completion(s.url, prompt, stream=stream)
    assert r.status_code == 200, r.text
    reference = completion(s.mixed.url, prompt, stream=stream)
    assert r.text.count("data:") == reference.text.count("data:")
    if not stream:
        assert r.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        assert r.json()["usage"]["prompt_tokens"] == reference.json()["usage"]["prompt_tokens"]
    else:
        texts = [line for line in r.text.splitlines() if '"text"' in line]
        ref = [line for line in reference.text.splitlines() if '"text"' in line]
        assert [t.split('"text":')[1].split(",")[0] for t in texts] == [t.split('"text":')[1].split(",")[0] for t in ref]
    assert len(bodies(s.prefill)) == before  # the prefill never saw it
    (leg,) = [b for b in bodies(s.decode) if b.get("prompt") == prompt]
    assert "kv_transfer_params" not in leg  # nothing to pull: the decode computed it


def test_the_others_still_go_through_the_prefill(setup: Setup) -> None:
    s = setup
    prompt = "a long prompt that the scripted policy disaggregates " * 60
    before = len(bodies(s.prefill))
    r = completion(s.url, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == completion(s.mixed.url, prompt).json()["choices"][0]["text"]
    assert len(bodies(s.prefill)) == before + 1
    (leg,) = [b for b in bodies(s.decode) if b.get("prompt") == prompt]
    assert leg["kv_transfer_params"]["do_remote_prefill"] is True


def test_local_prefills_need_decodes_that_can_compute() -> None:
    settings = load_settings(
        environ={},
        overrides={
            "pd": {"protocol": "sglang"},
            "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 8998}],
            "decode": ["http://127.0.0.1:9"],
        },
    )
    with pytest.raises(ConfigError, match="local_prefill_tokens"):
        Gateway(settings, policy=KvCacheAwarePolicy(local_prefill_tokens=2048))
