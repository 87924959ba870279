"""Malformed bodies get a 400 in OpenAI's shape and reach no worker, with KV awareness off and on;
fields the gateway does not read pass through untouched; a 429 that retrying cannot cure is tried
once by the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer, models

from adapters.tokenizers import HFTokenizer, LocalTokenizer, WorkerTokenizer
from conductor.core.errors import Overloaded, Rejected
from conductor.core.tokenization import ByteTokenizer, message_text
from conductor.core.types import ClusterSnapshot, Decision, Rejection, RequestView
from conductor.kv.analysis import EstimatingAnalyzer, vocab_size_of
from conductor.server.errors import render
from conductor.server.requests import MAX_DEPTH, nesting_depth
from policies.base import BasePolicy
from tests.support.cluster import Cluster, cluster

DEEP_OBJECT = b'{"model": "tiny", "prompt": "x", "extra": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}"
DEEP_ARRAY = b'{"model": "tiny", "prompt": ' + b"[" * 1000 + b"1" + b"]" * 1000 + b"}"
UNCLOSED = b"[" * 100_000


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _completion(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", **fields}).encode()


BAD = [
    ("completions", DEEP_OBJECT, None),
    ("completions", DEEP_ARRAY, None),
    ("completions", UNCLOSED, None),
    ("chat", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]), "messages"),
    ("chat", _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages"),
    ("chat", _chat(messages=[{"role": "user", "content": [5]}]), "messages"),
    ("chat", _chat(messages=[{"role": "user", "content": {"text": "hi"}}]), "messages"),
    ("chat", _chat(messages=[{"role": 7, "content": "hi"}]), "messages"),
    ("chat", _chat(messages="hi"), "messages"),
    ("chat", _chat(max_completion_tokens=0), "max_completion_tokens"),
    ("chat", _chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    ("completions", _completion(prompt=[-1, 5]), "prompt"),
    ("completions", _completion(prompt=[4294967296]), "prompt"),
    ("completions", _completion(prompt=[2**31]), "prompt"),
    ("completions", _completion(prompt=[[1, 2], [-3]]), "prompt"),
    ("completions", _completion(prompt=[[1, 2], []]), "prompt"),
    ("completions", _completion(prompt=[1, "a"]), "prompt"),
    ("completions", _completion(prompt=[1.5]), "prompt"),
    ("completions", _completion(prompt=[True]), "prompt"),
    ("completions", _completion(prompt=""), "prompt"),
    ("completions", _completion(prompt=[]), "prompt"),
    ("completions", _completion(prompt=[""]), "prompt"),
    ("completions", _completion(prompt={"text": "hi"}), "prompt"),
    ("completions", _completion(model=""), "model"),
    ("completions", _completion(model=["tiny"]), "model"),
    ("completions", _completion(max_tokens="10"), "max_tokens"),
    ("completions", _completion(max_tokens=2**40), "max_tokens"),
    ("completions", _completion(max_tokens=1.5), "max_tokens"),
    ("completions", _completion(n=0), "n"),
    ("completions", _completion(stream=1), "stream"),
    ("completions", _completion(stream_options=True), "stream_options"),
    ("completions", _completion(stream_options={"include_usage": "yes"}), "stream_options"),
    ("completions", _completion(temperature="hot"), "temperature"),
    ("completions", _completion(temperature=-0.5), "temperature"),
    ("completions", _completion(top_p=True), "top_p"),
    ("completions", _completion(stop=[1]), "stop"),
    ("completions", _completion(add_special_tokens="no"), "add_special_tokens"),
    ("completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}', None),
]


@pytest.fixture(scope="module", params=["kv-off", "kv-on"])
def c(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    kv = {"enabled": True} if request.param == "kv-on" else {}
    with cluster("nixl", models=["tiny"], kv=kv) as c:
        yield c


def _assert_400(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    return str(err["message"])


@pytest.mark.parametrize(("kind", "body", "param"), BAD)
def test_malformed_body_is_400_and_not_forwarded(c: Cluster, kind: str, body: bytes, param: str | None) -> None:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    before = len(c.prefills[0].requests)
    _assert_400(httpx.post(c.url + path, content=body, headers={"content-type": "application/json"}), param)
    assert len(c.prefills[0].requests) == before


def test_messages_name_the_field_and_the_limit(c: Cluster) -> None:
    post = httpx.post
    deep = _assert_400(post(c.url + "/v1/completions", content=DEEP_ARRAY), None)
    assert "1001 levels" in deep and str(MAX_DEPTH) in deep
    null_text = _assert_400(
        post(
            c.url + "/v1/chat/completions",
            content=_chat(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
        ),
        "messages",
    )
    assert "messages[0].content[0].text" in null_text
    bad_id = _assert_400(post(c.url + "/v1/completions", content=_completion(prompt=[[1], [2, -1]])), "prompt")
    assert "prompt[1][1]" in bad_id


def test_token_ids_outside_the_builtin_vocabulary_are_400_with_kv_on() -> None:
    with cluster("nixl", models=["tiny"], kv={"enabled": True}) as c:
        vocab = ByteTokenizer.vocab_size
        assert vocab_size_of(c.gateway.analyzer) == vocab
        msg = _assert_400(httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": [5, vocab]}), "prompt")
        assert f"vocabulary has {vocab} tokens" in msg
        ok = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": [5, vocab - 1]})
        assert ok.status_code == 200, ok.text


def test_fields_the_gateway_does_not_read_pass_through(c: Cluster) -> None:
    extra = {
        "seed": 7,
        "logit_bias": {"5": -100},
        "guided_json": {"type": "object", "properties": {"a": {"type": "array"}}},
        "vendor_field": [None, {"x": [1, 2]}],
        "stream": None,
        "stop": None,
    }
    r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", **extra})
    assert r.status_code == 200, r.text
    sent = c.decodes[0].bodies()[-1]
    assert {k: sent.get(k) for k in extra} == extra
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = httpx.post(
        c.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": None, "tool_calls": []}],
        },
    )
    assert r.status_code == 200, r.text
    assert c.decodes[0].bodies()[-1]["messages"][0]["content"] == parts


def test_integral_numbers_are_integers(c: Cluster) -> None:
    # JSON Schema's "integer" and vLLM both take 3.0 as 3: forwarded as integers
    r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": [5.0, 6], "max_tokens": 3.0, "n": 1.0})
    assert r.status_code == 200, r.text
    sent = c.decodes[0].bodies()[-1]
    assert sent["prompt"] == [5, 6] and sent["max_tokens"] == 3 and sent["n"] == 1
    assert all(type(v) is int for v in (*sent["prompt"], sent["max_tokens"], sent["n"]))
    _assert_400(httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": [5.5]}), "prompt")


def test_nesting_depth_ignores_brackets_in_strings() -> None:
    assert nesting_depth(b'{"a": [1, {"b": 2}]}') == 3  # under the limit: the bracket count bounds it
    text = json.dumps({"prompt": "[{" * 500 + '\\"]' + "}]" * 10, "x": [[[1]]]}).encode()
    assert nesting_depth(text) == 4
    assert nesting_depth(b"[" * 70 + b"]" * 70) == 70
    assert nesting_depth(b'["\\\\", ' + b"[" * 65 + b"]" * 65 + b"]") == 66  # an escaped backslash ends no string
    across = json.dumps({"a": "x" * ((1 << 20) - 8) + "[{" * 100, "b": [[1]]}).encode()  # a string over a chunk edge
    assert nesting_depth(across) == 3


def test_message_text_skips_parts_whose_text_is_not_a_string() -> None:
    parts = [{"type": "text", "text": None}, {"type": "text", "text": "a"}, {"type": "text", "text": 5}, "b"]
    assert message_text(parts) == "a"
    assert ByteTokenizer().apply_chat_template([{"role": "user", "content": parts}])


def test_vocab_sizes(tmp_path: Path) -> None:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 7}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(tmp_path).vocab_size == 8  # one past the largest id, not the count of entries
    assert LocalTokenizer(ByteTokenizer()).vocab_size == ByteTokenizer.vocab_size
    assert WorkerTokenizer("http://127.0.0.1:1").vocab_size is None
    assert vocab_size_of(EstimatingAnalyzer()) is None


def test_retry_hints() -> None:
    _, _, final = render(Rejected("too slow even alone", reason="ttft_slo", retry_after_s=1, retryable=False))
    assert final["x-should-retry"] == "false" and final["Retry-After"] == "1"
    _, _, later = render(Rejected("busy now", reason="ttft_slo", retry_after_s=1))
    assert "x-should-retry" not in later  # the SDKs' own rule (retry a 429) is right here
    _, _, overloaded = render(Overloaded("full"))
    assert overloaded["x-should-retry"] == "true"


class _Hopeless(BasePolicy):
    """Rejects every request as one that misses its TTFT SLO even on an idle cluster."""

    name = "hopeless"

    def __init__(self) -> None:
        self.decided = 0

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.decided += 1
        return Decision(
            request.request_id,
            self.name,
            rejection=Rejection(
                "ttft_slo",
                "predicted TTFT 9.00 s on an idle cluster exceeds the TTFT SLO of 1.00 s",
                9.0,
                1.0,
                retry_after_s=1.0,
                retryable=False,
            ),
        )


def test_openai_sdk_does_not_retry_a_hopeless_429() -> None:
    policy = _Hopeless()
    with cluster("nixl", policy=policy, models=["tiny"]) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=2)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        assert info.value.response.headers["x-should-retry"] == "false"
        assert info.value.code == "ttft_slo"
        assert policy.decided == 1  # one attempt reached the gateway, not 1 + max_retries
        client.close()
