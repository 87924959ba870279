"""The emulator's pure parts: profile fit, prefix cache bookkeeping, P/D leg classification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.emulator.prefix_cache import PrefixCache
from adapters.emulator.profile import DEFAULT_CSV, fit_csv, load_profile
from adapters.emulator.protocols import PdProtocol, Role, plan_leg
from conductor.core.vllm_hash import VllmBlockHasher, digest_to_event_id


def test_default_profile_fits_the_published_table() -> None:
    profile = load_profile()
    for tokens, ttft_ms in [(128, 46.09), (1024, 67.29), (8192, 212.05), (32768, 749.62)]:
        assert profile.prefill_s(tokens) == pytest.approx(ttft_ms / 1000, rel=0.08)
    assert profile.kv_bytes_per_token == pytest.approx(147_500, rel=0.02)
    assert profile.transfer_s(8192) == pytest.approx(0.00884, rel=0.1)
    # Cached context makes new tokens dearer (attention), but far cheaper than recomputing it.
    assert profile.prefill_s(1024, 7168) > profile.prefill_s(1024, 0)
    assert profile.prefill_s(1024, 7168) < profile.prefill_s(8192, 0)
    assert profile.decode_step_s(10, 100_000) == pytest.approx(0.008 + 0.0015 + 0.02)


def test_profile_file_overrides_and_rejects_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({"prefill_base_s": 0.01, "prefill_per_token_s": 0.0, "prefill_quad_s": 0.0, "decode_base_s": 0.02})
    )
    profile = load_profile(path)
    assert profile.prefill_s(5000) == 0.01 and profile.decode_step_s(0, 0) == 0.02
    yaml_path = tmp_path / "p.yaml"
    yaml_path.write_text(f"calibrate_csv: {DEFAULT_CSV}\nmax_num_seqs: 8\n")
    assert load_profile(yaml_path).max_num_seqs == 8
    assert load_profile(yaml_path).prefill_base_s == pytest.approx(fit_csv(DEFAULT_CSV).prefill_base_s)
    path.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        load_profile(path)


def _cache(blocks: int) -> tuple[PrefixCache, VllmBlockHasher]:
    return PrefixCache(4, blocks * 4), VllmBlockHasher("sha256_cbor", 4, seed="t")


def test_cache_hit_insert_release_and_lru_tail_first() -> None:
    cache, hasher = _cache(4)
    a = hasher.digests(list(range(12)))  # 3 blocks
    held, changes = cache.insert(a, list(range(12)), 0)
    assert held == 3 and len(changes.stored) == 1 and changes.stored[0].parent_block_hash is None
    assert cache.used_blocks == 3 and cache.usage() == 0.75
    assert cache.hit_blocks(a, 13) == 3
    assert cache.hit_blocks(a, 12) == 2  # the last token is always computed
    cache.release(a)
    assert cache.used_blocks == 0 and len(cache) == 3
    b = hasher.digests(list(range(100, 108)))  # 2 new blocks: one eviction, a's tail goes first
    held, changes = cache.insert(b, list(range(100, 108)), 0)
    assert held == 2 and changes.removed == [digest_to_event_id(a[2])]
    assert cache.hit_blocks(a, 13) == 2


def test_cache_never_evicts_pinned_blocks() -> None:
    cache, hasher = _cache(2)
    a = hasher.digests(list(range(8)))
    cache.insert(a, list(range(8)), 0)
    b = hasher.digests(list(range(50, 58)))
    held, changes = cache.insert(b, list(range(50, 58)), 0)
    assert held == 0 and not changes.removed and not changes.stored
    assert cache.clear() == 2 and len(cache) == 0


def test_shared_prefix_splits_store_runs_with_parent() -> None:
    cache, hasher = _cache(8)
    base = list(range(8))
    d1 = hasher.digests(base)
    cache.insert(d1, base, 0)
    longer = [*base, 9, 9, 9, 9]
    d2 = hasher.digests(longer)
    hit = cache.hit_blocks(d2, len(longer) + 1)
    cache.acquire(d2[:hit])
    held, changes = cache.insert(d2, longer, hit)
    assert hit == 2 and held == 1
    (run,) = changes.stored
    assert run.parent_block_hash == digest_to_event_id(d1[1]) and run.token_ids == (9, 9, 9, 9)


@pytest.mark.parametrize(
    ("role", "protocol", "body", "expect"),
    [
        ("mixed", "nixl", {"kv_transfer_params": {"do_remote_decode": True}}, "plain"),
        ("prefill", "nixl", {"kv_transfer_params": {"do_remote_decode": True}}, "nixl_prefill"),
        (
            "decode",
            "nixl",
            {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_block_ids": [[1]],
                    "remote_engine_id": "e",
                    "remote_request_id": "r",
                    "remote_host": "h",
                    "remote_port": 1,
                }
            },
            "ready",
        ),
        ("decode", "nixl", {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": []}}, "plain"),
        ("prefill", "mooncake", {"kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"}}, "publish"),
        (
            "decode",
            "mooncake",
            {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "transfer_id": "t",
                    "remote_engine_id": "e",
                    "remote_bootstrap_addr": "http://h:1",
                }
            },
            "wait",
        ),
        ("decode", "mooncake", {"kv_transfer_params": {"do_remote_prefill": True}}, "plain"),
        ("prefill", "sglang", {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}, "publish"),
        ("decode", "sglang", {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}, "wait"),
    ],
)
def test_leg_classification(role: str, protocol: str, body: dict[str, object], expect: str) -> None:
    plan = plan_leg(Role(role), PdProtocol(protocol), body)
    got = (
        "nixl_prefill"
        if plan.nixl_prefill
        else "ready"
        if plan.remote_ready
        else "publish"
        if plan.publish_key
        else "wait"
        if plan.wait_url
        else "plain"
    )
    assert got == expect
    if expect == "wait":
        assert plan.wait_url is not None and plan.wait_url.startswith("http://h:1/emulator/transfer/")
