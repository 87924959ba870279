"""vLLM's OpenAI surface as the emulator serves it over real sockets."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.support.emulator import Emulator


@pytest.fixture(autouse=True)
def _reset(mixed: Emulator, client: httpx.Client) -> None:
    assert client.post(mixed.url + "/emulator/reset").status_code == 200


def sse(text: str) -> list[Any]:
    lines = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_shape_and_request_id(mixed: Emulator, client: httpx.Client) -> None:
    r = client.post(
        mixed.url + "/v1/completions",
        headers={"X-Request-ID": "req-42"},
        json={"model": "emulated", "prompt": "hello there", "max_tokens": 4},
    )
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "cmpl-req-42" and r.headers["x-request-id"] == "req-42"
    assert body["object"] == "text_completion" and body["model"] == "emulated"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 4,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_token_id_prompt_and_chat(mixed: Emulator, client: httpx.Client) -> None:
    r = client.post(mixed.url + "/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = client.post(mixed.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"].split()) == 3
    assert body["choices"][0]["finish_reason"] == "length"
    # <bos> <user> h i <end> <assistant>, as the shared byte tokenizer frames a chat
    assert body["usage"]["prompt_tokens"] == 6


def test_streamed_completion_with_usage(mixed: Emulator, client: httpx.Client) -> None:
    r = client.post(
        mixed.url + "/v1/completions",
        json={"prompt": "abc", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert len(chunks) == 6
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert "usage" not in chunks[0]


def test_streamed_chat_roles_and_no_usage_by_default(mixed: Emulator, client: httpx.Client) -> None:
    r = client.post(
        mixed.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    chunks = sse(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len(chunks) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


def test_openai_client_works_unchanged(mixed: Emulator) -> None:
    oa = openai.OpenAI(base_url=mixed.url + "/v1", api_key="x")
    resp = oa.completions.create(model="emulated", prompt="hello", max_tokens=3)
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    stream = oa.chat.completions.create(
        model="emulated",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = list(stream)
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 4
    assert [m.id for m in oa.models.list().data] == ["emulated"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "model": "other"}, 404, "does not exist"),
        ({"prompt": [1, 2, 99999]}, 400, "vocabulary"),
        ({"prompt": "x", "max_tokens": 10**9}, 400, "maximum context length"),
    ],
)
def test_errors_are_vllm_shaped(mixed: Emulator, client: httpx.Client, body: dict[str, Any], status: int, needle: str) -> None:
    r = client.post(mixed.url + "/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


def test_bad_json_is_400(mixed: Emulator, client: httpx.Client) -> None:
    r = client.post(mixed.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()


def test_models_health_tokenize(mixed: Emulator, client: httpx.Client) -> None:
    assert client.get(mixed.url + "/health").status_code == 200
    models = client.get(mixed.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "emulated"
    tok = client.post(mixed.url + "/tokenize", json={"prompt": "abc"}).json()
    assert tok["tokens"] == [97, 98, 99] and tok["count"] == 3 and tok["max_model_len"] > 0
    tok = client.post(mixed.url + "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert tok["count"] == 5


def test_repeated_prefix_is_reported_cached(mixed: Emulator, client: httpx.Client) -> None:
    prompt = list(range(100))  # 6 full blocks of 16
    first = client.post(mixed.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = client.post(mixed.url + "/v1/completions", json={"prompt": prompt + [7] * 20, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # An exact repeat of a block-aligned prompt still computes its last token (vLLM caps the hit).
    aligned = list(range(200, 232))
    client.post(mixed.url + "/v1/completions", json={"prompt": aligned, "max_tokens": 1})
    rep = client.post(mixed.url + "/v1/completions", json={"prompt": aligned, "max_tokens": 1}).json()
    assert rep["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_request_log_records_bodies_and_headers(mixed: Emulator, client: httpx.Client) -> None:
    client.post(
        mixed.url + "/v1/completions",
        headers={"X-Request-ID": "logged-1", "X-Custom": "yes"},
        json={"prompt": "abc", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    (entry,) = client.get(mixed.url + "/emulator/requests").json()
    assert entry["path"] == "/v1/completions" and entry["headers"]["x-custom"] == "yes"
    assert entry["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    client.post(mixed.url + "/emulator/reset")
    assert client.get(mixed.url + "/emulator/requests").json() == []


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


def test_metrics_carry_vllm_names_and_count(mixed: Emulator, client: httpx.Client) -> None:
    before = client.get(mixed.url + "/metrics").text
    prompt = [(i * 7) % 250 for i in range(40)]  # 2 full blocks
    for _ in range(2):
        client.post(mixed.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3}).raise_for_status()
    text = client.get(mixed.url + "/metrics").text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert types[gauge] == "gauge"
    for counter in (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:prompt_tokens_by_source",
        "vllm:request_success",
    ):
        assert types[counter + "_total"] == "counter"  # prometheus_client's text format, as vLLM's
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert types[hist] == "histogram"

    def delta(name: str, **labels: str) -> float:
        return _metric(text, name, **labels) - _metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total", model_name="emulated") == 80
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prefix_cache_hits_total") == 32
    assert delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 32
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") == 48
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 4
