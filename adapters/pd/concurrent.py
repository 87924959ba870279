"""Running a prefill leg in the background while the decode leg answers the client.

Mooncake and SGLang send both legs at once: the decode engine waits for the KV itself. If the
prefill leg fails, the decode would wait for KV that never comes, so its connection is closed at
once and the failure is reported in its place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from adapters.pd.base import Exchange, Outgoing, Target, cached_tokens_of, check_leg, encode_json, open_leg


async def concurrent_exchange(
    out: Outgoing,
    prefill: Target,
    prefill_payload: Mapping[str, Any],
    decode: Target,
    decode_payload: Mapping[str, Any],
    prefill_headers: Mapping[str, str] | None = None,
) -> Exchange:
    holder: dict[str, Exchange] = {}

    async def run_prefill() -> None:
        reply = await prefill.upstream.post(out.path, encode_json(prefill_payload), prefill_headers or out.headers)
        exchange = holder.get("x")
        try:
            answer = check_leg(reply, prefill, "prefill")
        except Exception as exc:
            if exchange is not None:
                exchange.prefill_failed = exc
                if exchange.stream is not None:
                    exchange.stream.close()
            raise
        if exchange is not None:
            exchange.prefill_s = reply.elapsed_s
            exchange.prefill_cached_tokens = cached_tokens_of(answer)

    prefill_task = asyncio.create_task(run_prefill())
    try:
        exchange = await open_leg(decode, out, decode_payload)
    except BaseException:
        prefill_task.cancel()
        raise
    holder["x"] = exchange
    exchange.pending.append(prefill_task)
    if prefill_task.done() and prefill_task.exception() is not None:
        exchange.abort()
        raise prefill_task.exception()  # type: ignore[misc]
    return exchange
