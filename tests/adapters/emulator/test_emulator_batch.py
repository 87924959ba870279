"""Completions batches (`prompt` a list) as vLLM serves them, on emulators over real sockets: one
engine sequence per prompt, choices by prompt position, usage summed, the P/D params of a batch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.emulator.kv_content import content_block_ids, content_seed, seed_from_block_ids
from adapters.emulator.openai_format import generated_text
from tests.support.emulator import Emulator, start_emulator

P0 = [(i * 13) % 250 + 1 for i in range(40)]  # 2 full blocks + 8
P1 = [(i * 29 + 7) % 250 + 1 for i in range(70)]  # 4 full blocks + 6
NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def post(emu: Emulator, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(emu.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    return dict(r.json())


def reset(*emus: Emulator) -> None:
    for emu in emus:
        httpx.post(emu.url + "/emulator/reset").raise_for_status()


def events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def nixl() -> Iterator[tuple[Emulator, Emulator]]:
    with start_emulator("prefill", "nixl", time_scale=0.01) as p, start_emulator("decode", "nixl", time_scale=0.01) as d:
        yield p, d


def test_kv_content_ids_name_the_prompt() -> None:
    ids = content_block_ids(P1, 16)
    assert len(ids) == 5 and ids[-1] == content_seed(P1)  # the last (partial) block ends the prompt
    assert ids[:2] == content_block_ids(P1[:32], 16)  # a shared prefix has the same ids
    assert all(0 < i < 2**31 for i in ids) and content_seed(P0) != content_seed(P1)
    assert seed_from_block_ids([ids]) == seed_from_block_ids(ids) == content_seed(P1)
    assert seed_from_block_ids([]) is None and seed_from_block_ids([[True]]) is None
    assert generated_text(content_seed(P0), 8) != generated_text(content_seed(P1), 8)


def test_batch_answers_each_prompt_as_a_single_request_would(mixed: Emulator) -> None:
    reset(mixed)
    batch = post(mixed, {"prompt": [P0, P1], "max_tokens": 6})
    singles = []
    for p in (P0, P1):
        reset(mixed)  # each single request sees a cold cache, as each prompt of the batch did
        singles.append(post(mixed, {"prompt": p, "max_tokens": 6}))
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert batch["choices"][0]["text"] != batch["choices"][1]["text"]  # the text follows the prompt
    assert all(c["finish_reason"] == "length" for c in batch["choices"])
    assert batch["usage"] == {
        "prompt_tokens": 110,
        "completion_tokens": 12,
        "total_tokens": 122,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert batch["kv_transfer_params"] is None


def test_each_prompt_has_its_own_prefix_lookup_and_kv_events(mixed: Emulator, subscriber: Any) -> None:
    reset(mixed)
    sub = subscriber(mixed)
    post(mixed, {"prompt": P0, "max_tokens": 1})  # warms P0's two full blocks only
    again = post(mixed, {"prompt": [P0, P1], "max_tokens": 2})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # P0's hit, summed with P1's 0
    stored = [e for e in sub.events_until_reset(mixed) if e["type"] == "BlockStored"]
    runs = sorted(tuple(e["token_ids"]) for e in stored)
    assert runs == sorted([tuple(P0[:32]), tuple(P1[:64])])  # P0 stored once; P1 in its own run


def test_prompt_forms_and_errors(mixed: Emulator) -> None:
    reset(mixed)
    # A list of token ids is ONE prompt; a list of one string is a batch of one (one choice).
    assert len(post(mixed, {"prompt": P0, "max_tokens": 1})["choices"]) == 1
    one = post(mixed, {"prompt": ["hello world"], "max_tokens": 3})
    assert len(one["choices"]) == 1 and one["usage"]["prompt_tokens"] == 11
    texts = post(mixed, {"prompt": ["hello world", "the cache"], "max_tokens": 3})
    assert texts["usage"]["prompt_tokens"] == 20 and [c["index"] for c in texts["choices"]] == [0, 1]
    for bad in ([], [[]], ["a", [1, 2]], [[1, 2], "a"], [1.5], {"a": 1}):
        err = post(mixed, {"prompt": bad, "max_tokens": 1}, status=400)
        assert err["error"]["param"] == "prompt"


def test_streamed_batch_interleaves_and_ends_once(mixed: Emulator) -> None:
    reset(mixed)
    body = {"prompt": [P0, P1], "max_tokens": 8}
    whole = post(mixed, body)
    r = httpx.post(
        mixed.url + "/v1/completions", timeout=30, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    data = events(r.text)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    *tokens, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
    assert last["usage"]["prompt_tokens"] == 110
    order = [c["choices"][0]["index"] for c in tokens]
    assert sorted(order) == [0] * 8 + [1] * 8
    # continuous batching: prompt 1 starts before prompt 0 has finished
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)
    for i in (0, 1):
        mine = [c["choices"][0] for c in tokens if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine] == [None] * 7 + ["length"]
    plain = httpx.post(mixed.url + "/v1/completions", timeout=30, json={**body, "stream": True})
    assert all('"usage"' not in d for d in events(plain.text))


def test_nixl_prefill_batch_answers_the_first_prompts_params(nixl: tuple[Emulator, Emulator]) -> None:
    p, _ = nixl
    batch = post(p, {"prompt": [P0, P1], "max_tokens": 1, "kv_transfer_params": NIXL_PREFILL})
    single = post(p, {"prompt": P0, "max_tokens": 1, "kv_transfer_params": NIXL_PREFILL})
    params = batch["kv_transfer_params"]
    assert isinstance(params, dict) and params["remote_num_tokens"] == len(P0)
    assert params["remote_request_id"] == batch["id"] + "-0"  # vLLM's sub-request id
    assert params["remote_block_ids"] == single["kv_transfer_params"]["remote_block_ids"]
    assert len(batch["choices"]) == 2 and batch["usage"]["completion_tokens"] == 2


def test_nixl_decode_batch_with_one_params_continues_the_first_prompt(mixed: Emulator, nixl: tuple[Emulator, Emulator]) -> None:
    p, d = nixl
    reset(mixed)
    truth = [c["text"] for c in post(mixed, {"prompt": [P0, P1], "max_tokens": 6})["choices"]]
    own = [post(p, {"prompt": x, "max_tokens": 1, "kv_transfer_params": NIXL_PREFILL})["kv_transfer_params"] for x in (P0, P1)]
    # Each prompt decoded with its own prefill's params: what the mixed engine answers.
    for x, params, want in zip((P0, P1), own, truth, strict=True):
        assert post(d, {"prompt": x, "max_tokens": 6, "kv_transfer_params": params})["choices"][0]["text"] == want
    # One batched decode with the first prompt's params: every prompt pulls prompt 0's KV.
    wrong = post(d, {"prompt": [P0, P1], "max_tokens": 6, "kv_transfer_params": own[0]})
    assert [c["text"] for c in wrong["choices"]] == [truth[0], truth[0]] != truth
    assert wrong["usage"]["completion_tokens"] == 12


def test_mooncake_batch_shares_the_first_prompts_transfer() -> None:
    with (
        start_emulator("mixed", time_scale=0.01) as m,
        start_emulator("prefill", "mooncake", time_scale=0.01) as p,
        start_emulator("decode", "mooncake", time_scale=0.01) as d,
    ):
        truth = [c["text"] for c in post(m, {"prompt": [P0, P1], "max_tokens": 5})["choices"]]
        boot = f"http://127.0.0.1:{p.bootstrap_port}"

        def legs(xfer: str, prompt: Any) -> dict[str, Any]:
            post(
                p,
                {
                    "prompt": prompt,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": xfer},
                },
            )
            return post(
                d,
                {
                    "prompt": prompt,
                    "max_tokens": 5,
                    "kv_transfer_params": {
                        "do_remote_decode": False,
                        "do_remote_prefill": True,
                        "transfer_id": xfer,
                        "remote_engine_id": p.engine_id,
                        "remote_bootstrap_addr": boot,
                    },
                },
            )

        assert [legs(f"x-{i}", x)["choices"][0]["text"] for i, x in enumerate((P0, P1))] == truth
        both = legs("x-batch", [P0, P1])
        assert [c["text"] for c in both["choices"]] == [truth[0], truth[0]]
        assert both["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P0) + len(P1)
