"""The KV-aware analyzer: tokenizers, keys, index and feeds wired together, against real parts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from adapters.index.memory import MemoryIndex
from adapters.tokenizers import HFPromptTokenizer, HFTokenizer, WorkerTokenizer, chat_template_arguments
from conductor.core.block_keys import XxhashKeys
from conductor.core.errors import BadRequest
from conductor.core.tokenization import ByteTokenizer
from conductor.core.types import CachedPrefix, Decision, Observation, Role
from conductor.core.vllm_hash import VllmBlockHasher
from conductor.kv.analyzer import HashAgreement, KVAwareAnalyzer, build_analyzer
from conductor.kv.prompt_bounds import PromptBound
from tests.support.emulator import Emulator, start_emulator

WORDS = ["hello", "world", "the", "cache", "is", "warm", "a", "b", "c", "d"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# renders tools and documents the way tool-calling templates do (Llama 3.1, Qwen 2.5, Hermes: tojson)
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n"
    "{% endif %}{% for d in documents or [] %}<|system|>\n{{ d['text'] }}</s>\n{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face tokenizer directory: WordLevel vocabulary, BOS added, a chat template."""
    return _tokenizer_dir(tmp_path_factory.mktemp("tok"), TEMPLATE)


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_dir(tmp_path_factory.mktemp("tools"), TOOLS_TEMPLATE)


def _tokenizer_dir(d: Path, template: str) -> Path:
    specials = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": template})
    )
    return d


def test_hf_tokenizer_renders_and_encodes_like_vllm(hf_dir: Path) -> None:
    tok = HFTokenizer(hf_dir)
    assert tok.encode("hello world") == [1, 6, 7]  # text prompts get the BOS the post-processor adds
    msgs = [
        {"role": "system", "content": "the cache"},
        {"role": "user", "content": [{"type": "text", "text": "is"}, {"type": "text", "text": "warm"}]},
    ]
    text = tok.render_chat(msgs)
    assert text == "<s><|system|>\nthe cache</s>\n<|user|>\nis\nwarm</s>\n<|assistant|>\n"
    # the template holds the BOS already: encoded without special tokens, as vLLM does
    assert tok.apply_chat_template(msgs) == [1, 3, 8, 9, 2, 4, 10, 11, 2, 5]


TOOL = {"type": "function", "function": {"name": "cache", "parameters": {"type": "object"}}}


async def test_chat_template_gets_the_requests_tools_documents_and_kwargs(tools_dir: Path) -> None:
    """What vLLM's chat endpoint hands the template; without the tools a tool-calling prompt is another prompt."""
    tok = HFPromptTokenizer(HFTokenizer(tools_dir))
    msgs = [{"role": "user", "content": "hello world"}]
    plain = await tok.encode_chat(msgs, {"messages": msgs})
    with_tools = await tok.encode_chat(msgs, {"messages": msgs, "tools": [TOOL]})
    assert with_tools[-len(plain) + 1 :] == plain[1:] and len(with_tools) > len(plain)  # same ending, longer start
    # vLLM dumps its tool model: the declared function fields are there, None when left out
    text = tok.hf.render_chat(msgs, **chat_template_arguments({"tools": [TOOL]}))
    assert '{"type": "function", "function": {"name": "cache", "description": null, "parameters": {"type": "object"}}}' in text
    docs = tok.hf.render_chat(msgs, **chat_template_arguments({"documents": [{"title": "t", "text": "the cache"}]}))
    assert docs.startswith("<s><|system|>\nthe cache</s>\n<|user|>")
    # chat_template_kwargs go on top, as in vLLM; add_generation_prompt from the body too
    assert not tok.hf.render_chat(
        msgs, **chat_template_arguments({"chat_template_kwargs": {"add_generation_prompt": False}})
    ).endswith("<|assistant|>\n")
    assert not tok.hf.render_chat(msgs, **chat_template_arguments({"add_generation_prompt": False})).endswith("<|assistant|>\n")
    # continue_final_message: the prompt ends inside the last message
    cont = [*msgs, {"role": "assistant", "content": "the cache is "}]
    text = tok.hf.render_chat(cont, **chat_template_arguments({"continue_final_message": True, "add_generation_prompt": False}))
    assert text.endswith("<|assistant|>\nthe cache is ")
    assert await tok.encode_chat(msgs, {"add_special_tokens": True}) == [1, *plain]  # BOS added once more


