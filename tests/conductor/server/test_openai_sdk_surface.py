"""The official openai SDK through the gateway in front of emulated vLLM workers (real
subprocesses): n > 1, logprobs, embeddings and the Responses API come back as the SDK expects, on
mixed workers and (n and logprobs) across a NIXL prefill/decode pair."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import openai
import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.servers import serve_gateway

pytestmark = pytest.mark.timeout(300)  # worker subprocesses and a gateway per topology
CHAT = [{"role": "user", "content": "hello there"}]


def _sdk(stack: ExitStack, **overrides: object) -> openai.OpenAI:
    settings = load_settings(environ={}, overrides=merge_settings({"health": {"interval_s": 1.0}}, overrides))
    server = stack.enter_context(serve_gateway(Gateway(settings)))
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module", params=["mixed", "nixl"])
def sdk(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    with ExitStack() as stack:
        if request.param == "mixed":
            workers = [stack.enter_context(start_emulator("mixed", time_scale=0.01, model="tiny")) for _ in range(2)]
            yield _sdk(stack, mixed=[w.url for w in workers])
        else:
            p = stack.enter_context(start_emulator("prefill", "nixl", time_scale=0.01, model="tiny"))
            d = stack.enter_context(start_emulator("decode", "nixl", time_scale=0.01, model="tiny"))
            yield _sdk(
                stack, prefill=[{"url": p.url, "bootstrap_port": p.bootstrap_port}], decode=[d.url], pd={"protocol": "nixl"}
            )


@pytest.fixture
def mixed_sdk(sdk: openai.OpenAI, request: pytest.FixtureRequest) -> openai.OpenAI:
    if request.node.callspec.params["sdk"] != "mixed":
        pytest.skip("embeddings and responses are served by mixed workers only")
    return sdk


def test_completions_n_and_batches(sdk: openai.OpenAI) -> None:
    r = sdk.completions.create(model="tiny", prompt="count with me", n=3, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    assert r.usage is not None and r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 13
    stream = sdk.completions.create(
        model="tiny", prompt=["first", "second"], n=2, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3] and all(len(t.split()) == 3 for t in texts.values())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_n_streamed_and_not(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and len((c.message.content or "").split()) == 3 for c in r.choices)
    stream = sdk.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=3, stream=True)
    contents: dict[int, str] = {}
    roles: set[int] = set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.add(choice.index)
            contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
    assert roles == {0, 1} and all(len(t.split()) == 3 for t in contents.values())


def test_logprobs_completions_and_chat(sdk: openai.OpenAI) -> None:
    r = sdk.completions.create(model="tiny", prompt="log me", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs is not None and all(v is not None and v < 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    chat = sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 3
    for entry in content.content:
        assert entry.logprob < 0 and entry.top_logprobs[0].token == entry.token
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
    stream = sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert len(streamed) == 3 and all(e.logprob < 0 for e in streamed)


def test_embeddings(mixed_sdk: openai.OpenAI) -> None:
    packed = mixed_sdk.embeddings.create(model="tiny", input=["alpha", "beta"])  # the SDK asks for base64
    floats = mixed_sdk.embeddings.create(model="tiny", input=["alpha", "beta"], encoding_format="float")
    assert [d.index for d in packed.data] == [0, 1] and len(packed.data[0].embedding) == 256
    for a, b in zip(packed.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert packed.usage.prompt_tokens == packed.usage.total_tokens == 9
    short = mixed_sdk.embeddings.create(model="tiny", input=[1, 2, 3], dimensions=16)
    assert len(short.data) == 1 and len(short.data[0].embedding) == 16


def test_responses_whole_and_streamed(mixed_sdk: openai.OpenAI) -> None:
    r = mixed_sdk.responses.create(model="tiny", input="say something", max_output_tokens=4)
    assert r.status == "completed" and len(r.output_text.split()) == 4
    assert r.usage is not None and r.usage.output_tokens == 4 and r.usage.input_tokens > 0
    events = list(mixed_sdk.responses.create(model="tiny", input="say something", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text == r.output_text
    with mixed_sdk.responses.stream(model="tiny", input="say something", max_output_tokens=4) as stream:
        final = stream.get_final_response()  # the SDK's own accumulation of the events
    assert final.output_text == r.output_text
    logged = mixed_sdk.responses.create(
        model="tiny", input="x", max_output_tokens=2, include=["message.output_text.logprobs"], top_logprobs=1
    )
    part = logged.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None and len(part.logprobs) == 2
