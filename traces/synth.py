"""Prompt synthesis: token ids for a trace request, so that shared hash ids mean shared prefixes.

Mooncake's traces carry no text, only `hash_ids`: equal ids name equal 512-token prompt blocks. To
replay a trace against real workers each request needs a concrete prompt whose prefix structure is
the trace's. Here every hash id maps to a deterministic block of token ids, and a prompt is its
blocks concatenated and cut to `input_length`, so:

* two requests whose `hash_ids` agree on the first k ids have identical first k blocks of tokens;
* where they first disagree, the prompts differ within the first few tokens of that block: a block
  starts with its hash id's little-endian bytes (4 of them when the block is that long), followed by
  a pseudo-random sequence seeded by (seed, hash id). Different ids below 2**32 therefore never
  produce equal blocks, whatever the random part does.

Token ids are in 0..255, the built-in ByteTokenizer's byte range (conductor.core.tokenization), so the
emulated workers and the gateway accept them and agree on their length.

Length scaling (`length_scale` f, 0 < f <= 1) lets a laptop replay a trace whose prompts average
14k tokens. Block structure is kept: the block size is scaled too (512 -> about 512 * f, rounded to a
multiple of `align`, the workers' KV block size, so a trace block is a whole number of KV blocks and
a shared trace block is a prefix-cache hit), each request keeps its number of blocks and the same
fill of its last block, and the output length is scaled by f (at least 1 token). A request whose
`input_length` runs past its blocks (not seen in Mooncake's traces) is padded with tokens unique to
that request, so the padding never looks shared.

Pure: numpy only, no I/O. Block sequences are memoised in a bounded LRU.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from traces.formats import TraceRequest

VOCAB = 256  # ByteTokenizer's plain-byte ids
_HEADER_BYTES = 4  # a block opens with its hash id's low 4 bytes
_PAD_DOMAIN = 1 << 40  # seeds for per-request padding live apart from hash-id seeds


@dataclass(frozen=True, slots=True)
class SynthRequest:
    """One synthesized request, ready to send."""

    arrival_s: float  # seconds from trace start, unscaled (the replayer divides by its speed-up)
    prompt: tuple[int, ...]  # token ids in 0..255
    max_tokens: int  # scaled output length, at least 1
    line: int  # the trace line it came from
    blocks: int  # trace blocks the prompt is made of (len(hash_ids), plus 1 if padded)


def scaled_block_tokens(block_tokens: int, length_scale: float, align: int = 16) -> int:
    """Block size after scaling: `block_tokens * length_scale`, rounded to a multiple of `align`
    (never below `align`, never above `block_tokens`)."""
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {length_scale}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if length_scale == 1 or block_tokens <= align:
        return block_tokens
    scaled = max(align, round(block_tokens * length_scale / align) * align)
    return min(block_tokens, scaled)


class PromptSynthesizer:
    """Deterministic prompts for trace requests; see the module docstring for the guarantees."""

    def __init__(self, length_scale: float = 1.0, *, seed: int = 0, align: int = 16, cache_blocks: int = 4096) -> None:
        if cache_blocks < 0:
            raise ValueError(f"cache_blocks must be >= 0, got {cache_blocks}")
        scaled_block_tokens(512, length_scale, align)  # validates both
        self.length_scale = length_scale
        self.seed = seed
        self.align = align
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cache_limit = cache_blocks  # a long trace has ~10^5 distinct ids: keep the hot ones

    @property
    def cached_blocks(self) -> int:
        """Blocks memoised now (at most `cache_blocks`)."""
        return len(self._cache)

    def block_tokens(self, req: TraceRequest) -> int:
        """Tokens per trace block for this request after scaling."""
        return scaled_block_tokens(req.block_tokens, self.length_scale, self.align)

    def input_length(self, req: TraceRequest) -> int:
        """Scaled prompt length: the same share of the same number of blocks."""
        if self.length_scale == 1:
            return req.input_length
        scaled = self.block_tokens(req)
        return max(1, math.ceil(req.input_length * scaled / req.block_tokens))

    def output_length(self, req: TraceRequest) -> int:
        """Scaled output length, at least one token."""
        return max(1, round(req.output_length * self.length_scale))

    def block(self, hash_id: int, size: int) -> np.ndarray:
        """The `size` token ids (uint8 values) of the block named `hash_id`."""
        key = (hash_id, size)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        out = _make_block(self.seed, hash_id, size)
        if self._cache_limit:
            self._cache[key] = out
            if len(self._cache) > self._cache_limit:
                self._cache.popitem(last=False)
        return out

    def prompt(self, req: TraceRequest) -> list[int]:
        """Token ids of the request's prompt, exactly `input_length(req)` of them."""
        size = self.block_tokens(req)
        need = self.input_length(req)
        parts: list[np.ndarray] = []
        have = 0
        for hash_id in req.hash_ids:
            if have >= need:
                break
            parts.append(self.block(hash_id, size))
            have += size
        if have < need:  # more tokens than blocks: pad with tokens no other request shares
            parts.append(_make_block(self.seed, _PAD_DOMAIN + req.line, need - have))
        ids = np.concatenate(parts)[:need] if parts else np.zeros(0, dtype=np.uint8)
        return ids.astype(np.int64).tolist()  # plain ints for JSON

    def synthesize(self, req: TraceRequest) -> SynthRequest:
        prompt = self.prompt(req)
        size = self.block_tokens(req)
        blocks = min(len(req.hash_ids), math.ceil(len(prompt) / size))
        if len(prompt) > len(req.hash_ids) * size:
            blocks += 1
        return SynthRequest(req.arrival_s, tuple(prompt), self.output_length(req), req.line, blocks)

    def synthesize_all(self, requests: Sequence[TraceRequest]) -> list[SynthRequest]:
        return [self.synthesize(r) for r in requests]


def _make_block(seed: int, hash_id: int, size: int) -> np.ndarray:
    header = np.frombuffer((hash_id & 0xFFFFFFFF).to_bytes(_HEADER_BYTES, "little"), dtype=np.uint8)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, hash_id & 0xFFFFFFFFFFFF, (hash_id >> 48) & 0xFFFFFFFFFFFF])
    body = rng.integers(0, VOCAB, size=max(0, size - _HEADER_BYTES), dtype=np.uint8)
    out = np.concatenate([header[:size], body])
    out.setflags(write=False)  # shared through the cache: nobody may edit it
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (for tests and diagnostics)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
