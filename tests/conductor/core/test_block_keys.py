"""Block keys: chained, prefix-sharing, and (in vllm mode) equal to vLLM's own event hashes."""

from __future__ import annotations

import hashlib
import pickle
import random

import cbor2
import numpy as np
import pytest
import xxhash

from conductor.core.block_keys import VllmKeys, XxhashKeys, common_prefix_blocks, make_scheme

LOW64 = (1 << 64) - 1


def test_keys_are_the_documented_xxh3_chain() -> None:
    tokens = list(range(40))
    keys = XxhashKeys(block_size=16, seed=5).keys(tokens)
    assert len(keys) == 2  # the 8-token tail is not a full block
    k0 = xxhash.xxh3_64_intdigest(np.arange(16, dtype="<u4").tobytes(), 5)
    k1 = xxhash.xxh3_64_intdigest(np.arange(16, 32, dtype="<u4").tobytes(), k0)
    assert keys == [k0, k1]
    assert XxhashKeys(16, seed=5).extend(k0, tokens[16:32]) == [k1]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_equal_prefixes_share_keys_and_differ_after_first_difference(block_size: int) -> None:
    rng = random.Random(block_size)
    scheme = XxhashKeys(block_size=block_size, seed=rng.randrange(1 << 32))
    for _ in range(200):
        n = rng.randrange(0, 12 * block_size)
        a = [rng.randrange(200_000) for _ in range(n)]
        b = list(a)
        if n and rng.random() < 0.8:
            pos = rng.randrange(n)
            b[pos] = (b[pos] + 1 + rng.randrange(1000)) % 200_000
            b = b[: rng.randrange(pos + 1, n + 1)]
        else:
            pos = n
        ka, kb = scheme.keys(a), scheme.keys(b)
        shared = min(pos // block_size, len(ka), len(kb))
        assert ka[:shared] == kb[:shared]
        assert common_prefix_blocks(ka, kb) == shared  # every key after the first difference differs
        assert len(set(ka[shared:]) & set(kb[shared:])) == 0


def test_numpy_and_list_inputs_agree_and_seed_matters() -> None:
    tokens = list(range(1000, 1064))
    s = XxhashKeys(16, seed=1)
    assert s.keys(tokens) == s.keys(np.array(tokens, dtype=np.int64))
    assert s.keys(tokens) != XxhashKeys(16, seed=2).keys(tokens)
    assert s.keys(tokens) != XxhashKeys(32, seed=1).keys(tokens)[:2]


def _golden_cbor(tokens: list[int], bs: int, seed: str) -> list[int]:
    """vLLM's sha256_cbor chain, computed here with hashlib and cbor2 only."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(0, len(tokens) - bs + 1, bs):
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i : i + bs]), None), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & LOW64)
    return out


def _golden_pickle(tokens: list[int], bs: int, seed: str) -> list[int]:
    parent = hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    out = []
    for i in range(0, len(tokens) - bs + 1, bs):
        obj = (parent, tuple(tokens[i : i + bs]), None)
        parent = hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(int.from_bytes(parent, "big") & LOW64)
    return out


def test_vllm_mode_keys_equal_independent_golden_vectors() -> None:
    tokens = [random.Random(3).randrange(32000) for _ in range(100)]
    assert VllmKeys(16, "sha256_cbor", "0").keys(tokens) == _golden_cbor(tokens, 16, "0")
    assert VllmKeys(32, "sha256", "1234").keys(tokens) == _golden_pickle(tokens, 32, "1234")
    assert VllmKeys(16, "sha256_cbor", "vllm-none-hash").keys(tokens) == _golden_cbor(tokens, 16, "vllm-none-hash")
    scheme = make_scheme("vllm", 16, algo="sha256_cbor", vllm_seed="0")
    assert scheme.keys(tokens) == _golden_cbor(tokens, 16, "0")
    with pytest.raises(ValueError):
        make_scheme("md5", 16)  # type: ignore[arg-type]
