"""Running a prefill leg in the background while the decode leg answers the client.

Mooncake and SGLang send both legs at once: the decode engine waits for the KV itself. If the
prefill leg fails, the decode would wait for KV that never comes, so the decode leg is cancelled
(or its stream closed) at once and the prefill's failure is reported in its place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from adapters.pd.base import Exchange, Outgoing, Target, cached_tokens_of, check_leg, encode_json, leg_body, open_leg


async def concurrent_exchange(
    out: Outgoing,
    prefill: Target,
    prefill_payload: Mapping[str, Any],
    decode: Target,
    decode_payload: Mapping[str, Any],
    prefill_headers: Mapping[str, str] | None = None,
) -> Exchange:
    holder: list[Exchange] = []

    async def run_prefill() -> None:
        try:
            reply = await prefill.upstream.post(
                out.path, encode_json(leg_body(prefill, out, prefill_payload)), prefill_headers or out.headers_for("prefill")
            )
            answer = check_leg(reply, prefill, "prefill")
        except Exception as exc:
            if holder:  # the decode stream is already with the client: end it now
                holder[0].prefill_failed = exc
                if holder[0].stream is not None:
                    holder[0].stream.close()
            raise
        if holder:
            holder[0].prefill_s = reply.elapsed_s
            holder[0].prefill_cached_tokens = cached_tokens_of(answer)
        else:
            results["prefill"] = (reply.elapsed_s, cached_tokens_of(answer))

    results: dict[str, tuple[float, int | None]] = {}
    prefill_task = asyncio.create_task(run_prefill())
    decode_task = asyncio.create_task(open_leg(decode, out, decode_payload))
    try:
        while not decode_task.done():
            await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and not prefill_task.cancelled() and prefill_task.exception() is not None:
                decode_task.cancel()
                raise prefill_task.exception()  # type: ignore[misc]
            if prefill_task.done() and not decode_task.done():
                await asyncio.wait({decode_task})
        exchange = decode_task.result()
    except BaseException:
        prefill_task.cancel()
        decode_task.cancel()
        raise
    holder.append(exchange)
    if "prefill" in results:
        exchange.prefill_s, exchange.prefill_cached_tokens = results["prefill"]
    if not prefill_task.done():
        exchange.pending.append(prefill_task)
    return exchange
