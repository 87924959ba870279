"""One choice of a request (`Leg`), the times modelled for it, and the relay of a batch's tokens.

A request of P prompts with `n` choices each is P * n engine sequences, as vLLM's V1 engine fans a
request with n > 1 out into n child requests (`{i}_{parent id}`); their prefix-cache look-ups make
the later children of a prompt hit the blocks the first one computed. Choice `index` is
prompt_idx * n + i; choice i > 0 samples its own text (openai_format.sample_seed).

`modelled_times` is the per-leg entry of GET /emulator/requests `modelled` (see app.py): the
engine's modelled figures, which CPU contention does not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any

from adapters.emulator.asgi import SSE, Send
from adapters.emulator.engine import Sequence
from adapters.emulator.openai_format import DONE, ParsedRequest, usage
from adapters.emulator.protocols import LegPlan
from adapters.emulator.render import Renderer


@dataclasses.dataclass(eq=False, slots=True)
class Leg:
    """One choice of a request: its index, engine request id, P/D plan and engine sequence."""

    index: int  # the choice's `index` in the answer
    request_id: str
    plan: LegPlan
    prompt: int = 0  # which prompt of a completions batch
    sample: int = 0  # which of that prompt's n choices
    seq: Sequence | None = None
    modelled: list[dict[str, Any] | None] | None = None  # the request log's modelled times, one per leg

    @property
    def sequence(self) -> Sequence:
        assert self.seq is not None, "submitted in _generate before use"
        return self.seq


@dataclasses.dataclass(slots=True)
class Accepted:
    """A request read and logged: its JSON body, headers, id and entry in the request log."""

    body: Any
    headers: dict[str, str]
    base_id: str
    record: dict[str, Any]

    @property
    def extra(self) -> list[tuple[bytes, bytes]]:
        """The response headers every answer carries: the request id."""
        return [(b"x-request-id", self.base_id.encode())]

    def track(self, legs: list[Leg]) -> list[Leg]:
        """Give the request log one `modelled` entry per leg, filled at each leg's first token."""
        modelled: list[dict[str, Any] | None] = [None] * len(legs)
        self.record["modelled"] = modelled
        for leg in legs:
            leg.modelled = modelled
        return legs


def fan_out(n_prompts: int, n: int, response_id: str, plan: LegPlan) -> list[Leg]:
    """The legs of a request: a batch's prompts are `{id}-{p}` (vLLM's serving_completion), a
    prompt's n > 1 children `{i}_{prompt id}` (vLLM's ParentRequest). Every leg gets the request's
    P/D plan, as every vLLM sub-request gets its params; only the first publishes a transfer key."""
    legs: list[Leg] = []
    for p in range(n_prompts):
        prompt_id = f"{response_id}-{p}" if n_prompts > 1 else response_id
        for i in range(n):
            request_id = prompt_id if n == 1 else f"{i}_{prompt_id}"
            leg_plan = plan if not legs else dataclasses.replace(plan, publish_key=None)
            legs.append(Leg(len(legs), request_id, leg_plan, prompt=p, sample=i))
    return legs


def modelled_times(seq: Sequence) -> dict[str, Any]:
    """What the engine modelled for a sequence whose first token is out."""
    prefill = seq.modelled_prefill_s
    # a prefill that pulled KV back from a decode waited for that transfer before queueing
    before = seq.modelled_queue_s + (seq.modelled_transfer_s or 0.0)
    return {
        "request_id": seq.request_id,
        "prompt_tokens": seq.prompt_tokens,
        "cached_tokens": seq.cached_tokens,
        "external_tokens": seq.external_tokens,
        "arrival_index": seq.arrival_index,
        "prefill_step": seq.prefill_step,
        "queue_s": seq.modelled_queue_s,
        "prefill_s": prefill,
        "transfer_s": seq.modelled_transfer_s,
        "ttft_s": None if prefill is None else before + prefill,
    }


async def relay(legs: list[Leg], first_token: Callable[[Leg], None]) -> AsyncGenerator[tuple[Leg, int], None]:
    """(leg, token index) as the engine emits them, interleaved across the legs; `first_token(leg)`
    runs before a leg's first token is yielded."""
    if len(legs) == 1:  # the common case: no pump tasks on the token path
        (leg,) = legs
        queue = leg.sequence.tokens
        while (k := await queue.get()) is not None:
            if k == 0:
                first_token(leg)
            yield leg, k
        return
    merged: asyncio.Queue[tuple[Leg, int | None]] = asyncio.Queue()

    async def pump(leg: Leg) -> None:
        while (k := await leg.sequence.tokens.get()) is not None:
            merged.put_nowait((leg, k))
        merged.put_nowait((leg, None))

    loop = asyncio.get_running_loop()
    pumps = [loop.create_task(pump(leg)) for leg in legs]
    try:
        open_legs = len(legs)
        while open_legs:
            leg, token = await merged.get()
            if token is None:
                open_legs -= 1
                continue
            if token == 0:
                first_token(leg)
            yield leg, token
    finally:
        for task in pumps:
            task.cancel()


def batch_usage(legs: list[Leg]) -> dict[str, Any]:
    """vLLM sums a batch's usage over its prompts: each prompt's tokens once (its first choice's
    cache hit), every choice's completion tokens."""
    firsts = [leg.sequence for leg in legs if leg.sample == 0]
    return usage(
        sum(s.prompt_tokens for s in firsts),
        sum(leg.sequence.generated for leg in legs),
        sum(s.cached_tokens + s.external_tokens for s in firsts),
    )


async def stream_legs(
    send: Send,
    legs: list[Leg],
    req: ParsedRequest,
    renderer: Renderer,
    extra: list[tuple[bytes, bytes]],
    on_first_token: Callable[[Leg], None],
) -> None:
    """A streamed answer: every leg's tokens as SSE chunks as they come, then usage and [DONE]; a
    chat stream's role chunks go out with the first token of any choice."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", SSE), (b"cache-control", b"no-cache"), *extra],
        }
    )
    opening = req.chat
    async with contextlib.aclosing(relay(legs, on_first_token)) as tokens:
        async for leg, k in tokens:
            seq = leg.sequence
            chunk = renderer.chunk(seq.text_seed, k, k == seq.max_tokens - 1, leg.index)
            if opening:
                chunk, opening = renderer.role_chunks() + chunk, False
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    if any(leg.sequence.aborted for leg in legs):
        return
    tail = renderer.usage_chunk(batch_usage(legs)) + DONE if req.include_usage else DONE
    await send({"type": "http.response.body", "body": tail, "more_body": False})
