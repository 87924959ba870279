"""Deterministic logprobs of the emulator's generated tokens, in the three shapes vLLM serves.

Token k of a sequence whose text seed is `seed` is `WORDS[word_index(seed, k)]` (openai_format.py);
its logprobs come from the same (seed, k): the emulated model is confident but not certain, so the
sampled token gets a probability p0 in [0.4, 0.95], and the alternatives share the rest
geometrically (p_j = (1 - p0)(1 - r) r^j, r in [0.35, 0.6]). The probabilities never sum past 1,
each alternative is less likely than the one before, and the sampled token is the most likely (as
greedy decoding picks it), so it heads every top-k list. Alternatives are distinct words of
`VOCAB` other than the sampled one; `VOCAB` is large enough for vLLM's default `--max-logprobs` (openai_format.MAX_LOGPROBS).

Shapes (vLLM's protocol.py and serving_*.py):
- completions (`logprobs: k`, an integer): `{"text_offset", "token_logprobs", "tokens",
  "top_logprobs"}`, one entry per token; `top_logprobs[i]` maps token text to logprob for the k
  most likely tokens (the sampled one alone when k is 0); `text_offset` is each token's character
  offset in the choice's text, carried across stream chunks.
- chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [k x {"token", "logprob", "bytes"}]}]}`.
- Responses (`include: ["message.output_text.logprobs"]`, `top_logprobs: k`): the chat entries as a
  list; in a stream's text deltas without the `bytes`.
"""

from __future__ import annotations

import math
from typing import Any

from adapters.emulator.openai_format import WORDS, word_index

# the generated words first (a word's index is the same in both), then other plausible ones
VOCAB = (*WORDS, " it", " was", " not", " so", " very", " big", " old", " cat")
_OTHERS = len(VOCAB) - 1  # 23, a prime: stepping by _STEP visits every other word once
_STEP = 5
_MASK64 = (1 << 64) - 1


def _mix(seed: int, k: int) -> int:
    """64 well-spread bits from (seed, k), independent of the ones that chose the word."""
    x = (seed * 0xD6E8FEB86659FD93 + (k + 7) * 0x9E3779B97F4A7C15) & _MASK64
    x ^= x >> 32
    x = (x * 0xD6E8FEB86659FD93) & _MASK64
    x ^= x >> 29
    return x


def top_tokens(seed: int, k: int, top: int) -> list[tuple[str, float]]:
    """The `top` most likely tokens at position k (at least the sampled one), most likely first."""
    word = word_index(seed, k)
    bits = _mix(seed, k)
    p0 = 0.4 + 0.55 * (bits & 0xFFFF) / 0xFFFF
    ratio = 0.35 + 0.25 * ((bits >> 16) & 0xFFFF) / 0xFFFF
    shift = (bits >> 32) % _OTHERS
    out = [(WORDS[word], math.log(p0))]
    p = (1.0 - p0) * (1.0 - ratio)
    for j in range(max(top, 1) - 1):
        other = VOCAB[(word + 1 + (shift + j * _STEP) % _OTHERS) % len(VOCAB)]
        out.append((other, math.log(p)))
        p *= ratio
    return out


def sampled_logprob(seed: int, k: int) -> float:
    return top_tokens(seed, k, 1)[0][1]


def completion_logprobs(seed: int, start: int, end: int, top: int, text_offset: int) -> dict[str, Any]:
    """The completions `logprobs` object of tokens start..end-1; the first at `text_offset`."""
    offsets: list[int] = []
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    for k in range(start, end):
        ranked = top_tokens(seed, k, top)
        token, value = ranked[0]
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        values.append(value)
        tops.append(dict(ranked))
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def _entry(token: str, value: float, with_bytes: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"token": token, "logprob": value}
    if with_bytes:
        out["bytes"] = list(token.encode("utf-8"))
    return out


def token_entries(seed: int, start: int, end: int, top: int, *, with_bytes: bool = True) -> list[dict[str, Any]]:
    """Chat `logprobs.content` (and Responses `logprobs`) entries of tokens start..end-1."""
    out = []
    for k in range(start, end):
        ranked = top_tokens(seed, k, top)
        entry = _entry(*ranked[0], with_bytes)
        entry["top_logprobs"] = [_entry(t, v, with_bytes) for t, v in ranked[:top]]
        out.append(entry)
    return out


def chat_logprobs(seed: int, start: int, end: int, top: int) -> dict[str, Any]:
    return {"content": token_entries(seed, start, end, top)}
