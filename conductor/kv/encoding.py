"""A request's token ids and block keys, computed off the event loop when the prompt is long (and
the tokenizer the settings name, `make_tokenizer`).

Tokenizing, keying (a SHA-256 per block in vllm key mode) and the Mooncake Store's hashes all cost
time in proportion to the prompt. Under `OFFLOAD_SIZE` characters or token ids they run inline:
a thread hop costs more than they do. Above it they run in a thread (`asyncio.to_thread`), so the
event loop keeps serving /health and every other request while a long prompt is worked on; a
worker's /tokenize is awaited as before (it is I/O), the keys of its answer computed in a thread.

The tokenizers the gateway computes with itself (the built-in byte tokenizer, a Hugging Face
directory) are pure functions of their input and safe to call from threads. The prefix memo
(`conductor.core.prefix_memo`) is not: it is used under a lock, which the event loop never waits
for. When a thread holds it the loop keys its prompt without the memo (same keys, by the memo's
contract), rather than stalling behind a long prompt.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from adapters.auto_tokenizer import AutoTokenizer
from adapters.tokenizers import (
    HFPromptTokenizer,
    HFTokenizer,
    LocalTokenizer,
    PromptTokenizer,
    WorkerTokenizer,
    chat_template_arguments,
)
from conductor.config.kv import KVAwarenessSettings
from conductor.core.adapter_keys import AdapterSchemes
from conductor.core.block_keys import BlockKeyScheme, VllmKeys
from conductor.core.errors import ConfigError
from conductor.core.models import AdapterCard
from conductor.core.prefix_memo import PrefixMemo
from conductor.core.tokenization import ByteTokenizer
from conductor.core.types import Role
from conductor.kv.analysis import RequestKind

OFFLOAD_SIZE = 32 * 1024  # characters of text or token ids: beyond this, milliseconds of work
# the most characters one token stands for, when the tokenizer does not tell (a worker's /tokenize)
UNKNOWN_CHARS_PER_TOKEN = 32

TokenIds = tuple[list[int] | None, bool]  # (token ids, came from a text prompt), (None, False): unusable
SyncTokenize = Callable[[RequestKind, Mapping[str, Any]], TokenIds]


def chars_per_token(tokenizer: PromptTokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (see conductor/kv/prompt_bounds.py)."""
    inner = getattr(tokenizer, "tokenizer", None)
    if isinstance(inner, ByteTokenizer):
        return 1  # every UTF-8 byte a token: a character is at least one
    longest = getattr(inner, "longest_token_chars", None)
    return longest if isinstance(longest, int) and longest > 0 else UNKNOWN_CHARS_PER_TOKEN


def make_tokenizer(s: KVAwarenessSettings, instances: Sequence[tuple[str, Role, str]]) -> PromptTokenizer:
    """The tokenizer `kv.tokenizer` names; `instances`: (id, role, base URL) of the workers."""
    if s.tokenizer == "auto":  # the workers' /tokenize, or the byte tokenizer where they serve none
        urls = [s.tokenizer_url] if s.tokenizer_url else [u for _, role, u in instances if role != Role.DECODE]
        return AutoTokenizer(lambda: urls)
    if s.tokenizer == "builtin":
        return LocalTokenizer(ByteTokenizer())
    if s.tokenizer == "worker":
        url = s.tokenizer_url or next((u for _, role, u in instances if role != Role.DECODE), None)
        if url is None:
            raise ConfigError("kv.tokenizer 'worker' needs kv.tokenizer_url or a prefill/mixed instance")
        return WorkerTokenizer(url)
    return HFPromptTokenizer(HFTokenizer(s.tokenizer))


def _prompt_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    return None


