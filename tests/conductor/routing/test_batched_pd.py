"""Batched prompts through the gateway in P/D answer exactly what one engine answers for the batch.

vLLM's prefill answer to a batch carries one kv_transfer_params (the first prompt's); the emulated
workers model that, so a gateway that sent the batch as one P/D exchange would give prompt 1 prompt
0's continuation. The gateway runs one exchange per prompt and merges them."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn

PROMPTS = ["hello world, this is prompt zero", "the cache holds prompt one here"]


def _gateway(stack: ExitStack, **overrides: object) -> str:
    gateway = Gateway(load_settings(environ={}, overrides=merge_settings({"health": {"interval_s": 1.0}}, overrides)))
    return stack.enter_context(serve_gateway(gateway)).url


def _texts_from_stream(text: str) -> tuple[list[str], dict[str, object] | None, int]:
    out = ["", ""]
    usage = None
    done = 0
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done += 1
            continue
        chunk = json.loads(data)
        for choice in chunk["choices"]:
            out[choice["index"]] += choice["text"]
        usage = chunk.get("usage") or usage
    return out, usage, done


@pytest.mark.parametrize("protocol", ["nixl", "mooncake"])
def test_batched_prompts_in_pd_equal_one_engine(protocol: str) -> None:
    with ExitStack() as stack:
        mixed = stack.enter_context(start_emulator("mixed", protocol, time_scale=0.01, model="tiny"))
        p = stack.enter_context(start_emulator("prefill", protocol, time_scale=0.01, model="tiny"))
        d = stack.enter_context(start_emulator("decode", protocol, time_scale=0.01, model="tiny"))
        url = _gateway(
            stack, prefill=[{"url": p.url, "bootstrap_port": p.bootstrap_port}], decode=[d.url], pd={"protocol": protocol}
        )
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 6}
        engine = httpx.post(mixed.url + "/v1/completions", json=body, timeout=30).json()
        through = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert through.status_code == 200, through.text
        got = through.json()
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in engine["choices"]]
        assert [c["index"] for c in got["choices"]] == [0, 1]
        assert got["usage"]["prompt_tokens"] == engine["usage"]["prompt_tokens"]
        assert got["usage"]["completion_tokens"] == engine["usage"]["completion_tokens"] == 12
        assert "kv_transfer_params" not in got
        # streamed, with usage: interleaved chunks, one usage chunk, one [DONE]
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        text = httpx.post(url + "/v1/completions", json=stream, timeout=30).text
        texts, usage, done = _texts_from_stream(text)
        assert texts == [c["text"] for c in engine["choices"]]
        assert usage is not None and usage["completion_tokens"] == 12 and done == 1
        # the prefill worker saw one single-prompt leg per prompt, each with its own id
        legs = httpx.get(p.url + "/emulator/requests").json()
        batch_legs = legs[-2:]
        for leg in batch_legs:
            prompt = leg["body"]["prompt"]
            assert isinstance(prompt, str) or all(isinstance(t, int) for t in prompt)  # one prompt per leg
        ids = {next(v for k, v in leg["headers"].items() if k.lower() == "x-request-id") for leg in batch_legs}
        assert len(ids) == 2


@dataclass
class ChoicesDecode(StandIn):
    """A decode that streams `n` choices per prompt as vLLM does (each token of every choice, choice
    indices 0..n-1), each choice's text naming its prompt and its own index."""

    async def _answer(self, send: Any, path: str, body: dict[str, Any], rid: str) -> None:
        n = body.get("n") or 1
        if not body.get("stream") or n == 1:
            return await super()._answer(send, path, body, rid)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(body.get("max_tokens") or 2):
            for j in range(n):
                choice = {"index": j, "text": f"{body['prompt']}/{j} ", "finish_reason": None}
                chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1, "model": self.model, "choices": [choice]}
                await send(
                    {"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n", "more_body": True}
                )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def test_streamed_batch_with_several_choices_numbers_every_choice_once() -> None:
    """Two prompts, n=2, streamed: choices 0, 1 are prompt 0's and 2, 3 prompt 1's, as one engine
    numbers them (index = prompt * n + choice). A merger that ignored n gave 0, 1, 1, 2."""
    with ExitStack() as stack:
        prefill = stack.enter_context(serve(StandIn(role="prefill")))
        decode = stack.enter_context(serve(ChoicesDecode(role="decode")))
        url = _gateway(stack, prefill=[{"url": prefill.url}], decode=[decode.url], pd={"protocol": "nixl"})
        body = {"model": "tiny", "prompt": ["p0", "p1"], "max_tokens": 3, "n": 2, "stream": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        texts: dict[int, str] = {}
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == {i * 2 + j: f"p{i}/{j} " * 3 for i in range(2) for j in range(2)}
