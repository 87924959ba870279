"""One attempt at a batched completions request (`"prompt": [a, b, ...]`) on P/D instances.

vLLM's prefill answer to a batch carries one `kv_transfer_params`, the first prompt's (its
OpenAI server puts `final_res_batch[0].kv_transfer_params` on the response), so handing it to a
batched decode would give every prompt but the first someone else's KV. Here each prompt is its
own P/D exchange on the instances the decision chose, all at once, and the answers are merged
into what one engine answers for the batch (`conductor/routing/batching.py`): choices in prompt order,
usage summed, streams interleaved with one `[DONE]`. The attempt's skeleton (dispatch, settle,
observe) is the single relay's (`Relay.run`, conductor/routing/relay.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from adapters.pd.base import Exchange, Outgoing, PDProtocol
from conductor.core.errors import UpstreamError
from conductor.routing.attempt import Attempt, Dispatch
from conductor.routing.batching import StreamMerger, merge_replies
from conductor.routing.relay import Relay
from conductor.routing.router import Routed
from conductor.routing.streams import ClientState, Send, end_stream, send_whole, start_stream


def sub_requests(out: Outgoing, bodies: list[dict[str, Any]]) -> list[Outgoing]:
    """One outgoing request per prompt, each with its own gateway id (`<id>-<i>`, as vLLM names
    a batch's sub-requests) so transfer ids and worker logs tell them apart."""
    subs = []
    for i, body in enumerate(bodies):
        rid = f"{out.request_id}-{i}"
        subs.append(replace(out, body=body, request_id=rid, headers={**out.headers, "X-Request-ID": rid}))
    return subs


def choices_per_prompt(body: Mapping[str, Any]) -> int:
    """The client's `n` (validated: an integer from 1 up), 1 when it sets none: every prompt's
    answer has that many choices, and the merged stream numbers them prompt by prompt."""
    n = body.get("n")
    return n if type(n) is int and n > 0 else 1


async def _exchange_all(protocol: PDProtocol, subs: list[Outgoing], d: Dispatch) -> list[Exchange]:
    tasks = [asyncio.create_task(d.open(protocol, sub)) for sub in subs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().abort()
            task.cancel()
        raise


async def _chunks(relay: Relay, a: Attempt, exchange: Exchange) -> AsyncIterator[bytes]:
    """One prompt's stream, its usage with the prefill's cached tokens (`Relay.client_usage`)."""
    assert exchange.stream is not None
    async for chunk in exchange.stream.chunks():
        yield await relay.client_usage(a, exchange, chunk) if b'"cached_tokens"' in chunk else chunk
    if exchange.prefill_failed is not None:
        raise exchange.prefill_failed


async def run_batch_attempt(
    relay: Relay,
    routed: Routed,
    out: Outgoing,
    bodies: list[dict[str, Any]],
    send: Send,
    client: ClientState,
    arrived: float,
) -> int:
    """Serve a batch on the decision's instances; the HTTP status sent."""
    output_tokens = routed.view.max_tokens * len(bodies)
    a = await relay.dispatch(routed, out, client, arrived, output_tokens, batched=True)
    return await relay.run(a, lambda started: _serve(relay, started, bodies, send, client))


async def _serve(relay: Relay, a: Attempt, bodies: list[dict[str, Any]], send: Send, client: ClientState) -> int:
    try:
        a.exchanges = await _exchange_all(relay.protocol, sub_requests(a.out, bodies), a.dispatch)
    except UpstreamError as exc:
        relay.count_failure(exc)
        raise
    relay.prefill_over(a.dispatch)
    if not a.out.stream:
        return await _relay_replies(relay, a, send, client)
    return await _relay_streams(relay, a, send, client)


async def _relay_replies(relay: Relay, a: Attempt, send: Send, client: ClientState) -> int:
    """Every prompt's answer, merged into one (each with its prefill's cached tokens); a worker's
    4xx about one prompt as it wrote it."""
    replies = [ex.reply for ex in a.exchanges]
    assert all(r is not None for r in replies)
    failed = next((r for r in replies if r is not None and r.status != 200), None)
    if failed is not None:
        status, payload, ctype = failed.status, failed.body, failed.content_type
    else:
        bodies = [await relay.client_usage(a, ex, ex.reply.body) for ex in a.exchanges if ex.reply is not None]
        status, payload, ctype = 200, merge_replies(bodies), "application/json"
    await send_whole(send, client, a.out, status, ctype, payload)
    a.stats.first_token = asyncio.get_running_loop().time()
    a.ok = status == 200
    return status


async def _relay_streams(relay: Relay, a: Attempt, send: Send, client: ClientState) -> int:
    """Every prompt's stream, interleaved as their chunks arrive, choices numbered prompt by prompt."""
    options = a.out.body.get("stream_options")
    include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
    streams = [_chunks(relay, a, ex) for ex in a.exchanges]
    merger = StreamMerger(streams, include_usage=include_usage, n=choices_per_prompt(a.out.body))
    await start_stream(send, client, a.out, 200, "text/event-stream")
    loop = asyncio.get_running_loop()
    stats, request_id, decode_name = a.stats, a.dispatch.request_id, a.dispatch.decode_name
    try:
        async for chunk in merger:
            now = loop.time()
            events = stats.see(chunk, now)
            if events and stats.first_token is None:
                stats.first_token = now
                relay.metrics.ttft.observe(now - a.arrived)
            relay.registry.advance_decode(decode_name, request_id, events)
            client.response_done = client.response_done or stats.done
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:
        await merger.aclose()
    await end_stream(send, client)
    a.cached_reported = merger.cached_tokens
    a.ok = True
    return 200
