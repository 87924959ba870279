"""The official openai client works unchanged against the gateway, streamed and not, with usage."""

from __future__ import annotations

import openai
import pytest

from tests.support.cluster import cluster


@pytest.fixture(scope="module", params=["nixl", "mooncake", "sglang"])
def client(request):
    with cluster(request.param, standin={"prefill": {"cached_tokens": 4}, "decode": {"cached_tokens": 0}}) as c:
        yield openai.OpenAI(base_url=c.url + "/v1", api_key="sk-anything", max_retries=0, timeout=20), c


def test_completions_non_streamed(client) -> None:
    oa, _ = client
    r = oa.completions.create(model="tiny", prompt="Say hi", max_tokens=5)
    assert r.choices[0].text.strip()
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_completions_streamed_with_usage(client) -> None:
    oa, _ = client
    chunks = list(
        oa.completions.create(model="tiny", prompt="Say hi", max_tokens=6, stream=True, stream_options={"include_usage": True})
    )
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len(texts) == 6
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_chat_non_streamed(client) -> None:
    oa, _ = client
    r = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3)
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.total_tokens == r.usage.prompt_tokens + 3


def test_chat_streamed_with_usage(client) -> None:
    oa, _ = client
    stream = oa.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_streamed_without_usage_has_none(client) -> None:
    oa, _ = client
    chunks = list(
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True)
    )
    assert all(ch.usage is None for ch in chunks)


def test_models_listed(client) -> None:
    oa, _ = client
    assert [m.id for m in oa.models.list()] == ["tiny"]


def test_errors_surface_as_openai_exceptions(client) -> None:
    oa, _ = client
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model="tiny", prompt="x", max_tokens=0)
