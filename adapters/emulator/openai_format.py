"""vLLM's OpenAI-compatible request parsing and response shapes, pre-encoded for the token path.

Shapes follow vLLM's `protocol.py` as it serialises them (pydantic, `exclude_unset` for stream
chunks): completions `object: "text_completion"`, `choices[].text`; chat `object: "chat.completion"`
with `message`, chunks `"chat.completion.chunk"` with `delta` (the first chunk carries the role);
`finish_reason: "length"` on the chunk of the last token; with `stream_options.include_usage` a
final chunk with `choices: []` and `usage`; then `data: [DONE]`. Errors are vLLM's ErrorResponse:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from conductor.core.tokenization import ByteTokenizer

_encode = msgspec.json.Encoder().encode

# Deterministic filler: generated token k is WORDS[k % len(WORDS)].
WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " and", " then",
         " runs", " far", " away", " into", " woods")
_WORD_JSON = tuple(_encode(w) for w in WORDS)


def token_text(k: int) -> str:
    return WORDS[k % len(WORDS)]


def generated_text(n: int) -> str:
    return "".join(WORDS[k % len(WORDS)] for k in range(n))


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
    """A validated completion or chat request."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str


def _prompt_ids(value: Any, tokenizer: ByteTokenizer) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list):
        raise ApiError(400, "The emulator serves one prompt per request (a string or a list of token ids).",
                       param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids.", param="prompt")


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
        prompt = tokenizer.apply_chat_template(messages)
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        prompt = _prompt_ids(body["prompt"], tokenizer)
    if not prompt:
        raise ApiError(400, "Prompt cannot be empty.", param="prompt")
    vocab = tokenizer.vocab_size
    if any(t < 0 or t >= vocab for t in prompt):
        raise ApiError(400, f"Token id out of vocabulary (0..{vocab - 1}).", param="prompt")
    raw_max = body.get("max_completion_tokens") if chat else None
    if raw_max is None:
        raw_max = body.get("max_tokens")
    if raw_max is None:
        max_tokens = max(1, min(default_max_tokens, max_model_len - len(prompt)))
    elif not isinstance(raw_max, int) or isinstance(raw_max, bool):
        raise ApiError(400, "max_tokens must be an integer.", param="max_tokens")
    elif raw_max < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {raw_max}.", param="max_tokens")
    else:
        max_tokens = raw_max
    if len(prompt) + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "The emulator supports n=1 only.", param="n")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    return ParsedRequest(chat, prompt, max_tokens, stream, include_usage, model)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Renderer:
    """Bytes of one response: SSE chunks per token (pre-encoded head and tails) or the full JSON."""

    def __init__(self, chat: bool, response_id: str, created: int, model: str) -> None:
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.model = model
        ident = _encode(response_id)
        mod = _encode(model)
        if chat:
            common = b'{"id":' + ident + b',"object":"chat.completion.chunk","created":%d,"model":' % created + mod
            self._head = b"data: " + common + b',"choices":[{"index":0,"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            self._last = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        else:
            common = b'{"id":' + ident + b',"object":"text_completion","created":%d,"model":' % created + mod
            self._head = b"data: " + common + b',"choices":[{"index":0,"text":'
            self._tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self._last = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
        self._common = common

    def role_chunk(self) -> bytes:
        """Chat streams open with the assistant role and empty content."""
        return (b"data: " + self._common + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]}\n\n')

    def chunk(self, k: int, last: bool) -> bytes:
        return self._head + _WORD_JSON[k % len(_WORD_JSON)] + (self._last if last else self._tail)

    def usage_chunk(self, use: Mapping[str, Any]) -> bytes:
        return b"data: " + self._common + b',"choices":[],"usage":' + _encode(use) + b"}\n\n"

    def full(self, n_tokens: int, use: Mapping[str, Any], kv_transfer_params: Any) -> bytes:
        text = generated_text(n_tokens)
        finish = "length"
        base: dict[str, Any] = {"id": self.response_id, "created": self.created, "model": self.model}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "tool_calls": [], "reasoning_content": None}
            body = {"id": self.response_id, "object": "chat.completion", **base,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None}],
                    "service_tier": None, "system_fingerprint": None, "usage": use, "prompt_logprobs": None,
                    "kv_transfer_params": kv_transfer_params}
        else:
            body = {"id": self.response_id, "object": "text_completion", **base,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None, "prompt_logprobs": None}],
                    "service_tier": None, "system_fingerprint": None, "usage": use,
                    "kv_transfer_params": kv_transfer_params}
        return _encode(body)


DONE = b"data: [DONE]\n\n"


def tokenize_response(tokens: Sequence[int], max_model_len: int) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens), "token_strs": None}
