"""Bidirectional NIXL KV transfer (vLLM 0.32): a decode's KV read back by the next turn's prefill.

Real emulators over HTTP: turn 1 is a NIXL prefill + a bidirectional decode; turn 2 a prefill given
the decode's handle (truncated, as a router does, to the blocks that match the new prompt). Times
are the modelled ones (GET /emulator/requests), never the wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.emulator.kv_content import content_seed, generated_token_ids
from adapters.emulator.profile import load_profile
from tests.support.emulator import Emulator, free_port, modelled, start_emulator

# a module fixture of three emulator subprocesses: on a CI box busy with the real vLLM engines'
# start-ups it once took the suite's whole 120 s; the tests' own figures are modelled times
pytestmark = pytest.mark.timeout(300)
# a bound on each HTTP call, for a hang, not a speed check: CI once saw two emulators in a row
# not answer a 1-token request within 30 s while the box ran at load 25 on its two cores
HTTP_TIMEOUT_S = 120

BLOCK = 32
SCALE = 0.01
PROMPT = [(i * 13 + 5) % 250 for i in range(301)]  # 9 full blocks + 13 tokens, as the real run


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[Emulator, Emulator, Emulator]]:
    """A bidirectional prefill (events on), a bidirectional decode, and a mixed engine to compare."""
    common: dict[str, Any] = {"time_scale": SCALE, "block_size": BLOCK, "noise": 0.0}
    with (
        start_emulator("prefill", "nixl", bidirectional_kv_xfer=True, kv_events=True, **common) as p,
        start_emulator("decode", "nixl", bidirectional_kv_xfer=True, side_channel_port=free_port(), **common) as d,
        start_emulator("mixed", "nixl", **common) as m,
    ):
        yield p, d, m


def complete(emu: Emulator, prompt: list[int], request_id: str | None = None, **body: Any) -> dict[str, Any]:
    headers = {"X-Request-ID": request_id} if request_id else {}
    r = httpx.post(emu.url + "/v1/completions", json={"prompt": prompt, **body}, headers=headers, timeout=HTTP_TIMEOUT_S)
    r.raise_for_status()
    return dict(r.json())


def by_source(emu: Emulator) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(emu.url + "/metrics", timeout=HTTP_TIMEOUT_S).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def load_failures(emu: Emulator) -> float:
    for line in httpx.get(emu.url + "/metrics", timeout=HTTP_TIMEOUT_S).text.splitlines():
        if line.startswith("emulator:kv_load_failures_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no emulator:kv_load_failures_total series")


def pinned(emu: Emulator) -> int:
    return int(httpx.get(emu.url + "/emulator/state", timeout=HTTP_TIMEOUT_S).json()["pinned_for_readback"])


def wait_pinned(emu: Emulator, want: int) -> None:
    deadline = time.monotonic() + 30  # a bound for a hang, not a speed check
    while pinned(emu) != want:
        assert time.monotonic() < deadline, f"pinned stays {pinned(emu)}, want {want}"
        time.sleep(0.05)


def turn_one(p: Emulator, d: Emulator, prompt: list[int] = PROMPT, max_tokens: int = 8) -> dict[str, Any]:
    """A NIXL P/D request; the decode's answer."""
    p_params = complete(p, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    return complete(d, prompt, max_tokens=max_tokens, kv_transfer_params=p_params)


def handle(decode_params: dict[str, Any], blocks: int, tokens: int) -> dict[str, Any]:
    """The next turn's prefill params, truncated to `blocks` blocks and `tokens` tokens (the router's job)."""
    keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        **{k: decode_params[k] for k in keys},
        "remote_block_ids": [decode_params["remote_block_ids"][0][:blocks]],
        "remote_num_tokens": tokens,
    }


def next_prompt(answer: dict[str, Any], prompt: list[int] = PROMPT) -> list[int]:
    """Turn 2's prompt, 361 tokens: turn 1's, as many tokens as it generated (stand-ins: the pulls
    below stay inside turn 1's prompt), new ones."""
    generated = answer["usage"]["completion_tokens"]
    return prompt + [1] * generated + [(i * 7) % 250 for i in range(361 - len(prompt) - generated)]


def reset_cache(emu: Emulator) -> None:
    httpx.post(emu.url + "/reset_prefix_cache", timeout=HTTP_TIMEOUT_S).raise_for_status()


