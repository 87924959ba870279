"""One prompt of a request (`Leg`), the times modelled for it, and the relay of a batch's tokens.

`modelled_times` is the per-prompt entry of GET /emulator/requests `modelled` (see app.py): the
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
from adapters.emulator.openai_format import DONE, ParsedRequest, Renderer, usage
from adapters.emulator.protocols import LegPlan


@dataclasses.dataclass(eq=False, slots=True)
class Leg:
    """One prompt of a request: its position, engine request id, P/D plan and engine sequence."""

    index: int
    request_id: str
    plan: LegPlan
    seq: Sequence | None = None
    modelled: list[dict[str, Any] | None] | None = None  # the request log's modelled times, one per leg

    @property
    def sequence(self) -> Sequence:
        assert self.seq is not None, "submitted in _generate before use"
        return self.seq


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


def batch_usage(seqs: list[Sequence]) -> dict[str, Any]:
    """vLLM sums a batch's usage over its prompts."""
    return usage(
        sum(s.prompt_tokens for s in seqs),
        sum(s.generated for s in seqs),
        sum(s.cached_tokens + s.external_tokens for s in seqs),
    )


async def stream_legs(
    send: Send,
    legs: list[Leg],
    req: ParsedRequest,
    renderer: Renderer,
    extra: list[tuple[bytes, bytes]],
    on_first_token: Callable[[Leg], None],
) -> None:
    """A streamed answer: every leg's tokens as SSE chunks as they come, then usage and [DONE]."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", SSE), (b"cache-control", b"no-cache"), *extra],
        }
    )
    async with contextlib.aclosing(relay(legs, on_first_token)) as tokens:
        async for leg, k in tokens:
            seq = leg.sequence
            chunk = renderer.chunk(seq.kv_seed, k, k == seq.max_tokens - 1, leg.index)
            if k == 0 and req.chat:
                chunk = renderer.role_chunk() + chunk
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    seqs = [leg.sequence for leg in legs]
    if any(seq.aborted for seq in seqs):
        return
    tail = renderer.usage_chunk(batch_usage(seqs)) + DONE if req.include_usage else DONE
    await send({"type": "http.response.body", "body": tail, "more_body": False})
