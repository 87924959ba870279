"""vLLM's OpenAI-compatible request parsing and response shapes, pre-encoded for the token path.

Shapes follow vLLM's `protocol.py` as it serialises them (pydantic, `exclude_unset` for stream
chunks): completions `object: "text_completion"`, `choices[].text`; chat `object: "chat.completion"`
with `message`, chunks `"chat.completion.chunk"` with `delta` (the first chunk carries the role);
`finish_reason: "length"` on the chunk of the last token; with `stream_options.include_usage` a
final chunk with `choices: []` and `usage`; then `data: [DONE]`. Errors are vLLM's ErrorResponse:
`{"error": {"message", "type", "param", "code"}}`.

Completions batches as vLLM's OpenAIServingCompletion answers them: a `prompt` that is a list of
strings or of token-id lists is one engine request per prompt; choice i is prompt i (n=1), stream
chunks of all prompts interleave (each with its prompt's `index`), usage is summed over prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from conductor.core.tokenization import ByteTokenizer

_encode = msgspec.json.Encoder().encode

# The generated words. Token k of a sequence is WORDS[word_index(seed, k)], where `seed` is the
# content seed of the KV the sequence runs on (kv_content.py): the same prompt always gets the same
# continuation, and a decode given another prompt's KV visibly continues that other prompt.
WORDS = (
    " the",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " a",
    " lazy",
    " dog",
    " and",
    " then",
    " runs",
    " far",
    " away",
    " into",
    " woods",
)
_WORD_JSON = tuple(_encode(w) for w in WORDS)
_MASK64 = (1 << 64) - 1


def word_index(seed: int, k: int) -> int:
    """A splitmix64-style mix of (seed, k) onto the 16 words: cheap per token, well spread."""
    x = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    return (x >> 60) % len(WORDS)


def token_text(seed: int, k: int) -> str:
    return WORDS[word_index(seed, k)]


def generated_text(seed: int, n: int) -> str:
    return "".join(WORDS[word_index(seed, k)] for k in range(n))


class ApiError(Exception):
    """An error vLLM would answer with; rendered once, in `error_body`."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param


def error_body(err: ApiError) -> bytes:
    return _encode({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated completion or chat request: one or more prompts (a completions batch), each with
    its own output length (vLLM derives the default from each prompt's own length)."""

    chat: bool
    prompts: list[list[int]]
    max_tokens: list[int]
    stream: bool
    include_usage: bool
    model: str

    @property
    def batched(self) -> bool:
        return len(self.prompts) > 1


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(value: Any, tokenizer: ByteTokenizer) -> list[list[int]]:
    """vLLM's completions `prompt`: a string or a list of token ids is ONE prompt; a list of strings or
    a list of token-id lists is a batch (of one, when it has one element)."""
    if isinstance(value, str):
        return [tokenizer.encode(value)]
    if isinstance(value, list) and value and _is_token_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return [tokenizer.encode(p) for p in value]
    if isinstance(value, list) and value and all(_is_token_ids(p) for p in value):
        return [list(p) for p in value]
    if isinstance(value, list) and not value:
        raise ApiError(400, "Prompt cannot be empty.", param="prompt")
    raise ApiError(
        400, "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists.", param="prompt"
    )


def _max_tokens(raw_max: Any, prompt_len: int, max_model_len: int, default_max_tokens: int) -> int:
    if raw_max is None:
        max_tokens = max(1, min(default_max_tokens, max_model_len - prompt_len))
    elif not isinstance(raw_max, int) or isinstance(raw_max, bool):
        raise ApiError(400, "max_tokens must be an integer.", param="max_tokens")
    elif raw_max < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {raw_max}.", param="max_tokens")
    else:
        max_tokens = raw_max
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    return max_tokens


def parse_request(
    chat: bool,
    body: Any,
    *,
    tokenizer: ByteTokenizer,
    served_model: str,
    max_model_len: int,
    default_max_tokens: int,
) -> ParsedRequest:
    if not isinstance(body, Mapping):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model") or served_model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects.", param="messages")
        prompts = [tokenizer.apply_chat_template(messages)]
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        prompts = _prompts(body["prompt"], tokenizer)
    vocab = tokenizer.vocab_size
    for prompt in prompts:
        if not prompt:
            raise ApiError(400, "Prompt cannot be empty.", param="prompt")
        if any(t < 0 or t >= vocab for t in prompt):
            raise ApiError(400, f"Token id out of vocabulary (0..{vocab - 1}).", param="prompt")
    raw_max = body.get("max_completion_tokens") if chat else None
    if raw_max is None:
        raw_max = body.get("max_tokens")
    max_tokens = [_max_tokens(raw_max, len(p), max_model_len, default_max_tokens) for p in prompts]
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "The emulator supports n=1 only.", param="n")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    return ParsedRequest(chat, prompts, max_tokens, stream, include_usage, model)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished prompt of a non-streamed answer: how many tokens, from which content seed."""

    seed: int
    n_tokens: int


class Renderer:
    """Bytes of one response: SSE chunks per token (pre-encoded head and tails) or the full JSON.

    A completions batch of `n_prompts` renders choice `index` i for prompt i (vLLM's numbering with
    n=1); the per-index heads are encoded once, so a chunk is still three byte joins.
    """

    def __init__(self, chat: bool, response_id: str, created: int, model: str, n_prompts: int = 1) -> None:
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.model = model
        ident = _encode(response_id)
        mod = _encode(model)
        if chat:
            common = b'{"id":' + ident + b',"object":"chat.completion.chunk","created":%d,"model":' % created + mod
            opener = b',"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            self._last = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        else:
            common = b'{"id":' + ident + b',"object":"text_completion","created":%d,"model":' % created + mod
            opener = b',"text":'
            self._tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self._last = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        self._heads = [b"data: " + common + b',"choices":[{"index":%d' % i + opener for i in range(n_prompts)]
        self._common = common

    def role_chunk(self) -> bytes:
        """Chat streams open with the assistant role and empty content."""
        return (
            b"data: " + self._common + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def chunk(self, seed: int, k: int, last: bool, index: int = 0) -> bytes:
        return self._heads[index] + _WORD_JSON[word_index(seed, k)] + (self._last if last else self._tail)

    def usage_chunk(self, use: Mapping[str, Any]) -> bytes:
        return b"data: " + self._common + b',"choices":[],"usage":' + _encode(use) + b"}\n\n"

    def full(self, choices: Sequence[Choice], use: Mapping[str, Any], kv_transfer_params: Any) -> bytes:
        finish = "length"
        base: dict[str, Any] = {"id": self.response_id, "created": self.created, "model": self.model}
        if self.chat:
            out = []
            for i, c in enumerate(choices):
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": generated_text(c.seed, c.n_tokens),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                }
                out.append({"index": i, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None})
            body = {
                "id": self.response_id,
                "object": "chat.completion",
                **base,
                "choices": out,
                "service_tier": None,
                "system_fingerprint": None,
                "usage": use,
                "prompt_logprobs": None,
                "kv_transfer_params": kv_transfer_params,
            }
        else:
            out = [
                {
                    "index": i,
                    "text": generated_text(c.seed, c.n_tokens),
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
                for i, c in enumerate(choices)
            ]
            body = {
                "id": self.response_id,
                "object": "text_completion",
                **base,
                "choices": out,
                "service_tier": None,
                "system_fingerprint": None,
                "usage": use,
                "kv_transfer_params": kv_transfer_params,
            }
        return _encode(body)


DONE = b"data: [DONE]\n\n"


def tokenize_response(tokens: Sequence[int], max_model_len: int) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens), "token_strs": None}
