"""`n` > 1 and `logprobs` as vLLM's OpenAI server answers them, on an emulator over real sockets:
choices numbered prompt-major, each choice its own engine sequence (the later ones hitting the
prefix cache the first filled), usage counting every choice, and logprobs in vLLM's completions and
chat shapes, streamed and not, the same values either way."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.emulator.kv_content import content_seed
from adapters.emulator.openai_format import generated_text
from tests.support.emulator import Emulator, start_emulator

P0 = [(i * 13) % 250 + 1 for i in range(40)]  # 2 full blocks of 16 + 8
P1 = [(i * 29 + 7) % 250 + 1 for i in range(21)]  # 1 full block + 5
CHAT = [{"role": "user", "content": "tell me"}]


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    with start_emulator("mixed", time_scale=0.01) as e:
        yield e


@pytest.fixture
def client(emu: Emulator) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=emu.url, timeout=30.0) as c:
        assert c.post("/emulator/reset").status_code == 200
        yield c


def post(client: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return dict(r.json())


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    data = [line[len("data: ") :] for line in r.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    return [json.loads(d) for d in data[:-1]]


def by_index(chunks: list[dict[str, Any]], field: str) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            out.setdefault(choice["index"], []).append(choice[field])
    return out


def test_completions_batch_with_n_numbers_choices_prompt_major(client: httpx.Client) -> None:
    body = post(client, "/v1/completions", {"prompt": [P0, P1], "n": 3, "max_tokens": 5})
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3, 4, 5]
    # choice p*n + 0 is what an n=1 request answers (the prompt's own continuation); the other
    # samples of a prompt each differ
    assert choices[0]["text"] == generated_text(content_seed(P0), 5)
    assert choices[3]["text"] == generated_text(content_seed(P1), 5)
    assert len({c["text"] for c in choices}) == 6
    assert body["usage"] == {
        "prompt_tokens": len(P0) + len(P1),  # each prompt once
        "completion_tokens": 30,  # every choice's tokens
        "total_tokens": len(P0) + len(P1) + 30,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    (record,) = client.get("/emulator/requests").json()
    modelled = record["modelled"]
    # one engine sequence per choice, named as vLLM names a parent request's children
    assert [m["request_id"] for m in modelled] == [f"{i}_{body['id']}-{p}" for p in (0, 1) for i in range(3)]
    # the later children of a prompt hit the full blocks the first one cached
    assert [m["cached_tokens"] for m in modelled] == [0, 32, 32, 0, 16, 16]


def test_streamed_n_matches_the_whole_answer(client: httpx.Client) -> None:
    request = {"prompt": [P0, P1], "n": 2, "max_tokens": 4}
    whole = post(client, "/v1/completions", request)
    client.post("/emulator/reset").raise_for_status()  # the same cold cache for the stream
    chunks = stream(client, "/v1/completions", request)
    *tokens, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    texts = by_index(tokens, "text")
    finish = by_index(tokens, "finish_reason")
    assert sorted(texts) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        assert "".join(texts[choice["index"]]) == choice["text"]
        assert finish[choice["index"]] == [None] * 3 + ["length"]


def test_chat_n_streamed_opens_every_choice_with_its_role(client: httpx.Client) -> None:
    whole = post(client, "/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 3})
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in whole["choices"]}) == 3
    assert whole["usage"]["completion_tokens"] == 9 and whole["usage"]["prompt_tokens"] == 11
    client.post("/emulator/reset").raise_for_status()
    chunks = stream(client, "/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 3})
    roles = [c["choices"][0] for c in chunks[:3]]
    assert [(r["index"], r["delta"]) for r in roles] == [(i, {"role": "assistant", "content": ""}) for i in range(3)]
    contents = by_index(chunks[3:-1], "delta")
    for choice in whole["choices"]:
        assert "".join(d["content"] for d in contents[choice["index"]]) == choice["message"]["content"]
    assert chunks[-1]["usage"] == whole["usage"]


def _check_ranked(top: dict[str, float] | list[dict[str, Any]], token: str, value: float, k: int) -> None:
    """The sampled token heads the top k; values fall; probabilities sum to at most 1."""
    pairs = list(top.items()) if isinstance(top, dict) else [(t["token"], t["logprob"]) for t in top]
    assert len(pairs) == k and pairs[0] == (token, value)
    values = [v for _, v in pairs]
    assert values == sorted(values, reverse=True) and all(v < 0 for v in values)
    assert len({t for t, _ in pairs}) == k and sum(math.exp(v) for v in values) <= 1.0


def test_completion_logprobs_shape_and_values(client: httpx.Client) -> None:
    body = post(client, "/v1/completions", {"prompt": P0, "max_tokens": 6, "logprobs": 3})
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 6
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        _check_ranked(top, token, value, 3)
    # logprobs 0: the sampled token's alone; the same values again (deterministic)
    zero = post(client, "/v1/completions", {"prompt": P0, "max_tokens": 6, "logprobs": 0})["choices"][0]["logprobs"]
    assert zero["token_logprobs"] == lp["token_logprobs"]
    assert zero["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    plain = post(client, "/v1/completions", {"prompt": P0, "max_tokens": 2})
    assert plain["choices"][0]["logprobs"] is None


def test_streamed_completion_logprobs_continue_the_offsets(client: httpx.Client) -> None:
    request = {"prompt": [P0, P1], "n": 2, "max_tokens": 5, "logprobs": 2}
    whole = post(client, "/v1/completions", request)
    pieces = by_index(stream(client, "/v1/completions", request)[:-1], "logprobs")
    for choice in whole["choices"]:
        mine = pieces[choice["index"]]
        assert all(len(p["tokens"]) == 1 for p in mine)  # one token per chunk
        joined = {key: [v for p in mine for v in p[key]] for key in choice["logprobs"]}
        assert joined == choice["logprobs"]


def test_chat_logprobs_shape_streamed_and_not(client: httpx.Client) -> None:
    request = {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    whole = post(client, "/v1/chat/completions", request)
    (choice,) = whole["choices"]
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        _check_ranked(entry["top_logprobs"], entry["token"], entry["logprob"], 2)
        assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])
    chunks = stream(client, "/v1/chat/completions", request)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [e for c in chunks[1:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    bare = post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in bare["choices"][0]["logprobs"]["content"])
    assert post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": "x", "n": 0}, "n", "at least 1"),
        ("/v1/completions", {"prompt": "x", "n": 1.5}, "n", "integer"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "max allowed: 20"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "positive"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "must be set to true"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 25}, "top_logprobs", "max allowed"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": "yes"}, "logprobs", "boolean"),
    ],
)
def test_bad_choices_and_logprobs_are_400(client: httpx.Client, path: str, body: dict[str, Any], param: str, needle: str) -> None:
    steps = client.get("/emulator/state").json()["steps"]
    err = post(client, path, body, status=400)["error"]
    assert err["param"] == param and needle in err["message"] and err["code"] == 400
    assert client.get("/emulator/state").json()["steps"] == steps  # nothing reached the engine
