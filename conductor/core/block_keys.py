"""Block keys: token ids cut into fixed-size blocks, each block named by a chained 64-bit hash.

Two schemes share one small protocol (`BlockKeyScheme`):

- `XxhashKeys` (the default): key_i = xxh3_64(tokens of block i as little-endian uint32, seed=key_{i-1}),
  with key_{-1} = the configured seed. Because each key seeds the next, two prompts share the keys
  of exactly their common leading full blocks and differ from the first block that holds a
  differing token onwards. The token ids are converted to bytes once and the chain walks a
  memoryview of them, so a 128K-token prompt costs about 1.5 ms at block size 16 and 0.6 ms at
  512 (see benchmarks/bench_index.py); the chain itself is inherently sequential.
- `VllmKeys`: vLLM's own block hashes (`conductor.core.vllm_hash`), as the low 64 bits its KV events
  carry. Index keys then equal event hashes, so events need no translation; this needs the
  workers' `--prefix-caching-hash-algo` and PYTHONHASHSEED to be known to the gateway.

Pure: no I/O, no event loop.
"""

from __future__ import annotations

import copy
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import xxhash

KeyMode = Literal["xxhash", "vllm"]

_MASK64 = (1 << 64) - 1


class BlockKeyScheme(Protocol):
    """Turns token ids into the chained keys of their full blocks."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    def keys(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Keys of the full blocks of `token_ids`, in order; a partial tail block gets none."""
        ...

    def extend(self, parent: int | None, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Keys of the full blocks of `token_ids` chained onto `parent` (None: start of a prompt)."""
        ...


class ResumableKeys(BlockKeyScheme, Protocol):
    """A scheme whose chain can resume after any block (what `conductor.core.prefix_memo` needs)."""

    def chain(self, state: object | None, token_ids: Sequence[int]) -> tuple[list[int], Sequence[object]]:
        """Keys of the full blocks of `token_ids` chained after `state` (None: the prompt's start),
        and the chain's state after each of those blocks, to resume from."""
        ...


def as_u32_bytes(token_ids: Sequence[int] | np.ndarray) -> memoryview:
    """The whole prompt as little-endian uint32 bytes, converted once.

    array('I') reads a Python list about 3x faster than numpy does (0.55 vs 1.8 ms for 128K ids);
    little-endian is pinned so that keys agree across hosts. An id outside uint32 raises
    OverflowError (TypeError for a non-integer).
    """
    if isinstance(token_ids, np.ndarray):
        return memoryview(token_ids.astype("<u4", copy=False).tobytes())
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # platforms whose C unsigned int is not 32 bits: fall back to numpy
        return memoryview(np.asarray(token_ids, dtype="<u4").tobytes())
    if sys.byteorder == "big":
        arr.byteswap()
    return memoryview(arr.tobytes())


@dataclass(frozen=True, slots=True)
class XxhashKeys:
    """Chained xxh3_64 keys over uint32 token ids.

    block_size: tokens per block; must equal the workers' block size for events to line up.
    seed: key of the (virtual) block before the first one; every gateway replica must agree.
    """

    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def keys(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        return self.extend(None, token_ids)

    def chain(self, state: object | None, token_ids: Sequence[int]) -> tuple[list[int], Sequence[object]]:
        """`ResumableKeys.chain`: the state after a block is its key."""
        keys = self.extend(state if isinstance(state, int) else None, token_ids)
        return keys, keys

    def extend(self, parent: int | None, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        buf = as_u32_bytes(token_ids)
        step = self.block_size * 4
        end = len(buf) - len(buf) % step
        h = xxhash.xxh3_64_intdigest  # local names: this loop is the hot path of every request
        key = (self.seed if parent is None else parent) & _MASK64
        out: list[int] = []
        append = out.append
        for off in range(0, end, step):
            key = h(buf[off : off + step], key)
            append(key)
        return out


class VllmKeys:
    """vLLM's block hashes (low 64 bits, as in its KV events), computed by `conductor.core.vllm_hash`.

    algo: vLLM's --prefix-caching-hash-algo (sha256, sha256_cbor, xxhash, xxhash_cbor).
    seed: the workers' PYTHONHASHSEED, or None when the workers run without one (vLLM's default
    none-hash seed for sha256*; for xxhash* unreproducible, see `vllm_hash.seed_is_reproducible`).
    Never this process's own PYTHONHASHSEED: the gateway is not a worker.
    extra_keys: what vLLM hashes into every block beside its tokens, the same for each block (a
    LoRA adapter's `(("lora", name, path),)`: conductor/core/adapter_keys.py); None: a plain prompt.
    """

    def __init__(
        self, block_size: int, algo: str = "sha256", seed: str | int | None = None, extra_keys: tuple | None = None
    ) -> None:
        # Imported here so that xxhash-mode users do not pay for (or depend on) the vLLM hasher.
        from conductor.core.vllm_hash import VllmBlockHasher

        self._block_size = block_size
        self.algo = algo
        self.seed = seed
        self.extra_keys = extra_keys
        self._hasher = VllmBlockHasher(algo, block_size, None if seed is None else str(seed))

    def with_extra_keys(self, extra_keys: tuple | None) -> VllmKeys:
        """The same hashes with `extra_keys` in every block (NONE_HASH shared, not derived again)."""
        other = copy.copy(self)
        other.extra_keys = extra_keys
        return other

    @property
    def block_size(self) -> int:
        return self._block_size

    def keys(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        return list(self._hasher.event_ids([int(t) for t in token_ids], self.extra_keys))

    def extend(self, parent: int | None, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        if parent is None:
            return self.keys(token_ids)
        # vLLM chains full digests, not their low 64 bits: a chain cannot resume from an event id.
        raise NotImplementedError("vLLM keys chain on full digests; recompute from the prompt start")

    def chain(self, state: object | None, token_ids: Sequence[int]) -> tuple[list[int], Sequence[object]]:
        """`ResumableKeys.chain`: the state after a block is its full digest (the chain's link)."""
        parent = state if isinstance(state, bytes) else None
        digests = self._hasher.digests([int(t) for t in token_ids], self.extra_keys, parent)
        return [int.from_bytes(d, "big") & _MASK64 for d in digests], digests

    def digests(self, token_ids: Sequence[int]) -> list[bytes]:
        """Full digests (what vLLM's MooncakeStoreConnector puts in object names, as hex)."""
        return list(self._hasher.digests([int(t) for t in token_ids], self.extra_keys))


def make_scheme(
    mode: KeyMode, block_size: int, *, seed: int = 0, algo: str = "sha256", vllm_seed: str | int | None = None
) -> BlockKeyScheme:
    """The scheme named by settings: "xxhash" (own keys) or "vllm" (vLLM's event hashes)."""
    if mode == "xxhash":
        return XxhashKeys(block_size=block_size, seed=seed)
    if mode == "vllm":
        return VllmKeys(block_size, algo, vllm_seed)
    raise ValueError(f"unknown key mode {mode!r}; expected 'xxhash' or 'vllm'")


def common_prefix_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two key lists share (keys are chained, so the first mismatch ends it)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
