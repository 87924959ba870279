"""kv.tokenizer "auto" (the default): the workers' own POST /tokenize, or the built-in byte tokenizer
where the workers serve none.

A vLLM worker tokenizes with the model's own tokenizer and chat template, so keys built from its
answer are the workers' keys without the operator naming a tokenizer directory. Which of the two it
is can only be told once a worker answers, so the choice is made on first use, not at start-up (the
workers may still be loading then): the first prefill/mixed worker that answers a short /tokenize
decides. 200 with token ids: every later prompt goes to the workers' /tokenize. 404, 405 or 501 (an
engine without the route): the built-in byte tokenizer from then on, with a warning, since its keys
match only emulated workers. No worker reachable: that request is estimated (the analyzer's rule for
a tokenizer that fails) and the workers are asked again after `retry_s`.

Once a worker has served /tokenize the choice never falls back to the byte tokenizer: keys of two
tokenizers in one index would never match each other. A worker that stops answering is replaced by
the next one that answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from adapters.tokenizers import LocalTokenizer, PromptTokenizer, WorkerTokenizer
from conductor.core.errors import UpstreamError
from conductor.core.tokenization import ByteTokenizer

log = logging.getLogger(__name__)

NOT_SERVED = frozenset({404, 405, 501})  # the engine has no /tokenize route
PROBE_TEXT = "Conductor asks whether this worker tokenizes."


class AutoTokenizer:
    """A `PromptTokenizer` that becomes a worker's /tokenize or the byte tokenizer on first use.

    `candidates`: the base URLs to ask, in order (read on every choice, so workers that join later
    count); `retry_s`: how long to estimate before asking again when no worker answered."""

    def __init__(
        self,
        candidates: Callable[[], Sequence[str]],
        *,
        timeout_s: float = 5.0,
        probe_timeout_s: float = 2.0,
        retry_s: float = 5.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.candidates = candidates
        self.probe_timeout_s = probe_timeout_s
        self.retry_s = retry_s
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._own = client is None
        self._chosen: PromptTokenizer | None = None
        self._workers_serve = False  # a worker has answered /tokenize: never the byte tokenizer then
        self._lock = asyncio.Lock()
        self._next_try = 0.0
        self.source = "undecided"  # a worker's URL, or "builtin"

    @property
    def vocab_size(self) -> int | None:
        """The byte tokenizer's once fallen back to it; a worker checks token ids itself."""
        return self._chosen.vocab_size if isinstance(self._chosen, LocalTokenizer) else None

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = await self._tokenizer()
        try:
            return await tokenizer.encode_prompt(text, add_special_tokens)
        except UpstreamError as exc:
            self._forget_if_gone(tokenizer, exc)
            raise

    async def encode_chat(self, messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> list[int]:
        tokenizer = await self._tokenizer()
        try:
            return await tokenizer.encode_chat(messages, body)
        except UpstreamError as exc:
            self._forget_if_gone(tokenizer, exc)
            raise

    async def close(self) -> None:
        if self._chosen is not None:
            await self._chosen.close()
        if self._own:
            await self._client.aclose()

    def _forget_if_gone(self, tokenizer: PromptTokenizer, exc: UpstreamError) -> None:
        # unreachable (no HTTP status): the next request asks the workers again; a status is the
        # worker's answer about that prompt, and the worker stays
        if exc.upstream_status is None and tokenizer is self._chosen:
            self._chosen = None

    async def _tokenizer(self) -> PromptTokenizer:
        chosen = self._chosen
        if chosen is not None:
            return chosen
        async with self._lock:  # one round of questions, however many requests arrive meanwhile
            if self._chosen is None:
                self._chosen = await self._choose()
            return self._chosen

    async def _choose(self) -> PromptTokenizer:
        now = time.monotonic()
        if now < self._next_try:
            raise UpstreamError("kv.tokenizer auto: no worker has answered /tokenize yet")
        failures: list[str] = []
        for url in self.candidates():
            url = url.rstrip("/")
            try:
                resp = await self._client.post(f"{url}/tokenize", json={"prompt": PROBE_TEXT}, timeout=self.probe_timeout_s)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}")
                continue
            if resp.status_code == 200 and _has_tokens(resp):
                if not self._workers_serve:
                    log.info("kv.tokenizer auto: prompts are tokenized by the workers' /tokenize (%s)", url)
                self._workers_serve, self.source = True, url
                return WorkerTokenizer(url, client=self._client)
            if resp.status_code in NOT_SERVED and not self._workers_serve:
                log.warning(
                    "kv.tokenizer auto: %s/tokenize answered %d, so the workers serve no /tokenize: falling back to the "
                    "built-in byte tokenizer, whose keys match only emulated workers. Against a real model set "
                    "kv.tokenizer (--tokenizer) to the model's tokenizer directory.",
                    url,
                    resp.status_code,
                )
                self.source = "builtin"
                return LocalTokenizer(ByteTokenizer())
            failures.append(f"{url}: answered {resp.status_code}")
        self._next_try = now + self.retry_s
        raise UpstreamError(
            f"kv.tokenizer auto: no worker answered /tokenize ({'; '.join(failures) or 'no prefill/mixed worker'})"
        )


def _has_tokens(resp: httpx.Response) -> bool:
    try:
        tokens = resp.json().get("tokens")
    except (ValueError, AttributeError):
        return False
    return isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
