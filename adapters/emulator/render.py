"""The bytes of a completions or chat answer: SSE chunks per token, or the whole JSON.

Shapes follow vLLM's protocol.py as its OpenAI server serialises them (see openai_format.py). A
request of P prompts and n choices each has P * n choices, `index` prompt-major (prompt_idx * n +
i, as vLLM numbers them); each index's chunk head is encoded once, so a chunk without logprobs is
still three byte joins. With logprobs a chunk carries its token's (logprobs.py): chat `{"content":
[...]}`, completions the `logprobs` object whose `text_offset` continues across the choice's chunks.
A chat stream opens with one role chunk per choice (vLLM sends them all with the first output).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters.emulator.logprobs import chat_logprobs, completion_logprobs
from adapters.emulator.openai_format import WORD_JSON, generated_text, token_text, word_index

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice of a non-streamed answer: how many tokens, from which text seed."""

    seed: int
    n_tokens: int


class Renderer:
    """Bytes of one response; `logprobs`: the top logprobs per token (None: no logprobs asked)."""

    def __init__(
        self, chat: bool, response_id: str, created: int, model: str, n_choices: int = 1, logprobs: int | None = None
    ) -> None:
        self.chat = chat
        self.response_id = response_id
        self.created = created
        self.model = model
        self.logprobs = logprobs
        ident = _encode(response_id)
        mod = _encode(model)
        if chat:
            common = b'{"id":' + ident + b',"object":"chat.completion.chunk","created":%d,"model":' % created + mod
            opener = b',"delta":{"content":'
            self._close = b"}"  # the delta object
            tail = b',"finish_reason":null}]}\n\n'
        else:
            common = b'{"id":' + ident + b',"object":"text_completion","created":%d,"model":' % created + mod
            opener = b',"text":'
            self._close = b""
            tail = b',"finish_reason":null,"stop_reason":null}]}\n\n'
        last = b',"finish_reason":"length","stop_reason":null}]}\n\n'
        self._lp_tail, self._lp_last = tail, last
        self._tail = self._close + b',"logprobs":null' + tail
        self._last = self._close + b',"logprobs":null' + last
        self._heads = [b"data: " + common + b',"choices":[{"index":%d' % i + opener for i in range(n_choices)]
        self._common = common
        self._offsets = [0] * n_choices  # completions text_offset: characters streamed per choice

    def role_chunks(self) -> bytes:
        """Chat streams open with the assistant role and empty content, one chunk per choice."""
        return b"".join(
            b"data: "
            + self._common
            + b',"choices":[{"index":%d,"delta":{"role":"assistant","content":""},' % i
            + b'"logprobs":null,"finish_reason":null}]}\n\n'
            for i in range(len(self._heads))
        )

    def chunk(self, seed: int, k: int, last: bool, index: int = 0) -> bytes:
        word = WORD_JSON[word_index(seed, k)]
        if self.logprobs is None:
            return self._heads[index] + word + (self._last if last else self._tail)
        if self.chat:
            logprobs = chat_logprobs(seed, k, k + 1, self.logprobs)
        else:
            offset = self._offsets[index]
            self._offsets[index] = offset + len(token_text(seed, k))
            logprobs = completion_logprobs(seed, k, k + 1, self.logprobs, offset)
        end = self._lp_last if last else self._lp_tail
        return self._heads[index] + word + self._close + b',"logprobs":' + _encode(logprobs) + end

    def usage_chunk(self, use: Mapping[str, Any]) -> bytes:
        return b"data: " + self._common + b',"choices":[],"usage":' + _encode(use) + b"}\n\n"

    def _choice_logprobs(self, c: Choice) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(c.seed, 0, c.n_tokens, self.logprobs)
        return completion_logprobs(c.seed, 0, c.n_tokens, self.logprobs, 0)

    def _chat_choice(self, i: int, c: Choice) -> dict[str, Any]:
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
        return {
            "index": i,
            "message": message,
            "logprobs": self._choice_logprobs(c),
            "finish_reason": "length",
            "stop_reason": None,
        }

    def _text_choice(self, i: int, c: Choice) -> dict[str, Any]:
        return {
            "index": i,
            "text": generated_text(c.seed, c.n_tokens),
            "logprobs": self._choice_logprobs(c),
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }

    def full(self, choices: Sequence[Choice], use: Mapping[str, Any], kv_transfer_params: Any) -> bytes:
        """The non-streamed answer; `choices` in index order."""
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [(self._chat_choice if self.chat else self._text_choice)(i, c) for i, c in enumerate(choices)],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": use,
        }
        if self.chat:
            body["prompt_logprobs"] = None
        body["kv_transfer_params"] = kv_transfer_params
        return _encode(body)
