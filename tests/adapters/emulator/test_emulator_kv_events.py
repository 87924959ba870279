"""KV cache events as a vLLM subscriber sees them: decoded from the published wire format only."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import cbor2
import httpx
import msgspec
import pytest
import zmq

from tests.support.emulator import Emulator

BLOCK = 16


def vllm_event_ids(tokens: list[int]) -> list[int]:
    """sha256_cbor block hashes, low 64 bits, straight from vLLM's documented algorithm."""
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // BLOCK):
        block = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 for i in range(n)]


@pytest.fixture(autouse=True)
def _reset(mixed: Emulator) -> None:
    httpx.post(mixed.url + "/emulator/reset").raise_for_status()


def complete(emu: Emulator, tokens: list[int]) -> dict[str, Any]:
    r = httpx.post(emu.url + "/v1/completions", json={"prompt": tokens, "max_tokens": 2}, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def test_block_stored_wire_format_and_hashes(mixed: Emulator, subscriber: Any) -> None:
    sub = subscriber(mixed)
    tokens = prompt(1, 40)
    complete(mixed, tokens)
    batches = sub.batches(until=1)
    assert batches, "no KV event batch arrived"
    topic, seq, batch = batches[0]
    assert topic == b"" and seq >= 0
    ts, events, dp_rank = batch  # EventBatch is a msgpack array
    assert isinstance(ts, float) and dp_rank == 0
    (stored,) = events
    assert next(iter(stored)) == "type" and stored["type"] == "BlockStored"
    assert stored["block_hashes"] == vllm_event_ids(tokens)
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == tokens[:32]
    assert stored["block_size"] == BLOCK and stored["medium"] == "GPU"
    assert stored["lora_id"] is None and stored["lora_name"] is None


def test_shared_prefix_stores_only_new_blocks_with_parent(mixed: Emulator, subscriber: Any) -> None:
    sub = subscriber(mixed)
    base = prompt(2, 32)
    complete(mixed, base)
    longer = base + prompt(3, 20)
    body = complete(mixed, longer)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    events = [e for e in sub.events_until_reset(mixed) if e["type"] == "BlockStored"]
    assert len(events) == 2
    ids = vllm_event_ids(longer)
    assert events[1]["block_hashes"] == ids[2:3]
    assert events[1]["parent_block_hash"] == ids[1]
    assert events[1]["token_ids"] == longer[32:48]


def test_lru_eviction_emits_block_removed(mixed: Emulator, subscriber: Any) -> None:
    sub = subscriber(mixed)
    # Capacity is 1,024 tokens = 64 blocks; five distinct 16-block prompts overflow it by 16.
    prompts = [prompt(10 + k, 16 * BLOCK + 1) for k in range(5)]
    for p in prompts:
        complete(mixed, p)
    evicted = vllm_event_ids(prompts[0])
    removed: list[int] = []

    def all_removed(event: dict[str, Any]) -> bool:  # read up to the removal of the 16th block
        if event["type"] == "BlockRemoved":
            removed.extend(event["block_hashes"])
        return len(removed) >= len(evicted)

    events = sub.read_until(all_removed)  # no reset to end the read: the cache is checked below
    assert sorted(removed) == sorted(evicted)
    assert all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")
    # The evicted prefix is gone: its first request is a full miss again; the latest is still a hit.
    assert complete(mixed, prompts[0])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(mixed, prompts[4])["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * BLOCK


def test_reset_announces_all_blocks_cleared(mixed: Emulator, subscriber: Any) -> None:
    sub = subscriber(mixed)
    tokens = prompt(4, 33)
    complete(mixed, tokens)
    httpx.post(mixed.url + "/emulator/reset").raise_for_status()
    events = sub.read_until(lambda e: e["type"] == "AllBlocksCleared")
    assert [e["type"] for e in events] == ["BlockStored", "AllBlocksCleared"]
    assert complete(mixed, tokens)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_replay_socket_resends_missed_batches(mixed: Emulator) -> None:
    assert mixed.kv_events_replay_endpoint is not None
    complete(mixed, prompt(5, 20))
    ctx = zmq.Context()
    # DEALER, so that every reply of the stream is received (a REQ socket takes one reply per request).
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(mixed.kv_events_replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs, payloads = [], []
        while True:
            assert dealer.poll(3000), "replay did not answer"
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                assert payload == b""
                break
            seqs.append(int.from_bytes(seq_bytes, "big"))
            payloads.append(msgspec.msgpack.decode(payload))
    finally:
        dealer.close()
        ctx.term()
    assert seqs == sorted(seqs) and seqs[0] == 0
    kinds = [e["type"] for p in payloads for e in p[1]]
    assert "AllBlocksCleared" in kinds and "BlockStored" in kinds
