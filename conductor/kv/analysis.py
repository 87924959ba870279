"""The seam between the request path and KV-cache awareness.

The gateway asks a PromptAnalyzer, before every decision, how long the prompt is, what its block
keys are and which instances (and the pooled store) already hold a prefix of it; after the decision
it tells the analyzer where the request went and, when it finished, what the worker reported. The
estimating analyzer below is what runs with no tokenizer and no index configured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, cast, runtime_checkable

import msgspec

from conductor.core.errors import BadRequest
from conductor.core.fast_init import fast_init
from conductor.core.types import CachedPrefix, Decision, Observation
from conductor.kv.prompt_bounds import PromptBound, check_prompt_size

RequestKind = Literal["completions", "chat"]

CHARS_PER_TOKEN = 4  # a common rule of thumb for English text with BPE vocabularies
# Token ids are int32 in vLLM and in the block keys' packing: anything at or above this is no
# token of any vocabulary, whatever tokenizer is configured.
MAX_TOKEN_ID = 2**31


@fast_init
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
    # the prompt's token ids, kept only where a prefill-to-prefill pull may need them (its staging
    # request asks the holder for the prefix by token ids, conductor/routing/peer_pull.py)
    token_ids: tuple[int, ...] | None = None


class PromptAnalyzer(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def analyse(self, kind: RequestKind, body: Mapping[str, Any]) -> PromptAnalysis: ...

    async def on_dispatch(self, analysis: PromptAnalysis, decision: Decision) -> None: ...

    def on_result(self, analysis: PromptAnalysis, decision: Decision, observation: Observation) -> None: ...


@runtime_checkable
class BoundsPrompts(Protocol):
    """An analyzer that refuses prompts longer than its bound (both of this package's do): the
    gateway hands it the bound that reads the workers' context length (conductor/gateway.py)."""

    prompt_bound: PromptBound


@runtime_checkable
class SizedVocabulary(Protocol):
    """A tokenizer that may know its vocabulary size (adapters/tokenizers.py: the byte tokenizer and
    local Hugging Face ones do, a worker's /tokenize does not: None)."""

    @property
    def vocab_size(self) -> int | None: ...


@runtime_checkable
class KnowsVocabulary(Protocol):
    """An analyzer whose tokenizer may know its vocabulary: token ids at or above it are refused
    (400) before anything else reads the request (conductor/server/endpoint.py)."""

    def vocab_size(self) -> int | None:
        """The size now, None when unknown. Read per request, not once: with kv.tokenizer auto the
        tokenizer is chosen on first use (adapters/auto_tokenizer.py), so it may become known later."""
        ...


def bind_prompt_bound(analyzer: PromptAnalyzer, bound: PromptBound) -> None:
    """Give an analyzer that bounds prompts the gateway's bound: the context length its workers
    report, read per request. Another analyzer is left as it is."""
    if isinstance(analyzer, BoundsPrompts):
        analyzer.prompt_bound = bound


def _no_vocabulary() -> int | None:
    return None


@functools.cache
def _knows_vocabulary(cls: type) -> bool:
    # once per analyzer class: an isinstance check against a runtime Protocol costs microseconds
    return issubclass(cls, KnowsVocabulary)


def vocabulary_of(analyzer: PromptAnalyzer) -> Callable[[], int | None]:
    """What tells the vocabulary size of the analyzer's tokenizer (None: unknown, or an analyzer
    with no tokenizer): resolve it once where the analyzer is wired, call it per request."""
    return cast(KnowsVocabulary, analyzer).vocab_size if _knows_vocabulary(type(analyzer)) else _no_vocabulary


def vocab_size_of(analyzer: PromptAnalyzer) -> int | None:
    """The vocabulary size of the analyzer's tokenizer now (`vocabulary_of` without keeping it)."""
    # the class check narrows as isinstance would (mypy cannot see it through the cache)
    return analyzer.vocab_size() if _knows_vocabulary(type(analyzer)) else None  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=8)
def _token_ids_type(limit: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=limit)]]


def _integral(ids: list[Any]) -> list[Any]:
    return [int(t) if type(t) is float and t.is_integer() else t for t in ids]


def check_token_ids(prompt: Any, vocab_size: int | None) -> Any:
    """The prompt to forward. 400 unless a completions prompt given as token ids (a list of ids,
    or a list of such lists) holds only integers in 0 <= id < vocab_size (< MAX_TOKEN_ID when the
    vocabulary is unknown). Ids written as 5.0 are integers to JSON Schema and to vLLM: they are
    accepted and forwarded as 5. Text prompts have no ids to check. msgspec checks a list of 100k
    ids in under a millisecond, several times faster than a pydantic list of constrained ints."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], str):
        return prompt
    limit = min(vocab_size, MAX_TOKEN_ID) if vocab_size is not None else MAX_TOKEN_ID
    batch = isinstance(prompt[0], list)
    checked: list[Any] = []
    for i, ids in enumerate(prompt if batch else [prompt]):
        where = f"prompt[{i}]" if batch else "prompt"
        if not isinstance(ids, list) or not ids:
            raise BadRequest(f"invalid '{where}': a list of lists of token ids needs a non-empty list here", param="prompt")
        try:
            try:
                msgspec.convert(ids, _token_ids_type(limit))
            except msgspec.ValidationError:
                if not any(type(t) is float for t in ids):
                    raise
                ids = _integral(ids)  # the rare client that writes ids as floats: check them again
                msgspec.convert(ids, _token_ids_type(limit))
        except msgspec.ValidationError as exc:
            bound = (
                f"the tokenizer's vocabulary has {vocab_size} tokens"
                if limit == vocab_size
                else f"token ids are below {MAX_TOKEN_ID}"
            )
            detail = str(exc).replace("`$", f"`{where}")
            raise BadRequest(f"invalid token ids in '{where}': {detail} ({bound})", param="prompt") from None
        checked.append(ids)
    if all(new is old for new, old in zip(checked, prompt if batch else [prompt], strict=True)):
        return prompt
    return checked if batch else checked[0]


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
    """No tokenizer, no index: prompt lengths are estimated and nothing is known to be cached.
    Prompts given as token ids longer than the bound are refused (400), and texts too long for any
    tokenization when `max_chars_per_token` is given (kv.max_chars_per_token): with no tokenizer
    of its own, the gateway knows no such bound otherwise."""

    def __init__(self, prompt_bound: PromptBound | None = None, max_chars_per_token: int | None = None) -> None:
        self.prompt_bound = prompt_bound or PromptBound()
        self.chars_per_token = max_chars_per_token

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def analyse(self, kind: RequestKind, body: Mapping[str, Any]) -> PromptAnalysis:
        check_prompt_size(kind, body, self.prompt_bound.limit(body.get("model")), self.chars_per_token)
        tokens, exact = estimate_prompt_tokens(kind, body)
        return PromptAnalysis(prompt_tokens=tokens, exact=exact)

    async def on_dispatch(self, analysis: PromptAnalysis, decision: Decision) -> None:
        return None

    def on_result(self, analysis: PromptAnalysis, decision: Decision, observation: Observation) -> None:
        return None
