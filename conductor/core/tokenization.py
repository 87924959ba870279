"""Tokenizers the gateway and the emulated workers share.

The built-in tokenizer is byte-level: token id = UTF-8 byte value (0..255), plus a few special
tokens for the chat template. It needs no files, so the demo and the tests are exact and
self-contained; a real deployment points the gateway at a local Hugging Face tokenizer directory
(see `adapters/tokenizers.py`) or at a worker's /tokenize.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

BYTE_VOCAB = 256
SPECIAL_TOKENS = {"<|bos|>": 256, "<|system|>": 257, "<|user|>": 258, "<|assistant|>": 259, "<|end|>": 260}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def message_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # a part whose text is not a string (null, a number) adds nothing rather than failing
        return "".join(
            text for p in content if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(text := p.get("text"), str)
        )
    return ""


class ByteTokenizer:
    """UTF-8 bytes as token ids; chat messages framed by role tokens, ending with the assistant's."""

    vocab_size = BYTE_VOCAB + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        ids = [SPECIAL_TOKENS["<|bos|>"]]
        for message in messages:
            role_token = SPECIAL_TOKENS.get(f"<|{message.get('role', 'user')}|>", SPECIAL_TOKENS["<|user|>"])
            ids.append(role_token)
            ids.extend(message_text(message.get("content")).encode("utf-8"))
            ids.append(SPECIAL_TOKENS["<|end|>"])
        ids.append(SPECIAL_TOKENS["<|assistant|>"])
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")
