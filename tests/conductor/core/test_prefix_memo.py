"""The prefix memo gives exactly the scheme's own keys, reuses a shared prefix's strides, and
stays within its bound."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from conductor.core.block_keys import VllmKeys, XxhashKeys
from conductor.core.prefix_memo import PrefixMemo
from conductor.core.vllm_hash import VllmBlockHasher


def schemes() -> list[object]:
    return [
        XxhashKeys(16, seed=7),
        XxhashKeys(512),
        VllmKeys(16, "sha256", "0"),
        VllmKeys(16, "sha256_cbor", None),
        VllmKeys(32, "xxhash", "1"),
    ]


@pytest.mark.parametrize("scheme", schemes(), ids=lambda s: f"{type(s).__name__}-{s.block_size}")
def test_keys_equal_the_schemes_own_under_random_sharing_and_eviction(scheme: XxhashKeys | VllmKeys) -> None:
    rng = random.Random(3)
    memo = PrefixMemo(scheme, stride_tokens=64, max_entries=40)  # small: eviction happens all the time
    bases = [[rng.randrange(50_000) for _ in range(rng.randrange(0, 3000))] for _ in range(6)]
    for _ in range(60):
        base = rng.choice(bases)
        cut = rng.randrange(len(base) + 1)
        prompt = base[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(0, 400))]
        assert memo.keys(prompt) == scheme.keys(prompt)
        assert len(memo) <= 40
    assert memo.reused_blocks > 0 and memo.hashed_blocks > 0


def test_a_shared_prefix_is_hashed_once() -> None:
    scheme = VllmKeys(16, "sha256", "0")
    memo = PrefixMemo(scheme, stride_tokens=256)
    system = list(range(1000, 1000 + 4096))  # 16 strides, 256 blocks
    memo.keys(system + [1, 2, 3] * 100)
    hashed = memo.hashed_blocks
    second = system + [9] * 500
    assert memo.keys(second) == scheme.keys(second)
    assert memo.reused_blocks == 256  # the whole system prompt came from the memo
    assert memo.hashed_blocks - hashed == len(second) // 16 - 256  # only the new part was hashed


def test_a_prompt_that_differs_inside_a_stride_reuses_only_the_strides_before_it() -> None:
    scheme = XxhashKeys(16)
    memo = PrefixMemo(scheme, stride_tokens=256)
    first = list(range(2048))
    memo.keys(first)
    changed = list(first)
    changed[700] = 99_999  # inside the third stride
    assert memo.keys(changed) == scheme.keys(changed)
    assert memo.reused_blocks == 2 * 16


def test_ids_that_are_no_uint32_skip_the_memo_and_match_the_scheme() -> None:
    scheme = VllmKeys(16, "sha256", "0")
    memo = PrefixMemo(scheme, stride_tokens=16)
    ids = [2**40, *range(100)]  # vLLM hashes any int; the memo's byte digest cannot
    assert memo.keys(ids) == scheme.keys(ids)
    assert len(memo) == 0


def test_the_vllm_chain_resumes_from_a_full_digest() -> None:
    hasher = VllmBlockHasher("sha256_cbor", 16, None)
    ids = list(range(160))
    whole = hasher.digests(ids)
    assert hasher.digests(ids[64:], parent=whole[3]) == whole[4:]


def test_memory_per_entry_stays_under_400_bytes() -> None:
    memo = PrefixMemo(XxhashKeys(16), stride_tokens=256, max_entries=2000)
    rng = random.Random(5)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(100):  # 100 distinct 5,120-token prompts: 2,000 strides
        memo.keys([rng.randrange(150_000) for _ in range(5120)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(memo) == 2000
    assert used / len(memo) < 400, f"{used / len(memo):.0f} bytes per entry"  # the settings' sizing
