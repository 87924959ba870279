"""/v1/embeddings and /v1/responses as vLLM serves them, on an emulator over real sockets: the
shapes, deterministic vectors from the input tokens, the Responses stream's events, and both
served by the emulated engine (a prefill step each; a response's tokens by decode steps)."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.emulator import Emulator, start_emulator
from tests.support.prom import metric_sum

HIDDEN = 48  # the emulator's --embedding-size here
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    with start_emulator("mixed", time_scale=0.01, embedding_size=HIDDEN, max_model_len=MAX_MODEL_LEN) as e:
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


def vectors(client: httpx.Client, value: Any, **extra: Any) -> list[list[float]]:
    body = post(client, "/v1/embeddings", {"input": value, **extra})
    return [d["embedding"] for d in body["data"]]


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_embeddings_shape_and_usage(client: httpx.Client) -> None:
    r = client.post("/v1/embeddings", headers={"X-Request-ID": "e-1"}, json={"model": "emulated", "input": ["one", "three"]})
    body = r.json()
    assert body["id"] == "embd-e-1" and body["object"] == "list" and body["model"] == "emulated"
    assert isinstance(body["created"], int)
    assert [(d["index"], d["object"], len(d["embedding"])) for d in body["data"]] == [(i, "embedding", HIDDEN) for i in (0, 1)]
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8, "completion_tokens": 0, "prompt_tokens_details": None}
    assert all(abs(norm(d["embedding"]) - 1.0) < 1e-5 for d in body["data"])


def test_embedding_vectors_follow_the_tokens(client: httpx.Client) -> None:
    text = "the quick brown fox"
    (a,) = vectors(client, text)
    assert vectors(client, [text]) == [a] == vectors(client, list(text.encode()))  # the same tokens, however sent
    (near,) = vectors(client, "the quick brown fox jumps")
    (far,) = vectors(client, "0123456789 !?")
    cosine = sum(x * y for x, y in zip(a, near, strict=True))
    assert cosine > sum(x * y for x, y in zip(a, far, strict=True)) and cosine > 0.8
    batch = vectors(client, [list(b"ab"), list(b"ba")])
    assert batch[0] != batch[1]  # order counts (adjacent pairs)


def test_embedding_base64_dimensions_and_normalize(client: httpx.Client) -> None:
    (floats,) = vectors(client, "encode me")
    (packed,) = vectors(client, "encode me", encoding_format="base64")
    raw = base64.b64decode(packed)
    assert len(raw) == 4 * HIDDEN and list(struct.unpack(f"<{HIDDEN}f", raw)) == floats
    (short,) = vectors(client, "encode me", dimensions=8)
    assert len(short) == 8 and abs(norm(short) - 1.0) < 1e-5
    scale = norm(floats[:8])  # a matryoshka cut: the first components, normalised again
    assert all(abs(s - f / scale) < 1e-5 for s, f in zip(short, floats[:8], strict=True))
    (raw_vector,) = vectors(client, "encode me", normalize=False)
    assert abs(norm(raw_vector) - 1.0) > 1e-3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": HIDDEN + 1}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({}, "input"),
        ({"input": "y" * (MAX_MODEL_LEN + 1)}, "input"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_bad_embedding_requests_are_openai_errors(client: httpx.Client, body: dict[str, Any], param: str) -> None:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param


def test_embeddings_run_as_engine_prefills(client: httpx.Client, emu: Emulator) -> None:
    before = client.get("/metrics").text
    post(client, "/v1/embeddings", {"input": ["a" * 40, "b" * 20]})
    (record,) = client.get("/emulator/requests").json()
    modelled = record["modelled"]
    assert [m["prompt_tokens"] for m in modelled] == [40, 20]
    assert all(m["prefill_s"] and m["prefill_s"] > 0 for m in modelled)
    after = client.get("/metrics").text
    assert metric_sum(after, "vllm:prompt_tokens_total") - metric_sum(before, "vllm:prompt_tokens_total") == 60
    # a forward pass samples nothing
    assert metric_sum(after, "vllm:generation_tokens_total") == metric_sum(before, "vllm:generation_tokens_total")


def test_response_object(client: httpx.Client) -> None:
    r = client.post(
        "/v1/responses",
        headers={"X-Request-ID": "r-1"},
        json={"input": "say it", "instructions": "be brief", "max_output_tokens": 5, "metadata": {"k": "v"}},
    )
    body = r.json()
    assert body["id"] == "resp_r-1" and body["object"] == "response" and body["status"] == "completed"
    assert body["model"] == "emulated" and body["metadata"] == {"k": "v"} and body["instructions"] == "be brief"
    assert body["max_output_tokens"] == 5 and body["tools"] == [] and body["top_logprobs"] == 0
    (message,) = body["output"]
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    (part,) = message["content"]
    assert part["type"] == "output_text" and len(part["text"].split()) == 5 and part["logprobs"] is None
    # <bos> <system> "be brief" <end> <user> "say it" <end> <assistant>
    assert body["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 25,
    }
    (record,) = client.get("/emulator/requests").json()
    (times,) = record["modelled"]
    assert times["prompt_tokens"] == 20 and times["prefill_s"] > 0  # a prefill step on the engine


def test_response_input_items_and_logprobs(client: httpx.Client) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"role": "user", "content": "again"},
    ]
    include = ["message.output_text.logprobs"]
    body = post(client, "/v1/responses", {"input": items, "max_output_tokens": 3, "include": include, "top_logprobs": 2})
    part = body["output"][0]["content"][0]
    assert body["usage"]["input_tokens"] == 1 + 3 * 2 + len("hello") + len("hi") + len("again") + 1
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in part["logprobs"])


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    frames = [f for f in text.split("\n\n") if f.strip()]
    out = []
    for frame in frames:
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        out.append((kind[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


def test_streamed_response_events(client: httpx.Client) -> None:
    request = {"input": "stream it", "max_output_tokens": 4}
    whole = post(client, "/v1/responses", request)
    client.post("/emulator/reset").raise_for_status()
    r = client.post("/v1/responses", json={**request, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream") and "[DONE]" not in r.text
    events = sse_events(r.text)
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == k for k, e in events)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    text = whole["output"][0]["content"][0]["text"]
    assert "".join(e["delta"] for k, e in events if k == "response.output_text.delta") == text
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["usage"] == whole["usage"]
    assert done["output"][0]["content"][0]["text"] == text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, 404, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "top_logprobs": 30}, 400, "top_logprobs"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input"),
        ({"input": ""}, 400, "input"),
    ],
)
def test_bad_response_requests_are_openai_errors(client: httpx.Client, body: dict[str, Any], status: int, param: str) -> None:
    r = client.post("/v1/responses", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param
