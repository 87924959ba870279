"""vLLM's prefix-cache block hashes, re-implemented without importing vLLM.

Facts read from vLLM main (`vllm/utils/hashing.py`, `vllm/v1/core/kv_cache_utils.py`):

- `--prefix-caching-hash-algo` picks one of four functions of a Python object:
  `sha256` = SHA-256 of `pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`,
  `sha256_cbor` = SHA-256 of `cbor2.dumps(obj, canonical=True)`,
  `xxhash` / `xxhash_cbor` = the same two serialisations hashed with XXH3-128 (16-byte digest).
- A block's hash is `H((parent_digest or NONE_HASH, tuple(block_token_ids), extra_keys))`; only full
  blocks are hashed, so a trailing partial block never has one.
- `NONE_HASH = H(seed)`: the seed is the *worker's* `PYTHONHASHSEED` when set; otherwise the fixed
  string `"vllm-none-hash"` for the cryptographic (sha256) algorithms, so separate processes agree,
  and fresh random bytes per process for the xxhash ones.
- KV events carry each hash, by default, as the low 64 bits of the digest read big-endian
  (`maybe_convert_block_hash`).

The seed is always passed in: `seed=None` means "the worker runs without PYTHONHASHSEED", never
"whatever this process happens to have in its environment". The gateway is not a vLLM worker, and a
PYTHONHASHSEED set for the gateway (and not for the workers) once made every key miss. Only a
process that stands in for a vLLM worker (the emulator) reads its own environment, through
`worker_seed`. Everything else here is pure, so the gateway's index and the emulated workers
compute the very same keys from the same inputs.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import xxhash

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

# vLLM's DEFAULT_NONE_HASH_SEED: used when PYTHONHASHSEED is unset and the algorithm is cryptographic.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_CRYPTO_ALGOS = frozenset({"sha256", "sha256_cbor"})
_LOW64 = (1 << 64) - 1


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


# algo -> (serialiser, digest); a constant table of pure functions, never mutated.
_ALGOS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickle, _xxh3_128),
    "xxhash_cbor": (_cbor, _xxh3_128),
}


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name(algo)`: object -> digest bytes."""
    try:
        serialise, digest = _ALGOS[algo]
    except KeyError:
        raise ValueError(f"unsupported hash algorithm {algo!r}; expected one of {HASH_ALGOS}") from None

    def fn(obj: Any) -> bytes:
        return digest(serialise(obj))

    return fn


def seed_is_reproducible(algo: str, seed: str | None) -> bool:
    """Whether another process can compute the hashes of a worker started with PYTHONHASHSEED=`seed`
    (None: unset). False only for the xxhash algorithms without a seed: vLLM draws NONE_HASH from
    os.urandom then, different in every worker process."""
    return seed is not None or algo in _CRYPTO_ALGOS


def resolve_seed(algo: str, seed: str | None = None) -> str:
    """The seed NONE_HASH derives from, for a worker whose PYTHONHASHSEED is `seed` (None: unset).

    Unset: vLLM's fixed DEFAULT_NONE_HASH_SEED for the sha256 algorithms; for the xxhash ones vLLM
    draws random bytes per process, and so do we, which means nobody outside that process can
    reproduce those hashes (`seed_is_reproducible` says so up front).
    """
    if algo not in _ALGOS:
        raise ValueError(f"unsupported hash algorithm {algo!r}; expected one of {HASH_ALGOS}")
    if seed is not None:
        return seed
    if algo in _CRYPTO_ALGOS:
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32).hex()


def worker_seed(seed: str | None, environ: Mapping[str, str]) -> str | None:
    """The seed a stand-in vLLM worker uses: its explicit seed, else PYTHONHASHSEED from its own
    environment (as vLLM reads it at engine start), else None (unset)."""
    return seed if seed is not None else environ.get("PYTHONHASHSEED")


def none_hash(algo: str, seed: str | None = None) -> bytes:
    """NONE_HASH, the parent of every chain's first block: `H(seed)` (see `resolve_seed`)."""
    return hash_function(algo)(resolve_seed(algo, seed))


def hash_block_tokens(
    algo: str,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    *,
    none: bytes,
) -> bytes:
    """One block's digest: `H((parent or none, tuple(token_ids), extra_keys))`, as vLLM computes it.

    `none` is the NONE_HASH to use for a first block (from `none_hash`); passing it explicitly keeps
    this function pure. vLLM tests `not parent`, so an empty parent also means "first block".
    """
    try:
        serialise, digest = _ALGOS[algo]
    except KeyError:
        raise ValueError(f"unsupported hash algorithm {algo!r}; expected one of {HASH_ALGOS}") from None
    return digest(serialise((parent or none, tuple(token_ids), extra_keys)))


def digest_to_event_id(digest: bytes) -> int:
    """The int a KV event carries for a digest: its low 64 bits, read big-endian."""
    return int.from_bytes(digest, "big") & _LOW64


class VllmBlockHasher:
    """Chains vLLM block hashes over a token sequence for one (algo, block_size, seed).

    NONE_HASH is resolved once at construction, as vLLM does at engine start.
    """

    def __init__(self, algo: str = "sha256_cbor", block_size: int = 16, seed: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.algo = algo
        self.block_size = block_size
        self.seed = resolve_seed(algo, seed)
        self.none = none_hash(algo, self.seed)
        self._serialise, self._digest = _ALGOS[algo]

    def digests(self, token_ids: Sequence[int], extra_keys: tuple | None = None, parent: bytes | None = None) -> list[bytes]:
        """Digests of the full blocks of `token_ids`, first block first (partial tail skipped);
        `parent`: the digest of the block before them (None: they start the prompt)."""
        size = self.block_size
        ids = tuple(token_ids)
        out: list[bytes] = []
        parent = parent or self.none
        serialise, digest = self._serialise, self._digest
        for start in range(0, len(ids) - size + 1, size):
            parent = digest(serialise((parent, ids[start : start + size], extra_keys)))
            out.append(parent)
        return out

    def event_ids(self, token_ids: Sequence[int], extra_keys: tuple | None = None) -> list[int]:
        """The same blocks as `digests`, as the 64-bit ints vLLM's KV events carry."""
        return [int.from_bytes(d, "big") & _LOW64 for d in self.digests(token_ids, extra_keys)]
