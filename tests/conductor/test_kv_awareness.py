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
from adapters.tokenizers import HFPromptTokenizer, HFTokenizer, WorkerTokenizer
from conductor.core.block_keys import XxhashKeys
from conductor.core.tokenization import ByteTokenizer
from conductor.core.types import CachedPrefix, Decision, Observation, Role
from conductor.kv_awareness import HashAgreement, KVAwareAnalyzer, build_analyzer
from tests.support.emulator import Emulator, start_emulator

WORDS = ["hello", "world", "the", "cache", "is", "warm", "a", "b", "c", "d"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face tokenizer directory: WordLevel vocabulary, BOS added, a chat template."""
    d = tmp_path_factory.mktemp("tok")
    specials = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": TEMPLATE}))
    return d


def test_hf_tokenizer_renders_and_encodes_like_vllm(hf_dir: Path) -> None:
    tok = HFTokenizer(hf_dir)
    assert tok.encode("hello world") == [1, 6, 7]  # text prompts get the BOS the post-processor adds
    msgs = [{"role": "system", "content": "the cache"},
            {"role": "user", "content": [{"type": "text", "text": "is"}, {"type": "text", "text": "warm"}]}]
    text = tok.render_chat(msgs)
    assert text == "<s><|system|>\nthe cache</s>\n<|user|>\nis\nwarm</s>\n<|assistant|>\n"
    # the template holds the BOS already: encoded without special tokens, as vLLM does
    assert tok.apply_chat_template(msgs) == [1, 3, 8, 9, 2, 4, 10, 11, 2, 5]


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


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    with start_emulator(role="mixed", kv_events=True, block_size=16, hash_algo="sha256_cbor", hash_seed="0",
                        time_scale=0.001) as emu:
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
    options = {"enabled": True, "tokenizer": "builtin", "block_size": 16, "key_mode": mode,
               "vllm_hash_algo": "sha256_cbor", "vllm_hash_seed": "0",
               "kv_events": {"m0": {"endpoint": f"tcp://*:{port}"}}}
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
                await client.post(f"{emulator.url}/v1/completions",
                                  json={"prompt": f"warm-up {time.monotonic()} " * 4, "max_tokens": 1})
                await asyncio.sleep(0.05)
            first = await analyzer.analyse("completions", {"prompt": prompt})
            assert first.cached == {} and first.forward_token_ids is not None
            await analyzer.on_dispatch(first, _decision("m0"))
            await bookkeeping.insert("m0", first.block_keys, confirmed=True)
            r = await client.post(f"{emulator.url}/v1/completions",
                                  json={"prompt": list(first.forward_token_ids), "max_tokens": 1})
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
            r = await client.post(f"{emulator.url}/v1/completions",
                                  json={"prompt": list(first.forward_token_ids), "max_tokens": 1})
            usage = r.json()["usage"]
            reported = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            analyzer.on_result(again, _decision("m0"), Observation(
                request_id="r", prefill="m0", decode=None, prompt_tokens=again.prompt_tokens,
                cached_tokens=reported, predicted_cached_tokens=blocks * 16, queue_and_prefill_s=None,
                ttft_s=None))
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
    with caplog.at_level(logging.WARNING, logger="conductor.kv_awareness"):
        for _ in range(50):  # a seed mismatch: predicted hits, workers see none
            agreement.observe(512, 0)
    assert agreement.alarmed
    assert registry.get_sample_value("conductor_kv_hash_agreement") == 0.0
    assert any("HASH AGREEMENT COLLAPSED" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    assert registry.get_sample_value("conductor_kv_predicted_cached_tokens_total") == 80 * 512


async def test_silent_unhealthy_instance_is_dropped(unused_tcp_port: int) -> None:
    options: dict[str, Any] = {"enabled": True, "events_silence_s": 0.2,
                               "kv_events": {"gone": {"endpoint": f"tcp://*:{unused_tcp_port}"}}}
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
    options = {"enabled": True, "index": "redis", "redis_prefix": prefix, "block_size": 16}
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
    options = {"enabled": True, "index": "redis", "redis_url": "redis://127.0.0.1:9/0"}
    analyzer = build_analyzer(options, [("p0", Role.PREFILL, "http://127.0.0.1:9")])
    try:
        a = await analyzer.analyse("completions", {"prompt": "y" * 100})
        assert a.exact and a.cached == {} and len(a.block_keys) == 6
        await analyzer.on_dispatch(a, _decision("p0"))  # must not raise either
    finally:
        await analyzer.close()
