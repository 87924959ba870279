"""vLLM's POST /v1/embeddings on the emulated engine.

The request (vLLM's EmbeddingCompletionRequest / EmbeddingChatRequest): `input` a string, a list of
strings, a list of token ids or a list of token-id lists (one embedding per prompt, as completions
prompts are read), or `messages` (one chat-templated prompt); `encoding_format` "float" (the
default) or "base64" (the float32 little-endian bytes, base64: what the openai SDK asks for and
decodes); `dimensions` (the emulated model answers as a matryoshka model does: the first
`dimensions` components, normalised again); `normalize` (default true: unit length).

Each prompt is one engine sequence of one forward pass (`pooling`: it takes a prefill step, hits and
fills the prefix cache like any prompt, and samples no token), so embeddings queue and take the
time the profile gives a prefill. The vector is a deterministic function of the tokens: the sum of
one pseudo-random row per token and one per adjacent pair (rows from SHAKE-256, the same in every
process), so inputs that share tokens point the same way.

The answer (vLLM's EmbeddingResponse): `{"id": "embd-...", "object": "list", "created", "model",
"data": [{"index", "object": "embedding", "embedding"}], "usage": {"prompt_tokens",
"total_tokens", "completion_tokens": 0, "prompt_tokens_details": null}}`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from adapters.emulator.asgi import Send, send_bytes
from adapters.emulator.legs import Leg, relay
from adapters.emulator.openai_format import ApiError, check_tokens, prompts_of, served_model_of
from conductor.core.tokenization import ByteTokenizer

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[list[int]]
    base64: bool
    dimensions: int  # components answered
    normalize: bool


def _dimensions(body: Mapping[str, Any], hidden_size: int) -> int:
    value = body.get("dimensions")
    if value is None:
        return hidden_size
    if type(value) is not int:
        raise ApiError(400, "dimensions must be an integer.", param="dimensions")
    if value < 1:
        raise ApiError(400, "Dimensions must be greater than 0", param="dimensions")
    if value > hidden_size:
        raise ApiError(400, f"dimensions must be at most the model's {hidden_size}, got {value}.", param="dimensions")
    return value


def _inputs(body: Mapping[str, Any], tokenizer: ByteTokenizer) -> list[list[int]]:
    if body.get("input") is None:
        messages = body.get("messages")
        if isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages):
            return [tokenizer.apply_chat_template(messages)]
        raise ApiError(400, "Provide `input` (a string, a list of strings or token ids) or `messages`.", param="input")
    return prompts_of(body["input"], tokenizer, "input")


def parse_embeddings(
    body: Any, *, tokenizer: ByteTokenizer, served_model: str, max_model_len: int, hidden_size: int
) -> EmbeddingRequest:
    model = served_model_of(body, served_model)
    inputs = _inputs(body, tokenizer)
    for tokens in inputs:
        check_tokens(tokens, tokenizer.vocab_size, "input")
        if len(tokens) > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(tokens)} tokens in the input for embedding generation. Please reduce the length of the input.",
                param="input",
            )
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be 'float' or 'base64'.", param="encoding_format")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise ApiError(400, "normalize must be a boolean.", param="normalize")
    return EmbeddingRequest(model, inputs, encoding == "base64", _dimensions(body, hidden_size), normalize is not False)


@functools.cache
def _rows(vocab: int, hidden_size: int) -> np.ndarray:
    """One row per token id, then one per (hashed) pair of adjacent ids: uniform in [-1, 1)."""
    out = np.empty((2 * vocab, hidden_size), dtype=np.float32)
    for i in range(2 * vocab):
        raw = hashlib.shake_256(b"emu-embedding:%d" % i).digest(hidden_size)
        out[i] = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 127.5) / 127.5
    return out


def embedding(tokens: list[int], vocab: int, hidden_size: int, dimensions: int, normalize: bool) -> np.ndarray:
    """The emulated model's vector for a prompt (float32, `dimensions` long)."""
    ids = np.asarray(tokens, dtype=np.int64)
    pairs = vocab + (ids[:-1] * 31 + ids[1:]) % vocab
    counts = np.bincount(np.concatenate([ids, pairs]), minlength=2 * vocab).astype(np.float32)
    vector = (counts @ _rows(vocab, hidden_size))[:dimensions] / len(tokens)
    if normalize:
        vector /= float(np.linalg.norm(vector)) or 1.0
    return vector.astype(np.float32)


def embeddings_body(req: EmbeddingRequest, response_id: str, created: int, vocab: int, hidden_size: int) -> bytes:
    data = []
    for i, tokens in enumerate(req.inputs):
        vector = embedding(tokens, vocab, hidden_size, req.dimensions, req.normalize)
        value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() if req.base64 else vector.tolist()
        data.append({"index": i, "object": "embedding", "embedding": value})
    prompt_tokens = sum(len(tokens) for tokens in req.inputs)
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": None}
    body = {"id": response_id, "object": "list", "created": created, "model": req.model, "data": data, "usage": usage}
    return _encode(body)


async def answer_embeddings(
    send: Send,
    legs: list[Leg],
    body: Callable[[], bytes],
    extra: list[tuple[bytes, bytes]],
    first_token: Callable[[Leg], None],
) -> None:
    """Wait for every prompt's forward pass, then answer `body()` (nothing if the client left)."""
    async with contextlib.aclosing(relay(legs, first_token)) as passes:
        async for _ in passes:
            pass
    if not any(leg.sequence.aborted for leg in legs):
        await send_bytes(send, 200, body(), headers=extra)