def test_decode_answers_readback_params_on_non_streamed_requests_only(pd: tuple[Emulator, ...]) -> None:
    p, d, _ = pd
    before = pinned(d)
    answer = turn_one(p, d)
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is False and params["do_remote_decode"] is True
    (ids,) = params["remote_block_ids"]
    assert len(ids) == 10 and params["remote_num_tokens"] == 308  # 301 + 8 - 1 computed tokens
    assert params["remote_engine_id"] == d.engine_id and params["remote_request_id"] == answer["id"]
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert isinstance(params["remote_blocks_expiry_time"], float) and params["transfer_mode"] == "pull"
    # the full prompt blocks hold the prompt's KV: the same content ids the prefill named
    p_params = complete(p, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert ids[:9] == p_params["remote_block_ids"][0][:9] and ids[9] != p_params["remote_block_ids"][0][9]
    assert pinned(d) == before + 1
    # a streamed answer never carries them
    r = httpx.post(
        d.url + "/v1/completions",
        timeout=HTTP_TIMEOUT_S,
        json={
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "kv_transfer_params": p_params,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200 and "data: [DONE]" in r.text and "kv_transfer_params" not in r.text
    chat = httpx.post(
        d.url + "/v1/chat/completions",
        timeout=HTTP_TIMEOUT_S,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    ).json()
    assert chat["kv_transfer_params"]["remote_request_id"] == chat["id"]
    assert chat["kv_transfer_params"]["remote_num_tokens"] == chat["usage"]["prompt_tokens"] + 2


def test_decode_without_bidirectional_answers_no_params() -> None:
    with (
        start_emulator("prefill", "nixl", time_scale=SCALE, block_size=BLOCK) as p,
        start_emulator("decode", "nixl", time_scale=SCALE, block_size=BLOCK) as d,
    ):
        assert turn_one(p, d)["kv_transfer_params"] is None
        assert pinned(d) == 0


def test_prefill_pulls_the_decodes_kv_once(pd: tuple[Emulator, ...], subscriber: Any) -> None:
    p, d, _ = pd
    answer = turn_one(p, d)
    params = answer["kv_transfer_params"]
    prompt2 = next_prompt(answer)
    reset_cache(p)  # the prefill no longer holds turn 1's prompt: the decode's copy is worth pulling
    sub = subscriber(p)
    pins, before, failures = pinned(d), by_source(p), load_failures(p)
    body = complete(p, prompt2, "pull-1", max_tokens=1, kv_transfer_params=handle(params, 9, 288))
    assert body["usage"]["prompt_tokens"] == 361
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
    after = by_source(p)
    assert after["local_compute"] - before["local_compute"] == 73
    assert after["local_cache_hit"] - before["local_cache_hit"] == 0
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == 288
    own = body["kv_transfer_params"]
    assert own["do_remote_prefill"] is True and own["remote_prefill_cached_tokens"] == 288
    assert own["remote_engine_id"] == p.engine_id and own["remote_num_tokens"] == 361
    # the modelled transfer of 288 tokens on the profile's link, time-scaled; it precedes the prefill
    times = modelled(p, "pull-1")
    assert times["external_tokens"] == 288 and times["cached_tokens"] == 0
    assert times["transfer_s"] == pytest.approx(load_profile().transfer_s(288) * SCALE, rel=1e-9)
    assert times["ttft_s"] == pytest.approx(times["queue_s"] + times["transfer_s"] + times["prefill_s"])
    assert times["prefill_s"] == pytest.approx(load_profile().prefill_s(73, 288) * SCALE, rel=1e-9)
    # the pulled blocks land in the cache (their own BlockStored), then the prefill stores the rest
    stored = [e for e in sub.events_until_reset(p) if e["type"] == "BlockStored"]
    assert [len(e["block_hashes"]) for e in stored] == [9, 2]
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == prompt2[:288]
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
    wait_pinned(d, pins - 1)  # single use: the decode's blocks are free
    # the same handle again: gone, a load failure, recomputed locally
    reset_cache(p)
    again = complete(p, prompt2, "pull-2", max_tokens=1, kv_transfer_params=handle(params, 9, 288))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    assert load_failures(p) == failures + 1
    assert by_source(p)["external_kv_transfer"] == after["external_kv_transfer"]
    assert modelled(p, "pull-2")["transfer_s"] is None


def test_nothing_is_pulled_below_the_threshold_or_when_cached(pd: tuple[Emulator, ...]) -> None:
    p, d, _ = pd
    answer = turn_one(p, d)
    prompt2 = next_prompt(answer)
    reset_cache(p)
    pins, before, failures = pinned(d), by_source(p), load_failures(p)
    # 32 tokens < kv_recompute_threshold 64: computed here; the decode is told to free its blocks
    body = complete(p, prompt2, max_tokens=1, kv_transfer_params=handle(answer["kv_transfer_params"], 1, 32))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert by_source(p)["external_kv_transfer"] == before["external_kv_transfer"]
    wait_pinned(d, pins - 1)
    assert load_failures(p) == failures
    # exactly the threshold is pulled
    answer = turn_one(p, d)
    reset_cache(p)
    body = complete(p, next_prompt(answer), max_tokens=1, kv_transfer_params=handle(answer["kv_transfer_params"], 2, 64))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert by_source(p)["external_kv_transfer"] == before["external_kv_transfer"] + 64
    # turn 1's prompt still cached on the prefill: min(N, prompt) - local hit = 0, nothing pulled
    reset_cache(p)
    answer = turn_one(p, d)
    pins = pinned(d)
    body = complete(p, next_prompt(answer), max_tokens=1, kv_transfer_params=handle(answer["kv_transfer_params"], 9, 288))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
    assert by_source(p)["external_kv_transfer"] == before["external_kv_transfer"] + 64
    wait_pinned(d, pins - 1)


def pd_text(
    p: Emulator, d: Emulator, prompt: list[int], p_params: dict[str, Any], n: int, request_id: str | None = None
) -> tuple[str, str]:
    """A turn-2 prefill given `p_params`, then its decode: (prefill's text, decode's text)."""
    first = complete(p, prompt, request_id, max_tokens=1, kv_transfer_params=p_params)
    second = complete(d, prompt, max_tokens=n, kv_transfer_params=first["kv_transfer_params"])
    return first["choices"][0]["text"], second["choices"][0]["text"]


def test_pulling_a_non_matching_prefix_changes_the_text(pd: tuple[Emulator, ...]) -> None:
    p, d, m = pd
    answer = turn_one(p, d)
    prompt2 = next_prompt(answer)
    expected = complete(m, prompt2, max_tokens=8)["choices"][0]["text"]
    # matching prefix: the text a mixed engine computes
    reset_cache(p)
    head, text = pd_text(p, d, prompt2, handle(answer["kv_transfer_params"], 9, 288), 8)
    assert complete(m, prompt2, max_tokens=1)["choices"][0]["text"] == head
    assert text == expected
    # a prompt differing inside block 3, handed a decode's KV whose blocks 0-8 are turn 1's: the router
    # pulled a prefix that does not match, and the engine computes on that wrong KV
    answer = turn_one(p, d)
    wrong = list(prompt2)
    wrong[100] = (wrong[100] + 1) % 250
    reset_cache(p)
    _, text = pd_text(p, d, wrong, handle(answer["kv_transfer_params"], 9, 288), 8)
    assert text != complete(m, wrong, max_tokens=8)["choices"][0]["text"]
    # the same wrong prompt without the bad pull gives the mixed engine's text again
    reset_cache(p)
    _, text = pd_text(p, d, wrong, {"do_remote_decode": True}, 8)
    assert text == complete(m, wrong, max_tokens=8)["choices"][0]["text"]


def test_generated_blocks_are_read_back_when_the_next_prompt_continues_them(pd: tuple[Emulator, ...]) -> None:
    p, d, m = pd
    answer = turn_one(p, d, max_tokens=24)  # 301 + 23 computed: block 9 is full with generated tokens
    params = answer["kv_transfer_params"]
    assert params["remote_num_tokens"] == 324 and len(params["remote_block_ids"][0]) == 11
    # the decode's tokens: the prompt, then the generated ones (ids from its KV's content seed)
    gen_ids = tokens_of(m, answer)
    prompt2 = PROMPT + gen_ids + [(i * 3) % 250 for i in range(40)]
    reset_cache(p)
    _, text = pd_text(p, d, prompt2, handle(params, 10, 320), 6, "pull-generated")
    assert text == complete(m, prompt2, max_tokens=6)["choices"][0]["text"]
    assert modelled(p, "pull-generated")["external_tokens"] == 320


def tokens_of(m: Emulator, answer: dict[str, Any]) -> list[int]:
    """Turn 1's generated token ids: those the mixed engine generates for the same prompt."""
    n = answer["usage"]["completion_tokens"]
    text = complete(m, PROMPT, max_tokens=n)["choices"][0]["text"]
    assert text == answer["choices"][0]["text"]  # P/D gave the mixed engine's text
    return generated_token_ids(content_seed(PROMPT), n)


def test_unread_kv_expires_after_the_ttl() -> None:
    common: dict[str, Any] = {"time_scale": SCALE, "block_size": BLOCK}
    with (
        start_emulator("prefill", "nixl", bidirectional_kv_xfer=True, **common) as p,
        start_emulator(
            "decode", "nixl", bidirectional_kv_xfer=True, side_channel_port=free_port(), decoder_kv_blocks_ttl=0.5, **common
        ) as d,
    ):
        answer = turn_one(p, d)
        wait_pinned(d, 0)  # the TTL passed unread
        reset_cache(p)
        body = complete(p, next_prompt(answer), max_tokens=1, kv_transfer_params=handle(answer["kv_transfer_params"], 9, 288))
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert load_failures(p) == 1
