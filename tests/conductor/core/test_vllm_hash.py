"""Golden vectors for conductor.core.vllm_hash.

Each expectation is computed here independently from the algorithm as vLLM documents it (hashlib,
pickle, cbor2 and xxhash called directly), and a few are pinned as literal hex so that a change in
any serialiser's output also shows up.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
import xxhash

from conductor.core.vllm_hash import (
    HASH_ALGOS,
    VllmBlockHasher,
    digest_to_event_id,
    hash_block_tokens,
    none_hash,
    seed_is_reproducible,
    worker_seed,
)

# Literal digests computed once from the vLLM algorithm (seed "vllm-none-hash", tokens 0..15 / 16..31).
NONE_SHA256_CBOR = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
NONE_SHA256 = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
CBOR_B0 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
CBOR_B1 = "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c"
PICKLE_B0 = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
XXCBOR_SEED42_B0 = "6efc8ab550d01924572df847da62bd96"
XXPICKLE_SEED42_B0 = "51c09bc039b52f38b3318efa733bdfca"


@pytest.fixture(autouse=True)
def _no_env_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def _independent(algo: str, seed: str, tokens: list[int], block: int) -> list[bytes]:
    def h(obj: object) -> bytes:
        data = cbor2.dumps(obj, canonical=True) if algo.endswith("cbor") else pickle.dumps(obj, protocol=5)
        return hashlib.sha256(data).digest() if algo.startswith("sha256") else xxhash.xxh3_128_digest(data)

    parent = h(seed)
    out = []
    for i in range(len(tokens) // block):
        parent = h((parent, tuple(tokens[i * block : (i + 1) * block]), None))
        out.append(parent)
    return out


def test_literal_vectors() -> None:
    assert none_hash("sha256_cbor").hex() == NONE_SHA256_CBOR
    assert none_hash("sha256").hex() == NONE_SHA256
    assert [d.hex() for d in VllmBlockHasher("sha256_cbor", 16).digests(list(range(40)))] == [CBOR_B0, CBOR_B1]
    assert VllmBlockHasher("sha256", 16).digests(list(range(16)))[0].hex() == PICKLE_B0
    assert VllmBlockHasher("xxhash_cbor", 16, seed="42").digests(list(range(16)))[0].hex() == XXCBOR_SEED42_B0
    assert VllmBlockHasher("xxhash", 16, seed="42").digests(list(range(16)))[0].hex() == XXPICKLE_SEED42_B0


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block", [1, 16, 32])
def test_matches_independent_computation(algo: str, block: int) -> None:
    tokens = [(i * 7919) % 50_000 for i in range(200)]
    hasher = VllmBlockHasher(algo, block, seed="1234")
    expected = _independent(algo, "1234", tokens, block)
    assert hasher.digests(tokens) == expected
    assert hasher.event_ids(tokens) == [int.from_bytes(d, "big") & (2**64 - 1) for d in expected]
    assert len(expected) == 200 // block


def test_chain_and_functional_api_agree() -> None:
    none = none_hash("sha256_cbor")
    b0 = hash_block_tokens("sha256_cbor", None, range(16), none=none)
    b1 = hash_block_tokens("sha256_cbor", b0, range(16, 32), none=none)
    assert (b0.hex(), b1.hex()) == (CBOR_B0, CBOR_B1)
    # An identical block under a different parent is a different block.
    assert hash_block_tokens("sha256_cbor", b0, range(16), none=none) != b0


def test_extra_keys_change_the_hash() -> None:
    none = none_hash("sha256_cbor")
    plain = hash_block_tokens("sha256_cbor", None, range(16), none=none)
    salted = hash_block_tokens("sha256_cbor", None, range(16), ("salt",), none=none)
    expected = hashlib.sha256(cbor2.dumps((none, tuple(range(16)), ("salt",)), canonical=True)).digest()
    assert salted == expected != plain


def test_seed_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    # xxhash without a seed is random per call (per process in vLLM), sha256 is fixed.
    assert none_hash("xxhash_cbor") != none_hash("xxhash_cbor")
    assert none_hash("sha256") == none_hash("sha256")
    assert not seed_is_reproducible("xxhash", None) and seed_is_reproducible("xxhash", "0")
    assert seed_is_reproducible("sha256_cbor", None)
    # this process's PYTHONHASHSEED is not the workers': an unset seed stays vLLM's default
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash("sha256_cbor").hex() == NONE_SHA256_CBOR
    assert VllmBlockHasher("sha256_cbor", 16).digests(list(range(40))) == [bytes.fromhex(CBOR_B0), bytes.fromhex(CBOR_B1)]
    assert none_hash("xxhash_cbor") != none_hash("xxhash_cbor")
    # an explicit seed is the workers' PYTHONHASHSEED
    assert none_hash("xxhash_cbor", seed="0") == xxhash.xxh3_128_digest(cbor2.dumps("0", canonical=True))
    assert none_hash("sha256_cbor", seed="0").hex() != NONE_SHA256_CBOR


def test_worker_seed_reads_the_given_environment_only() -> None:
    # what a stand-in worker (the emulator) does at start: its own environment, as vLLM does
    assert worker_seed(None, {"PYTHONHASHSEED": "7"}) == "7"
    assert worker_seed("3", {"PYTHONHASHSEED": "7"}) == "3"
    assert worker_seed(None, {}) is None


def test_event_id_is_low_64_bits_big_endian() -> None:
    assert digest_to_event_id(bytes.fromhex(CBOR_B0)) == 2233398808101521225
    assert digest_to_event_id(b"\x01" + b"\x00" * 7 + b"\xff" * 8) == 2**64 - 1


def test_partial_tail_and_bad_input() -> None:
    hasher = VllmBlockHasher("sha256_cbor", 16)
    assert hasher.digests(list(range(15))) == []
    assert len(hasher.digests(list(range(31)))) == 1
    with pytest.raises(ValueError):
        VllmBlockHasher("md5", 16)
    with pytest.raises(ValueError):
        VllmBlockHasher("sha256", 0)
