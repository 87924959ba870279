"""KV-cache awareness end to end: the gateway tokenizes and keys the prompt, its index (fed by its
own dispatches and by the emulated workers' vLLM KV events) says where the prefix lives, and the
KVCache-aware policy sends a repeated prefix back to the instance that holds it."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.servers import serve_gateway


@pytest.mark.parametrize("key_mode", ["xxhash", "vllm"])
def test_repeated_prefix_goes_back_to_its_instance(key_mode: str) -> None:
    with ExitStack() as stack:
        emus = [
            stack.enter_context(
                start_emulator(
                    "mixed", kv_events=True, time_scale=0.05, model="tiny", block_size=16, hash_algo="sha256_cbor", hash_seed="7"
                )
            )
            for _ in range(2)
        ]
        settings = load_settings(
            environ={},
            overrides={
                # as the workers were configured (tcp://*:PORT: they bind, the gateway connects)
                "mixed": [
                    {"url": e.url, "kv_events_endpoint": "tcp://*:" + e.kv_events_endpoint.rsplit(":", 1)[1]} for e in emus
                ],
                "policy": "kvcache_aware",
                "block_size": 16,
                "kv": {
                    "enabled": True,
                    "key_mode": key_mode,
                    "vllm_hash_algo": "sha256_cbor",
                    "vllm_hash_seed": "7",
                    "forward_token_ids": True,
                },
            },
        )
        gateway = Gateway(settings)
        url = stack.enter_context(serve_gateway(gateway)).url
        shared = "You are a helpful assistant. " * 40  # ~1,100 byte tokens: 70 blocks
        prompts = [shared + "First question?", shared + "A different, second question?"]
        served_by = []
        cached = []
        for prompt in prompts:
            r = httpx.post(url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            served_by.append([len(httpx.get(e.url + "/emulator/requests").json()) for e in emus])
            time.sleep(0.3)  # let the KV events arrive
        first = served_by[0].index(1)
        assert served_by[1][first] == 2, f"second request went elsewhere: {served_by}"
        assert cached[0] == 0 and cached[1] >= len(shared.encode()) // 16 * 16 - 16
        # the gateway forwarded token ids (tokenized once), not text
        body = httpx.get(emus[first].url + "/emulator/requests").json()[-1]["body"]
        assert isinstance(body["prompt"], list) and body["prompt"][: len(shared)] == list(shared.encode())
        metrics = httpx.get(url + "/metrics").text
        agreement = next(line for line in metrics.splitlines() if line.startswith("conductor_kv_hash_agreement "))
        assert float(agreement.split()[1]) > 0.9