async def test_worker_tokenizer_passes_what_shapes_the_chat_prompt() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"tokens": [1, 2, 3], "count": 3, "max_model_len": 100})

    tok = WorkerTokenizer("http://w", client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    msgs = [{"role": "user", "content": "hi"}]
    body = {
        "model": "m",
        "tools": [TOOL],
        "documents": [{"text": "d"}],
        "chat_template_kwargs": {"x": 1},
        "add_generation_prompt": False,
        "temperature": 0.5,
    }
    assert await tok.encode_chat(msgs, body) == [1, 2, 3]
    assert seen[0] == {
        "messages": msgs,
        "add_generation_prompt": False,
        "model": "m",
        "tools": [TOOL],
        "documents": [{"text": "d"}],
        "chat_template_kwargs": {"x": 1},
    }


async def test_hf_prompt_tokenizer_and_analyzer_forward_token_ids(hf_dir: Path) -> None:
    scheme = XxhashKeys(2)
    analyzer = build_analyzer({"enabled": True, "tokenizer": str(hf_dir), "block_size": 2}, [])
    try:
        a = await analyzer.analyse("completions", {"prompt": "hello world the cache"})
        assert a.exact and a.prompt_tokens == 5 and a.forward_token_ids == (1, 6, 7, 8, 9)
        assert a.block_keys == tuple(scheme.keys([1, 6, 7, 8, 9]))
        plain = await analyzer.analyse("completions", {"prompt": "hello world", "add_special_tokens": False})
        assert plain.forward_token_ids == (6, 7)
        chat = await analyzer.analyse("chat", {"messages": [{"role": "user", "content": "hello"}]})
        assert chat.forward_token_ids is None and chat.prompt_tokens == 5  # <s> <|user|> hello </s> <|assistant|>
        batch = await analyzer.analyse("completions", {"prompt": ["a b", "c d"]})
        assert not batch.block_keys and not batch.exact  # batches are estimated, not keyed
        assert isinstance(HFPromptTokenizer(HFTokenizer(hf_dir)), HFPromptTokenizer)
    finally:
        await analyzer.close()


async def test_a_tokenizer_directory_bounds_prompts_by_its_longest_token(hf_dir: Path) -> None:
    """No token of this vocabulary stands for more than 13 characters ("<|assistant|>"): a text of
    more than 13 characters a token is refused untokenized; a shorter one on its token count."""
    options = {"enabled": True, "tokenizer": str(hf_dir), "block_size": 2}
    analyzer = build_analyzer(options, [], prompt_bound=PromptBound(max_prompt_tokens=4))
    assert isinstance(analyzer, KVAwareAnalyzer) and analyzer.chars_per_token == len("<|assistant|>")
    try:
        with pytest.raises(BadRequest, match="53 characters") as refused:
            await analyzer.analyse("completions", {"prompt": "hello " * 8 + "world"})
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")
        with pytest.raises(BadRequest, match="resulted in 5 tokens"):  # <s> hello world the cache
            await analyzer.analyse("completions", {"prompt": "hello world the cache"})
        with pytest.raises(BadRequest, match="resulted in 6 tokens") as refused:
            await analyzer.analyse("chat", {"messages": [{"role": "user", "content": "hello world"}]})
        assert refused.value.param == "messages"
        assert (await analyzer.analyse("completions", {"prompt": "hello world the"})).prompt_tokens == 4
        # long prompts are tokenized in a thread, by the same rules as inline
        long = build_analyzer(options, [])
        assert isinstance(long, KVAwareAnalyzer)
        text = " ".join(WORDS[i % len(WORDS)] for i in range(20_000))
        threaded = await long.analyse("completions", {"prompt": text})
        assert threaded.forward_token_ids == tuple(HFTokenizer(hf_dir).encode(text))
        chat = await long.analyse("chat", {"messages": [{"role": "user", "content": text}]})
        assert chat.prompt_tokens == len(HFTokenizer(hf_dir).apply_chat_template([{"role": "user", "content": text}]))
        await long.close()
    finally:
        await analyzer.close()


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    with start_emulator(
        role="mixed", kv_events=True, block_size=16, hash_algo="sha256_cbor", hash_seed="0", time_scale=0.001
    ) as emu:
        yield emu


async def test_worker_tokenizer_matches_the_builtin_tokenizer(emulator: Emulator) -> None:
    tok = WorkerTokenizer(emulator.url)
    try:
        assert await tok.encode_prompt("héllo") == ByteTokenizer().encode("héllo")
        msgs = [{"role": "user", "content": "hi"}]
        assert await tok.encode_chat(msgs, {}) == ByteTokenizer().apply_chat_template(msgs)
    finally:
        await tok.close()


def _decision(instance: str) -> Decision:
    return Decision(request_id="r", policy="test", prefill=instance)


@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
async def test_emulator_events_build_the_same_index_as_dispatches(emulator: Emulator, mode: str) -> None:
    assert emulator.kv_events_endpoint is not None
    port = emulator.kv_events_endpoint.rsplit(":", 1)[1]
    registry = CollectorRegistry()
    options = {
        "enabled": True,
        "tokenizer": "builtin",
        "block_size": 16,
        "key_mode": mode,
        "vllm_hash_algo": "sha256_cbor",
        "vllm_hash_seed": "0",
        "kv_events": {"m0": {"endpoint": f"tcp://*:{port}"}},
    }
    analyzer = build_analyzer(options, [("m0", Role.MIXED, emulator.url)], registry)
    assert isinstance(analyzer, KVAwareAnalyzer)
    bookkeeping = MemoryIndex()
    await analyzer.start()
    try:
        sub = analyzer.subscribers[0]
        prompt = f"{mode}: " + "the quick brown fox jumps over the lazy dog. " * 8 + "!"  # 23 blocks + a bit
        async with httpx.AsyncClient(timeout=10) as client:
            deadline = time.monotonic() + 10
            # ZMQ subscriptions take a moment; requests with fresh prompts until events arrive
            while sub.stats.batches == 0:
                assert time.monotonic() < deadline, "no KV events from the emulator"
                await client.post(
                    f"{emulator.url}/v1/completions", json={"prompt": f"warm-up {time.monotonic()} " * 4, "max_tokens": 1}
                )
                await asyncio.sleep(0.05)
            first = await analyzer.analyse("completions", {"prompt": prompt})
            assert first.cached == {} and first.forward_token_ids is not None
            await analyzer.on_dispatch(first, _decision("m0"))
            await bookkeeping.insert("m0", first.block_keys, confirmed=True)
            r = await client.post(
                f"{emulator.url}/v1/completions", json={"prompt": list(first.forward_token_ids), "max_tokens": 1}
            )
            assert r.status_code == 200
            blocks = len(first.block_keys)
            deadline = time.monotonic() + 10
            # dispatch entries are unconfirmed: confirmed ones can only have come from the events
            while (await analyzer.index.match(first.block_keys)).confirmed_blocks.get("m0") != blocks:
                assert time.monotonic() < deadline, f"events never covered the prompt: {analyzer.feeder.stats}"
                await asyncio.sleep(0.02)
            from_events = await analyzer.index.match(first.block_keys)
            assert from_events.blocks == (await bookkeeping.match(first.block_keys)).blocks == {"m0": blocks}
            assert from_events.confirmed_blocks == {"m0": blocks}
            again = await analyzer.analyse("completions", {"prompt": prompt})
            assert again.cached == {"m0": CachedPrefix(blocks * 16)}
            memo = analyzer.prefix_memo  # vllm mode remembers a prefix's hashes ("auto"); xxhash needs none
            if mode == "vllm":  # the second look-up's first 256 tokens came from it, equal to the events'
                assert memo is not None and memo.reused_blocks == 16
            else:
                assert memo is None
            r = await client.post(
                f"{emulator.url}/v1/completions", json={"prompt": list(first.forward_token_ids), "max_tokens": 1}
            )
            usage = r.json()["usage"]
            reported = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            analyzer.on_result(
                again,
                _decision("m0"),
                Observation(
                    request_id="r",
                    prefill="m0",
                    decode=None,
                    prompt_tokens=again.prompt_tokens,
                    cached_tokens=reported,
                    predicted_cached_tokens=blocks * 16,
                    queue_and_prefill_s=None,
                    ttft_s=None,
                ),
            )
            assert reported == blocks * 16
            assert registry.get_sample_value("conductor_kv_hash_agreement") == 1.0
    finally:
        await analyzer.close()


def test_hash_agreement_collapse_warns_loudly(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    agreement = HashAgreement(registry, window=50, min_samples=20, alarm_below=0.2)
    for _ in range(30):
        agreement.observe(512, 512)
    assert registry.get_sample_value("conductor_kv_hash_agreement") == 1.0
    with caplog.at_level(logging.WARNING, logger="conductor.kv"):
        for _ in range(50):  # a seed mismatch: predicted hits, workers see none
            agreement.observe(512, 0)
    assert agreement.alarmed
    assert registry.get_sample_value("conductor_kv_hash_agreement") == 0.0
    assert any("HASH AGREEMENT COLLAPSED" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    # no feed evidence and the built-in tokenizer: that is what the warning suspects
    assert agreement.alarm("", "over") == "tokenizer"
    assert registry.get_sample_value("conductor_kv_predicted_cached_tokens_total") == 80 * 512


async def test_silent_unhealthy_instance_is_dropped(unused_tcp_port: int) -> None:
    options: dict[str, Any] = {
        "enabled": True,
        "tokenizer": "builtin",
        "events_silence_s": 0.2,
        "kv_events": {"gone": {"endpoint": f"tcp://*:{unused_tcp_port}"}},
    }
    # nothing listens on the worker's HTTP port either: /health fails
    analyzer = build_analyzer(options, [("gone", Role.PREFILL, f"http://127.0.0.1:{unused_tcp_port}")])
    assert isinstance(analyzer, KVAwareAnalyzer)
    await analyzer.start()
    try:
        a = await analyzer.analyse("completions", {"prompt": "x" * 64})
        await analyzer.on_dispatch(a, _decision("gone"))
        assert (await analyzer.index.match(a.block_keys)).blocks == {"gone": 4}
        deadline = time.monotonic() + 5
        while (await analyzer.index.match(a.block_keys)).blocks:
            assert time.monotonic() < deadline, "silent, unhealthy instance was not dropped"
            await asyncio.sleep(0.05)
        assert analyzer.feeder.stats.cleared == 1
    finally:
        await analyzer.close()


async def test_redis_backed_analyzer_records_dispatches_for_other_replicas() -> None:
    prefix = f"test:kvaware:{time.monotonic_ns()}:"
    options = {
        "enabled": True,
        "tokenizer": "builtin",
        "index": "redis",
        "redis_prefix": prefix,
        "block_size": 16,
        "redis_timeout_s": 10.0,
        "redis_write_timeout_s": 10.0,
    }  # about content, not the 50 ms bound
    one = build_analyzer(options, [("p0", Role.PREFILL, "http://127.0.0.1:9")])
    two = build_analyzer(options, [("p0", Role.PREFILL, "http://127.0.0.1:9")])
    assert isinstance(one, KVAwareAnalyzer) and isinstance(two, KVAwareAnalyzer)
    try:
        body = {"prompt": "shared system prompt " * 10}
        a = await one.analyse("completions", body)
        await one.on_dispatch(a, _decision("p0"))
        await asyncio.gather(*one._pending)
        seen = await two.analyse("completions", body)  # another gateway replica, same Redis
        assert seen.cached == {"p0": CachedPrefix(len(a.block_keys) * 16)}
    finally:
        await one.index.clear()  # type: ignore[attr-defined]
        await one.close()
        await two.close()


async def test_index_down_degrades_to_no_cache_knowledge() -> None:
    # a real Redis client pointed at a port where nothing listens
    options = {"enabled": True, "tokenizer": "builtin", "index": "redis", "redis_url": "redis://127.0.0.1:9/0"}
    analyzer = build_analyzer(options, [("p0", Role.PREFILL, "http://127.0.0.1:9")])
    try:
        a = await analyzer.analyse("completions", {"prompt": "y" * 100})
        assert a.exact and a.cached == {} and len(a.block_keys) == 6
        await analyzer.on_dispatch(a, _decision("p0"))  # must not raise either
    finally:
        await analyzer.close()


async def test_gateway_never_takes_the_vllm_seed_from_its_own_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: PYTHONHASHSEED set for the gateway and not for the workers made 0 keys match."""
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    with caplog.at_level(logging.INFO, logger="conductor.kv"):
        analyzer = build_analyzer(
            {"enabled": True, "tokenizer": "builtin", "key_mode": "vllm", "vllm_hash_algo": "sha256_cbor"}, []
        )
    try:
        a = await analyzer.analyse("completions", {"prompt": "x" * 40})
        # the workers' keys when they run without PYTHONHASHSEED (vLLM's "vllm-none-hash" seed)
        expected = VllmBlockHasher("sha256_cbor", 16, "vllm-none-hash").event_ids(list(b"x" * 40))
        assert list(a.block_keys) == expected
        assert any("PYTHONHASHSEED=123 is NOT used" in r.getMessage() for r in caplog.records)
    finally:
        await analyzer.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="conductor.kv"):
        explicit = build_analyzer({"enabled": True, "tokenizer": "builtin", "key_mode": "vllm", "vllm_hash_algo": "xxhash"}, [])
        await explicit.close()
    assert any(r.getMessage().startswith("VLLM HASH SEED UNSET with kv.vllm_hash_algo 'xxhash'") for r in caplog.records)
