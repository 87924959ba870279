"""vLLM's OpenAI-compatible request parsing and response shapes, pre-encoded for the token path.

Shapes follow vLLM's `protocol.py` as it serialises them (pydantic, `exclude_unset` for stream
chunks): completions `object: "text_completion"`, `choices[].text`; chat `object: "chat.completion"`
with `message`, chunks `"chat.completion.chunk"` with `delta` (the first chunk carries the role);
`finish_reason: "length"` on the chunk of the last token; with `stream_options.include_usage` a
final chunk with `choices: []` and `usage`; then `data: [DONE]`. Errors are vLLM's ErrorResponse:
`{"error": {"message", "type", "param", "code"}}`.

Completions batches as vLLM's OpenAIServingCompletion answers them: a `prompt` that is a list of
strings or of token-id lists is one engine request per prompt; with `n` choices per prompt, choice
`index` is prompt_idx * n + i (prompt-major), stream chunks of all choices interleave, usage counts
each prompt's tokens once and every choice's completion tokens. The responses' bytes: render.py.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
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
WORD_JSON = tuple(_encode(w) for w in WORDS)
_MASK64 = (1 << 64) - 1
MAX_CHOICES = 128  # a bound of the emulator's (vLLM sets none): every choice is an engine sequence
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: a request asking more is a 400


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


def sample_seed(kv_seed: int, sample: int) -> int:
    """The text seed of choice `sample` of a prompt (n > 1): the first choice continues the KV as
    an n=1 request does; the others are other samples, so each has its own deterministic text."""
    if sample == 0:
        return kv_seed
    x = (kv_seed ^ (sample * 0xA24BAED4963EE407)) & _MASK64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _MASK64
    return x ^ (x >> 33)


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
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # top logprobs per token (0: the sampled token's only); None: none

    @property
    def batched(self) -> bool:
        return len(self.prompts) > 1


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def prompts_of(value: Any, tokenizer: ByteTokenizer, param: str = "prompt") -> list[list[int]]:
    """vLLM's completions `prompt` (and embeddings `input`): a string or a list of token ids is ONE
    prompt; a list of strings or a list of token-id lists is a batch (of one, when it has one element)."""
    if isinstance(value, str):
        return [tokenizer.encode(value)]
    if isinstance(value, list) and value and _is_token_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return [tokenizer.encode(p) for p in value]
    if isinstance(value, list) and value and all(_is_token_ids(p) for p in value):
        return [list(p) for p in value]
    if isinstance(value, list) and not value:
        raise ApiError(400, "Prompt cannot be empty.", param=param)
    raise ApiError(
        400, f"{param} must be a string, a list of token ids, a list of strings or a list of token-id lists.", param=param
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


def served_model_of(body: Any, served_model: str, adapters: Container[str] = ()) -> str:
    """The request's model, checked: a JSON object naming this instance's model, one of the LoRA
    `adapters` it holds, or none (the model)."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model") or served_model
    if model != served_model and (not isinstance(model, str) or model not in adapters):
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return str(model)


def check_tokens(tokens: Sequence[int], vocab: int, param: str) -> None:
    if not tokens:
        raise ApiError(400, "Prompt cannot be empty.", param=param)
    if any(t < 0 or t >= vocab for t in tokens):
        raise ApiError(400, f"Token id out of vocabulary (0..{vocab - 1}).", param=param)


def parse_request(
    chat: bool,
    body: Any,
    *,
    tokenizer: ByteTokenizer,
    served_model: str,
    max_model_len: int,
    default_max_tokens: int,
    adapters: Container[str] = (),
) -> ParsedRequest:
    model = served_model_of(body, served_model, adapters)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects.", param="messages")
        prompts = [tokenizer.apply_chat_template(messages)]
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        prompts = prompts_of(body["prompt"], tokenizer)
    for prompt in prompts:
        check_tokens(prompt, tokenizer.vocab_size, "prompt")
    raw_max = body.get("max_completion_tokens") if chat else None
    if raw_max is None:
        raw_max = body.get("max_tokens")
    max_tokens = [_max_tokens(raw_max, len(p), max_model_len, default_max_tokens) for p in prompts]
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    return ParsedRequest(chat, prompts, max_tokens, stream, include_usage, model, _choices(body), logprobs)


def priority_of(body: Mapping[str, Any], by_priority: bool) -> int:
    """vLLM's `priority` (lower first under the priority scheduling policy): an integer, and 0
    unless the engine schedules by priority (`by_priority`). vLLM's API documents a non-zero one as
    an error there and its V0 engine refused it with this message (a 400); vLLM 0.32's V1 engine
    ignores it instead. The emulator keeps to the documented rule so that a test sees a gateway
    that sends a priority where it must not."""
    priority = body.get("priority", 0)
    if type(priority) is not int:
        raise ApiError(400, "priority must be an integer", param="priority")
    if priority != 0 and not by_priority:
        raise ApiError(400, f"Got priority {priority} but Priority scheduling is not enabled.", param="priority")
    return priority


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise ApiError(400, f"{name} must be an integer.", param=name)
    return value


def _choices(body: Mapping[str, Any]) -> int:
    n = _integer(body, "n")
    if n is None:
        return 1
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.", param="n")
    if n > MAX_CHOICES:
        raise ApiError(400, f"n must be at most {MAX_CHOICES}, got {n}.", param="n")
    return n


def _top_bound(k: int, name: str) -> int:
    if k < 0:
        raise ApiError(400, f"`{name}` must be a positive value.", param=name)
    if k > MAX_LOGPROBS:
        raise ApiError(400, f"Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}", param=name)
    return k


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions `logprobs`: an integer k, the top k per token."""
    k = _integer(body, "logprobs")
    return None if k is None else _top_bound(k, "logprobs")


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat `logprobs: true` with `top_logprobs: k` (0 by default)."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "logprobs must be a boolean.", param="logprobs")
    top = _top_bound(_integer(body, "top_logprobs") or 0, "top_logprobs")
    if top and not wanted:
        raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    return top if wanted else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


DONE = b"data: [DONE]\n\n"


def tokenize_response(tokens: Sequence[int], max_model_len: int) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens), "token_strs": None}
