"""One attempt at a batched completions request (`"prompt": [a, b, ...]`) on P/D instances.

vLLM's prefill answer to a batch carries one `kv_transfer_params`, the first prompt's (its
OpenAI server puts `final_res_batch[0].kv_transfer_params` on the response), so handing it to a
batched decode would give every prompt but the first someone else's KV. Here each prompt is its
own P/D exchange on the instances the decision chose, all at once, and the answers are merged
into what one engine answers for the batch (`conductor/routing/batching.py`): choices in prompt order,
usage summed, streams interleaved with one `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from adapters.pd.base import Exchange, Outgoing
from conductor.core.errors import UpstreamError
from conductor.core.types import Observation
from conductor.gateway import Gateway, Routed
from conductor.routing.batching import StreamMerger, merge_replies
from conductor.routing.relay import (
    ClientState,
    Dispatch,
    Send,
    StreamStats,
    count_failure,
    dispatch,
    id_headers,
    settle_prefill,
)


def sub_requests(out: Outgoing, bodies: list[dict[str, Any]]) -> list[Outgoing]:
    """One outgoing request per prompt, each with its own gateway id (`<id>-<i>`, as vLLM names
    a batch's sub-requests) so transfer ids and worker logs tell them apart."""
    subs = []
    for i, body in enumerate(bodies):
        rid = f"{out.request_id}-{i}"
        subs.append(replace(out, body=body, request_id=rid, headers={**out.headers, "X-Request-ID": rid}))
    return subs


async def _exchange_all(gw: Gateway, subs: list[Outgoing], d: Dispatch) -> list[Exchange]:
    tasks = [asyncio.create_task(d.open(gw, sub)) for sub in subs]
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


async def _chunks(exchange: Exchange) -> AsyncIterator[bytes]:
    assert exchange.stream is not None
    async for chunk in exchange.stream.chunks():
        yield chunk
    if exchange.prefill_failed is not None:
        raise exchange.prefill_failed


async def run_batch_attempt(
    gw: Gateway,
    routed: Routed,
    out: Outgoing,
    bodies: list[dict[str, Any]],
    send: Send,
    client: ClientState,
    arrived: float,
) -> int:
    """Serve a batch on the decision's instances; the HTTP status sent."""
    decision = routed.decision
    analysis = routed.analysis
    d = await dispatch(gw, routed, out.request_id, client, routed.view.max_tokens * len(bodies), may_pull=False)
    prefill, decode_name, predicted_cached = d.prefill, d.decode_name, d.predicted_cached
    loop = asyncio.get_running_loop()
    exchanges: list[Exchange] = []
    stats = StreamStats()
    ok = False
    cached_reported: int | None = None
    try:
        try:
            exchanges = await _exchange_all(gw, sub_requests(out, bodies), d)
        except UpstreamError as exc:
            count_failure(gw, exc)
            raise
        gw.registry.end_prefill(prefill.name, out.request_id)
        gw.registry.mark_decoding(decode_name, out.request_id)
        if not out.stream:
            replies = [ex.reply for ex in exchanges]
            assert all(r is not None for r in replies)
            failed = next((r for r in replies if r is not None and r.status != 200), None)
            if failed is not None:  # a worker's 4xx about one prompt: the client gets it as written
                status, payload, ctype = failed.status, failed.body, failed.content_type
            else:
                status, payload, ctype = 200, merge_replies([r.body for r in replies if r is not None]), "application/json"
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", ctype.encode()), *id_headers(out)],
                }
            )
            client.response_started = client.response_done = True
            await send({"type": "http.response.body", "body": payload})
            stats.first_token = loop.time()
            ok = status == 200
        else:
            options = out.body.get("stream_options")
            include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
            merger = StreamMerger([_chunks(ex) for ex in exchanges], include_usage=include_usage)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *id_headers(out)],
                }
            )
            client.response_started = True
            try:
                async for chunk in merger:
                    now = loop.time()
                    events = stats.see(chunk, now)
                    if events and stats.first_token is None:
                        stats.first_token = now
                        gw.metrics.ttft.observe(now - arrived)
                    gw.registry.advance_decode(decode_name, out.request_id, events)
                    client.response_done = client.response_done or stats.done
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                await merger.aclose()
            client.response_done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            cached_reported = merger.cached_tokens
            ok = True
            status = 200
        for ex in exchanges:
            await settle_prefill(gw, ex, prefill.name)
        if ok:
            d.succeeded(gw)
        return status
    except BaseException:
        for ex in exchanges:
            ex.abort()
        raise
    finally:
        d.end(gw)
        prefill_cached = [ex.prefill_cached_tokens for ex in exchanges if ex.prefill_cached_tokens is not None]
        prefill_times = [ex.prefill_s for ex in exchanges if ex.prefill_s is not None]
        gw.observe(
            routed,
            Observation(
                request_id=out.request_id,
                prefill=prefill.name,
                decode=decision.decode,
                prompt_tokens=analysis.prompt_tokens,
                cached_tokens=sum(prefill_cached) if prefill_cached else cached_reported,
                predicted_cached_tokens=predicted_cached,
                # the prompts ran as separate prefills: no single leg time to learn the model from
                queue_and_prefill_s=max(prefill_times) if len(prefill_times) == 1 else None,
                ttft_s=None,
                output_tokens=stats.tokens,
                ok=ok,
            ),
        )
