"""Block keys of prompts that share a prefix, hashed once per prefix.

Why: vLLM's block hashes (sha256 over a pickle or CBOR of each block, chained) cost 2.0-6.3 ms for
an 8K-token prompt in Python (`python benchmarks/bench_prefix_memo.py`), 10-30x everything else
the gateway spends on a request, and the prompts a KV-aware gateway exists for share long
prefixes: system prompts, agent loops, conversation history. The chain makes a block's key depend
on every token before it, so a prefix's keys are the same in every prompt that starts with it.

How: the prompt's token ids are cut into strides of `stride` tokens (a whole number of blocks).
One streaming xxh3_128 over the ids' bytes gives a digest of every stride-aligned prefix (a few
microseconds for 8K tokens: xxh3 reads ~10 GB/s). A stride's entry, filed under the digest of the
prefix it ends, holds that stride's block keys and the chain's state after it. A prompt whose
first k strides were seen before costs k look-ups, and only the rest is hashed, resumed from the
state after stride k; the strides it hashed are filed for the next prompt. A 128-bit digest of
the whole prefix makes a wrong hit (two different prefixes with one digest) vanishingly unlikely;
and a wrong key would cost a routing guess, never an answer: workers compute their own.

Bounded: at most `max_entries` strides (about 330 bytes each at 16-token blocks and 256-token
strides), evicted least recently used; the strides a hit uses are refreshed, so a hot system
prompt stays. Pure: no I/O, no event loop; one memo per scheme (its keys are that scheme's).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

from conductor.core.block_keys import ResumableKeys, as_u32_bytes

DEFAULT_STRIDE_TOKENS = 256
# ~11 MB at 16-token blocks (tests/conductor/core/test_prefix_memo.py holds an entry under 400 bytes)
DEFAULT_MAX_ENTRIES = 32_768


class PrefixMemo:
    """`keys(token_ids)` equal to `scheme.keys(token_ids)`, computed once per shared prefix."""

    def __init__(
        self, scheme: ResumableKeys, *, stride_tokens: int = DEFAULT_STRIDE_TOKENS, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        size = scheme.block_size
        self.scheme = scheme
        self.stride = max(size, -(-stride_tokens // size) * size)  # a whole number of blocks
        self.max_entries = max_entries
        # prefix digest -> (the stride's block keys as uint64 bytes, the chain's state after it), LRU
        # by dict order. Bytes, not tuples of ints: the garbage collector never walks them (a memo
        # of tuples cost ~4 us per filed stride in collections, measured)
        self._entries: dict[int, tuple[bytes, object]] = {}
        self.reused_blocks = 0  # blocks whose keys came from the memo
        self.hashed_blocks = 0  # blocks hashed by the scheme

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        size, stride = self.scheme.block_size, self.stride
        strides = len(token_ids) // stride
        ids_bytes = None
        if strides:
            try:
                ids_bytes = as_u32_bytes(token_ids)
            except (OverflowError, TypeError):  # ids that are no uint32: the scheme judges them itself
                pass
        if ids_bytes is None:  # shorter than a stride, or no byte form to digest: nothing to share
            keys = self.scheme.chain(None, token_ids)[0]
            self.hashed_blocks += len(keys)
            return keys
        digest = xxhash.xxh3_128()
        step = stride * 4
        prefixes: list[int] = []
        for off in range(0, strides * step, step):
            digest.update(ids_bytes[off : off + step])
            prefixes.append(digest.intdigest())
        entries = self._entries
        keys = []
        state: object | None = None
        known = 0
        for prefix in prefixes:
            entry = entries.pop(prefix, None)
            if entry is None:
                break
            entries[prefix] = entry  # used: now the most recent
            chunk = array("Q")
            chunk.frombytes(entry[0])
            keys.extend(chunk.tolist())
            state = entry[1]
            known += 1
        rest, states = self.scheme.chain(state, token_ids[known * stride :] if known else token_ids)
        per = stride // size
        packed = array("Q", rest).tobytes() if strides > known else b""
        width = per * 8
        for j in range(strides - known):
            entries[prefixes[known + j]] = (packed[j * width : (j + 1) * width], states[(j + 1) * per - 1])
        while len(entries) > self.max_entries:
            del entries[next(iter(entries))]
        self.reused_blocks += len(keys)
        self.hashed_blocks += len(rest)
        keys.extend(rest)
        return keys
