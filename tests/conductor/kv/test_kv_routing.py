"""KV-cache awareness end to end: the gateway tokenizes and keys the prompt, its index (fed by the
emulated workers' vLLM KV events) says where the prefix lives, and the KVCache-aware policy sends
the prompt to the instance that holds it.

The prefixes are computed on a worker straight from the client, bypassing the gateway: its own
dispatch record knows nothing of them, so only the worker's KV events can tell it where they are."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from tests.support.emulator import Emulator, join_kv_feeds, start_emulator
from tests.support.prom import scrape
from tests.support.servers import serve_gateway
from tests.support.waiting import wait_for

BLOCK = 16
# two prefixes of ~1,100 byte tokens (70 blocks), each planted on one worker: the second worker's
# first, so that a tie broken towards the first instance cannot pass for KV awareness
PLANTED = {1: "You are a helpful assistant. " * 40, 0: "You are a careful reviewer, terse and exact. " * 25}


def _requests(emu: Emulator) -> list[dict[str, object]]:
    return list(httpx.get(emu.url + "/emulator/requests", timeout=30).json())


def _plant(gateway_url: str, emu: Emulator, instance: str, prefix: str) -> None:
    """Compute `prefix` on `emu` directly, then wait until the gateway's index has its blocks from the events."""
    stored = scrape(gateway_url, "conductor_kv_events_blocks_stored_total", instance=instance)
    tokens = list((prefix + "Warm the cache.").encode())  # what the gateway's byte tokenizer makes of it
    r = httpx.post(emu.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": tokens, "max_tokens": 1})
    assert r.status_code == 200, r.text
    full_blocks = len(tokens) // BLOCK

    def indexed() -> bool:
        return scrape(gateway_url, "conductor_kv_events_blocks_stored_total", instance=instance) >= stored + full_blocks

    assert wait_for(indexed), f"the gateway never indexed {instance}'s {full_blocks} blocks"


@pytest.mark.parametrize("key_mode", ["xxhash", "vllm"])
def test_a_prefix_only_the_events_announced_goes_to_its_instance(key_mode: str) -> None:
    with ExitStack() as stack:
        worker: dict[str, Any] = {"time_scale": 0.05, "model": "tiny", "block_size": BLOCK, "hash_algo": "sha256_cbor"}
        emus = [stack.enter_context(start_emulator("mixed", kv_events=True, hash_seed="7", **worker)) for _ in range(2)]
        settings = load_settings(
            environ={},
            overrides={
                # as the workers were configured (tcp://*:PORT: they bind, the gateway connects)
                "mixed": [
                    {"url": e.url, "kv_events_endpoint": "tcp://*:" + str(e.kv_events_endpoint).rsplit(":", 1)[1]} for e in emus
                ],
                "policy": "kvcache_aware",
                "block_size": BLOCK,
                "kv": {
                    "enabled": True,
                    "key_mode": key_mode,
                    "vllm_hash_algo": "sha256_cbor",
                    "vllm_hash_seed": "7",
                    "forward_token_ids": True,
                },
            },
        )
        url = stack.enter_context(serve_gateway(Gateway(settings))).url
        names = {f"mixed-{i}": e for i, e in enumerate(emus)}
        join_kv_feeds(url, names)
        for i, prefix in PLANTED.items():
            _plant(url, emus[i], f"mixed-{i}", prefix)
        assert [len(_requests(e)) for e in emus] == [1, 1]

        expected = [1, 1]
        for i, prefix in PLANTED.items():
            prompt = prefix + "And now a question?"
            r = httpx.post(url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            expected[i] += 1
            assert [len(_requests(e)) for e in emus] == expected, f"the prompt planted on mixed-{i} went elsewhere"
            # the worker reused the planted prefix: every full block of it (the prompt goes on past it)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix.encode()) // BLOCK * BLOCK
            # the gateway forwarded token ids (tokenized once), not text
            body = _requests(emus[i])[-1]["body"]
            assert isinstance(body, dict) and body["prompt"] == list(prompt.encode())

        metrics = httpx.get(url + "/metrics", timeout=30).text
        agreement = next(line for line in metrics.splitlines() if line.startswith("conductor_kv_hash_agreement "))
        assert float(agreement.split()[1]) > 0.9  # what the index predicted cached, the workers reported
