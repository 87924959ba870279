"""The seam between the request path and KV-cache awareness.

The gateway asks a PromptAnalyzer, before every decision, how long the prompt is, what its block
keys are and which instances (and the pooled store) already hold a prefix of it; after the decision
it tells the analyzer where the request went and, when it finished, what the worker reported. The
estimating analyzer below is what runs with no tokenizer and no index configured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from conductor.core.types import CachedPrefix, Decision, Observation

RequestKind = Literal["completions", "chat"]

CHARS_PER_TOKEN = 4  # a common rule of thumb for English text with BPE vocabularies


@dataclass(frozen=True, slots=True)
class PromptAnalysis:
    """What the gateway learned about one prompt; never holds the prompt's text."""

    prompt_tokens: int
    exact: bool  # True when the prompt was tokenized (or given as token ids)
    block_keys: tuple[int, ...] = ()
    cached: Mapping[str, CachedPrefix] = field(default_factory=dict)  # instance id -> prefix
    store_cached_tokens: int = 0
    # token ids to forward in place of a completions text prompt, so workers do not tokenize again
    forward_token_ids: tuple[int, ...] | None = None


class PromptAnalyzer(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def analyse(self, kind: RequestKind, body: Mapping[str, Any]) -> PromptAnalysis: ...

    async def on_dispatch(self, analysis: PromptAnalysis, decision: Decision) -> None: ...

    def on_result(self, analysis: PromptAnalysis, decision: Decision, observation: Observation) -> None: ...


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def estimate_prompt_tokens(kind: RequestKind, body: Mapping[str, Any]) -> tuple[int, bool]:
    """Token count of a prompt without a tokenizer: exact for token ids, else ~4 chars a token."""
    if kind == "chat":
        chars = sum(len(_text_of_content(m.get("content"))) + 8 for m in body.get("messages", ()))
        return max(1, chars // CHARS_PER_TOKEN), False
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt), True
    if isinstance(prompt, list):  # a batch of prompts: count them all
        total = 0
        for p in prompt:
            total += len(p) if isinstance(p, list) else max(1, len(str(p)) // CHARS_PER_TOKEN)
        return max(1, total), False
    return max(1, len(str(prompt)) // CHARS_PER_TOKEN), False


class EstimatingAnalyzer:
    """No tokenizer, no index: prompt lengths are estimated and nothing is known to be cached."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def analyse(self, kind: RequestKind, body: Mapping[str, Any]) -> PromptAnalysis:
        tokens, exact = estimate_prompt_tokens(kind, body)
        return PromptAnalysis(prompt_tokens=tokens, exact=exact)

    async def on_dispatch(self, analysis: PromptAnalysis, decision: Decision) -> None:
        return None

    def on_result(self, analysis: PromptAnalysis, decision: Decision, observation: Observation) -> None:
        return None
