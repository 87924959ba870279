"""Requests with prompt text (a live benchmark's workload) as a simulator trace, class and tenant kept.

benchmarks/tenants_load.py builds the two-class, two-tenant workload of benchmarks/bench_tenants.py
as prompts (one character is one token for the emulators' byte tokenizer and Conductor's builtin
one). The simulator needs sizes and block ids instead: `prompt_trace` cuts each prompt into
`block_tokens`-character blocks and names every block by its chained content (the block and all
before it), as the gateway's block keys do, so two prompts share ids exactly as far as they share
a prefix (a tenant's system prompt) and the simulated caches reuse what the emulators' would.

Block ids are small integers handed out in order of first appearance: the same requests give the
same ids in every process (Python's `hash` of a string is salted per process).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from traces.formats import TraceRequest

GATEWAY_BLOCK_TOKENS = 16  # the gateway's block_size in benchmarks/bench_tenants.py


class PromptRequest(Protocol):
    """What is read of a request (benchmarks/tenants_load.py's Request has these)."""

    @property
    def at_s(self) -> float: ...

    @property
    def tenant(self) -> str: ...

    @property
    def cls(self) -> str: ...

    @property
    def prompt(self) -> str: ...

    @property
    def max_tokens(self) -> int: ...


def prompt_trace(requests: Iterable[PromptRequest], block_tokens: int = GATEWAY_BLOCK_TOKENS) -> tuple[TraceRequest, ...]:
    """The requests as TraceRequests: one token per character, `max_tokens` generated (the
    emulators generate all of it), full blocks named by their chained content, class -> priority."""
    ids: dict[tuple[int, str], int] = {}  # (previous block's id, this block's text) -> its id
    out = []
    for line, r in enumerate(requests, start=1):
        prompt = r.prompt
        chain: list[int] = []
        prev = -1
        for start in range(0, len(prompt) - block_tokens + 1, block_tokens):
            key = (prev, prompt[start : start + block_tokens])
            prev = ids.setdefault(key, len(ids))
            chain.append(prev)
        out.append(
            TraceRequest(
                arrival_s=r.at_s,
                input_length=len(prompt),
                output_length=r.max_tokens,
                hash_ids=tuple(chain),
                line=line,
                block_tokens=block_tokens,
                priority=r.cls,
                tenant=r.tenant,
            )
        )
    return tuple(out)
