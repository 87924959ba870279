"""A prompt longer than the model's context is a 400 before anything is forwarded, judged on its
size before it is tokenized (conductor/kv/prompt_bounds.py); a long prompt is analysed off the
event loop, which keeps answering /health meanwhile (conductor/kv/encoding.py). Real gateways in
front of stand-in workers on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.tokenizers import LocalTokenizer
from conductor.config.settings import load_settings
from conductor.core.block_keys import XxhashKeys
from conductor.core.errors import BadRequest
from conductor.core.tokenization import ByteTokenizer
from conductor.gateway import Gateway
from conductor.kv.analyzer import HashAgreement, KVAwareAnalyzer
from conductor.kv.prompt_bounds import DEFAULT_MAX_PROMPT_TOKENS, PromptBound
from tests.support.servers import ServerThread, serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

HANG_S = 60.0  # bounds that only a hang reaches


@dataclass
class ContextStandIn(StandIn):
    """A stand-in whose /v1/models says its context length, as vLLM's does (max_model_len)."""

    max_model_len: int = 512

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            body = json.dumps({"object": "list", "data": [card]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await super().__call__(scope, receive, send)


class GatedBytes(ByteTokenizer):
    """The built-in tokenizer, counting its calls and holding each until the test opens the gate:
    what shows where the analysis runs. On the event loop, the first call would hold the loop."""

    def __init__(self, *, open_gate: bool = False) -> None:
        self.entered = 0
        self._lock = threading.Lock()
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            self.entered += 1
        self.gate.wait(HANG_S)
        return super().encode(text)


def _analyzer(tokenizer: ByteTokenizer) -> KVAwareAnalyzer:
    scheme = XxhashKeys(16)
    index = MemoryIndex()
    return KVAwareAnalyzer(
        tokenizer=LocalTokenizer(tokenizer),
        scheme=scheme,
        index=index,
        feeder=IndexFeeder(index, scheme, translate=True),
        agreement=HashAgreement(CollectorRegistry()),
    )


@contextmanager
def _gateway(worker: StandIn, analyzer: KVAwareAnalyzer | None = None, **settings: Any) -> Iterator[tuple[ServerThread, Gateway]]:
    with serve(worker) as w:
        overrides = {"mixed": [w.url], "models": ["tiny"], "health": {"interval_s": 0.5}, **settings}
        gateway = Gateway(load_settings(environ={}, overrides=overrides), analyzer=analyzer)
        with serve_gateway(gateway) as server:
            yield server, gateway


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", "max_tokens": 2, **body}, timeout=HANG_S)


def _too_long(r: httpx.Response, param: str, *said: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    for text in said:
        assert text in error["message"], error["message"]


def test_the_workers_context_length_bounds_every_prompt_before_it_is_forwarded() -> None:
    worker = ContextStandIn(max_model_len=512)
    with _gateway(worker, kv={"enabled": True, "tokenizer": "builtin"}) as (server, gateway):
        assert wait_for(lambda: gateway.registry.context_length("tiny") == 512, HANG_S)
        assert _post(server.url, "/v1/completions", {"prompt": "x" * 512}).status_code == 200  # just fits
        forwarded = len(worker.requests)
        # too long by its characters alone (the byte tokenizer: a character is a token at least)
        _too_long(_post(server.url, "/v1/completions", {"prompt": "x" * 513}), "prompt", "512 tokens", "513 characters")
        _too_long(_post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}), "messages")
        # few enough characters, too many tokens once tokenized: two UTF-8 bytes each
        _too_long(_post(server.url, "/v1/completions", {"prompt": "é" * 300}), "prompt", "resulted in 600 tokens")
        _too_long(_post(server.url, "/v1/completions", {"prompt": [7] * 513}), "prompt", "513 tokens")
        _too_long(_post(server.url, "/v1/completions", {"prompt": ["x", "y" * 513]}), "prompt")  # each of a batch
        assert len(worker.requests) == forwarded  # none of them reached the worker


def test_the_setting_caps_what_the_workers_report_and_bounds_without_kv_awareness() -> None:
    worker = ContextStandIn(max_model_len=512)
    with _gateway(worker, limits={"max_prompt_tokens": 100}, kv={"enabled": False, "max_chars_per_token": 2}) as (
        server,
        gateway,
    ):
        assert wait_for(lambda: gateway.registry.context_length("tiny") == 512, HANG_S)
        # no tokenizer here: token ids are counted, a text judged on kv.max_chars_per_token alone
        _too_long(_post(server.url, "/v1/completions", {"prompt": [1] * 101}), "prompt", "100 tokens")
        _too_long(_post(server.url, "/v1/completions", {"prompt": "x" * 201}), "prompt", "201 characters")
        assert _post(server.url, "/v1/completions", {"prompt": "x" * 200}).status_code == 200
        assert _post(server.url, "/v1/completions", {"prompt": [1] * 100}).status_code == 200


def test_health_answers_while_four_maximal_prompts_are_being_tokenized() -> None:
    tokenizer = GatedBytes()
    with _gateway(StandIn(model="tiny"), _analyzer(tokenizer)) as (server, _), ThreadPoolExecutor(4) as pool:
        prompt = "x" * DEFAULT_MAX_PROMPT_TOKENS  # the longest the bound lets through: no worker reports one
        try:
            answers = [pool.submit(_post, server.url, "/v1/completions", {"prompt": prompt}) for _ in range(4)]
            # all four are in the tokenizer at once: none of them holds the event loop
            assert wait_for(lambda: tokenizer.entered == 4, HANG_S), f"{tokenizer.entered} of 4 reached the tokenizer"
            assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
            assert httpx.get(server.url + "/ready", timeout=HANG_S).status_code == 200
            assert not any(answer.done() for answer in answers)  # still held in the tokenizer
        finally:
            tokenizer.gate.set()
        assert [answer.result().status_code for answer in answers] == [200] * 4
        # one character more is refused by its length, without tokenizing it
        _too_long(_post(server.url, "/v1/completions", {"prompt": prompt + "x"}), "prompt", f"{DEFAULT_MAX_PROMPT_TOKENS} tokens")
        assert tokenizer.entered == 4


async def test_an_over_long_text_is_refused_before_it_is_tokenized() -> None:
    tokenizer = GatedBytes(open_gate=True)
    analyzer = _analyzer(tokenizer)
    analyzer.prompt_bound = PromptBound(max_prompt_tokens=64)
    with pytest.raises(BadRequest) as refused:
        await analyzer.analyse("completions", {"prompt": "x" * 65})
    assert refused.value.code == "context_length_exceeded" and tokenizer.entered == 0
    analysis = await analyzer.analyse("completions", {"prompt": "x" * 64})
    assert analysis.prompt_tokens == 64 and len(analysis.block_keys) == 4 and tokenizer.entered == 1


@pytest.mark.parametrize("size", [16, 40_000])  # the inline path and the threaded one
async def test_both_paths_key_alike(size: int) -> None:
    analyzer = _analyzer(ByteTokenizer())
    text = "ab" * (size // 2)
    analysis = await analyzer.analyse("completions", {"prompt": text})
    assert analysis.block_keys == tuple(analyzer.scheme.keys(list(text.encode())))
    assert analysis.forward_token_ids is not None and len(analysis.forward_token_ids) == size


def test_context_length_is_the_smallest_any_member_reports() -> None:
    small, large = ContextStandIn(max_model_len=256), ContextStandIn(max_model_len=4096)
    with serve(small) as a, serve(large) as b:
        gateway = Gateway(load_settings(environ={}, overrides={"mixed": [a.url, b.url], "models": ["tiny"]}))
        with serve_gateway(gateway):
            registry = gateway.registry
            assert wait_for(lambda: registry.context_length("tiny") == 256, HANG_S)
            assert registry.context_length("another") == 256  # named by none: the smallest of all