def _single_text(body: Mapping[str, Any]) -> tuple[str | None, bool, list[int] | None]:
    """A completions prompt as (text, is the whole prompt, token ids): one of text or ids is set
    when the prompt is one sequence (a batch of one included), neither for a batch or a bad form."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, True, None
    ids = _prompt_ids(prompt)
    if ids is not None:
        return None, False, ids
    if isinstance(prompt, list) and len(prompt) == 1:  # a batch of one
        one = prompt[0]
        return (one, False, None) if isinstance(one, str) else (None, False, _prompt_ids(one))
    return None, False, None


def _sync_tokenizer(tokenizer: PromptTokenizer) -> SyncTokenize | None:
    """`tokenizer`'s work as a plain function a thread can run; None for one that must be awaited."""
    if isinstance(tokenizer, HFPromptTokenizer):
        hf = tokenizer.hf

        def hf_ids(kind: RequestKind, body: Mapping[str, Any]) -> TokenIds:
            if kind == "chat":
                messages = body.get("messages")
                if not messages:
                    return None, False
                # as HFPromptTokenizer.encode_chat: no special tokens beyond the template's unless asked
                encode = hf.encode if body.get("add_special_tokens") is True else hf.encode_plain
                return encode(hf.render_chat(messages, **chat_template_arguments(body))), False
            text, whole, ids = _single_text(body)
            if text is None:
                return ids, False
            return (hf.encode if body.get("add_special_tokens", True) is not False else hf.encode_plain)(text), whole

        return hf_ids
    if isinstance(tokenizer, LocalTokenizer):
        local = tokenizer.tokenizer

        def local_ids(kind: RequestKind, body: Mapping[str, Any]) -> TokenIds:
            if kind == "chat":
                messages = body.get("messages")
                return (local.apply_chat_template(messages), False) if messages else (None, False)
            text, whole, ids = _single_text(body)
            return (local.encode(text), whole) if text is not None else (ids, False)

        return local_ids
    return None


class PromptEncoder:
    """Token ids, block keys and the Mooncake Store's hashes of one prompt. A LoRA adapter's prompt
    is keyed with the adapter in every block (conductor/core/adapter_keys.py), without the prefix
    memo (its entries are the base model's keys)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        scheme: BlockKeyScheme,
        prefix_memo: PrefixMemo | None = None,
        *,
        offload_size: int = OFFLOAD_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.prefix_memo = prefix_memo
        self.adapter_schemes = AdapterSchemes(scheme)
        self.offload_size = offload_size
        self._sync = _sync_tokenizer(tokenizer)
        self._memo_lock = threading.Lock()

    async def token_ids(self, kind: RequestKind, body: Mapping[str, Any], size: int) -> TokenIds:
        """(token ids, came from text) of a prompt of `size` characters or ids; (None, False) for a
        batch or an unusable prompt. A tokenizer's own errors propagate."""
        if size > self.offload_size and self._sync is not None:
            return await asyncio.to_thread(self._sync, kind, body)
        if kind == "chat":
            messages = body.get("messages")
            return (await self.tokenizer.encode_chat(messages, body), False) if messages else (None, False)
        text, whole, ids = _single_text(body)
        if text is None:
            return ids, False
        specials = body.get("add_special_tokens", True) is not False  # vLLM's completions default
        return await self.tokenizer.encode_prompt(text, specials), whole

    async def keys(
        self, ids: list[int], *, store: bool, adapter: AdapterCard | None = None
    ) -> tuple[list[int], list[str] | None]:
        """The block keys of `ids` run with `adapter` (None: the base model) and, with `store`, the
        Mooncake Store's names of its blocks; none when the scheme cannot key an adapter's blocks."""
        scheme = self.adapter_schemes.get(adapter)
        if scheme is None:
            return [], None
        if len(ids) > self.offload_size:
            return await asyncio.to_thread(self._keys, ids, store, True, scheme)
        return self._keys(ids, store, False, scheme)

    def _keys(self, ids: list[int], store: bool, may_wait: bool, scheme: BlockKeyScheme) -> tuple[list[int], list[str] | None]:
        keys: list[int] | None = None
        memo = self.prefix_memo if scheme is self.scheme else None
        if memo is not None and self._memo_lock.acquire(blocking=may_wait):
            try:
                keys = memo.keys(ids)
            finally:
                self._memo_lock.release()
        if keys is None:
            keys = scheme.keys(ids)
        if not (store and keys):
            return keys, None
        if isinstance(scheme, VllmKeys):  # the Mooncake Store names a block by its full digest
            return keys, [d.hex() for d in scheme.digests(ids)]
        return keys, [f"{k:016x}" for k in keys]
