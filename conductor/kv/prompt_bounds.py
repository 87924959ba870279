"""How long a prompt may be, checked before the gateway does any work per token.

A prompt longer than the model's context is refused by every worker, so the gateway refuses it
first, as an OpenAI-style 400 (`context_length_exceeded`, param `prompt` or `messages`), and
before anything is forwarded. The limit (`PromptBound.limit`) is the context length the workers
report for the model (`max_model_len` in their /v1/models answers, the smallest of them: a request
may land on any), capped by the `limits.max_prompt_tokens` setting; 131,072 when neither says.

Two checks, cheapest first:

1. Before tokenizing, on the characters alone (`check_prompt_size`): one token stands for at most
   `chars_per_token` characters (the built-in byte tokenizer: 1, a UTF-8 character being at least
   one byte and so at least one token; a tokenizer directory: its longest vocabulary entry), so a
   text of more than limit x chars_per_token characters has more than `limit` tokens, whatever
   it says. Refused without tokenizing it, keying it or looking it up. Prompts given as token ids
   are counted exactly here. Each prompt of a batch is a sequence of its own and is checked alone.
2. After tokenizing, on the exact count (`check_token_count`), before the block keys are computed.

The characters counted are the prompt's text (a chat's: its messages' text); a chat template adds
to it, and only a template that drops text could make the first check refuse what would fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from conductor.core.errors import BadRequest

DEFAULT_MAX_PROMPT_TOKENS = 131_072
CODE = "context_length_exceeded"

# the model a request names -> the smallest context length its workers report, None when none does
ContextLength = Callable[[str | None], int | None]


@dataclass(frozen=True, slots=True)
class PromptBound:
    """The most tokens a prompt may have: what the workers report, capped by the setting."""

    max_prompt_tokens: int | None = None  # limits.max_prompt_tokens
    context_length: ContextLength | None = None  # the instance registry's, read per request

    def limit(self, model: str | None) -> int:
        reported = self.context_length(model) if self.context_length is not None else None
        setting = self.max_prompt_tokens
        if reported is None:
            return DEFAULT_MAX_PROMPT_TOKENS if setting is None else setting
        return reported if setting is None else min(setting, reported)


def _param(kind: str) -> str:
    # kind: a conductor.kv.analysis.RequestKind (that module imports this one)
    return "messages" if kind == "chat" else "prompt"


def _content_chars(content: Any) -> int:
    """Characters of a message's text, as `conductor.core.tokenization.message_text` reads it,
    counted without joining them."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    texts = (p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return sum(len(text) for text in texts if isinstance(text, str))


def _prompt_sizes(kind: str, body: Mapping[str, Any]) -> Iterator[tuple[int, bool]]:
    """(size, exact) of each sequence the request asks for: token ids counted exactly, or characters."""
    if kind == "chat":
        messages = body.get("messages")
        if isinstance(messages, list):
            yield sum(_content_chars(m.get("content")) for m in messages if isinstance(m, Mapping)), False
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield len(prompt), False
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        yield len(prompt), True  # one prompt as token ids
    elif isinstance(prompt, list):
        for one in prompt:  # a batch: each prompt is a sequence of its own
            if isinstance(one, str):
                yield len(one), False
            elif isinstance(one, list):
                yield len(one), True


def context_length_exceeded(kind: str, limit: int, detail: str) -> BadRequest:
    return BadRequest(
        f"This model's maximum context length is {limit} tokens. However, {detail}. "
        f"Please reduce the length of the {_param(kind)}.",
        param=_param(kind),
        code=CODE,
    )


def check_prompt_size(kind: str, body: Mapping[str, Any], limit: int, chars_per_token: int | None) -> int:
    """400 when a prompt is longer than `limit` tokens by its size alone (see the module docstring);
    `chars_per_token` None: characters are not judged. Returns the request's size (characters and
    token ids), by which the analysis decides whether to run off the event loop."""
    prompt = body.get("prompt") if kind != "chat" else None
    if type(prompt) is str and (chars_per_token is None or len(prompt) <= limit * chars_per_token):
        return len(prompt)  # the usual case: one text prompt within its bound
    total = 0
    for size, exact in _prompt_sizes(kind, body):
        total += size
        if exact and size > limit:
            raise context_length_exceeded(kind, limit, f"your prompt has {size} tokens")
        if not exact and chars_per_token is not None and size > limit * chars_per_token:
            raise context_length_exceeded(
                kind,
                limit,
                f"the {_param(kind)} {'hold' if kind == 'chat' else 'holds'} {size} characters, more than "
                f"{limit} tokens can hold (a token stands for {chars_per_token} characters at most)",
            )
    return total


def check_token_count(kind: str, tokens: int, limit: int) -> None:
    """400 when the tokenized prompt has more than `limit` tokens."""
    if tokens > limit:
        raise context_length_exceeded(kind, limit, f"your {_param(kind)} resulted in {tokens} tokens")
