"""vLLM NixlConnector handshake, as vLLM's toy_proxy_server.py drives it.

Prefill first: the prefill leg asks the connector to keep the KV for a remote decode and generates
one token; the `kv_transfer_params` of its answer (remote_engine_id, remote_block_ids, remote_host,
remote_port, ...) go to the decode leg verbatim, and the decode leg pulls the KV and streams.

Bidirectional transfer (vLLM 0.32, `bidirectional_kv_xfer`): a decode's non-streamed answer then
carries its own `kv_transfer_params` (where the request's KV stays pinned). They are taken off the
answer here (workers' addresses are not the client's business) and handed to the gateway as
`Exchange.decode_kv_params`; a later prefill leg given `Outgoing.pull` pulls from them.

Staging a prefix (prefill-to-prefill pulls, conductor/routing/peer_pull.py): `stage_prefix` asks a prefill
that holds a prefix for a one-token completion of the prefix's token ids with the prefill leg's
usual kv_transfer_params; its answer says where the now pinned blocks are, as it would to a decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from adapters.pd.base import (
    Exchange,
    NoBootstrap,
    Outgoing,
    Target,
    cached_tokens_of,
    check_leg,
    decode_json,
    encode_json,
    leg_body,
    open_leg,
    prefill_body,
)

# The request-side kv_transfer_params of the prefill leg: every remote_* field present and null,
# as vLLM's proxy sends them.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class NixlProtocol(NoBootstrap):
    name = "nixl"
    prefill_answers_first = True

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange:
        if decode is None:
            raise ValueError("nixl needs a decode instance")
        params = PREFILL_PARAMS if out.pull is None else {**PREFILL_PARAMS, **out.pull}
        sent = leg_body(prefill, out, prefill_body(out.body, params))
        reply = await prefill.upstream.post(out.path, encode_json(sent), out.headers_for("prefill"))
        answer = check_leg(reply, prefill, "prefill")
        if out.prefill_answered is not None:
            out.prefill_answered(reply.elapsed_s, cached_tokens_of(answer))
        decode_body = dict(out.body)
        handed = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if handed:
            decode_body["kv_transfer_params"] = handed
        exchange = await open_leg(decode, out, decode_body)
        reply_d = exchange.reply
        # a cheap look first: only a bidirectional decode's answer names remote block ids
        if reply_d is not None and reply_d.status == 200 and b'"remote_block_ids"' in reply_d.body:
            try:
                body = decode_json(reply_d.body)
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("kv_transfer_params"):
                exchange.decode_kv_params = body.pop("kv_transfer_params")
                exchange.reply = replace(reply_d, body=encode_json(body))
        exchange.prefill_s = reply.elapsed_s
        exchange.prefill_cached_tokens = cached_tokens_of(answer)
        return exchange

    async def stage_prefix(
        self, holder: Target, out: Outgoing, token_ids: Sequence[int], priority: int | None = None
    ) -> tuple[Any, float]:
        """Have `holder` compute one token after `token_ids` and keep the request's KV for a reader:
        (its JSON answer, seconds from sent to answered). Raises UpstreamError when it fails."""
        body: dict[str, Any] = {
            "model": out.body.get("model"),
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": PREFILL_PARAMS,
        }
        if priority is not None:
            body["priority"] = priority
        if "cache_salt" in out.body:  # part of vLLM's block hashes: without it no block would match
            body["cache_salt"] = out.body["cache_salt"]
        headers = {**out.headers, "X-Request-ID": f"{out.request_id}-stage"}
        reply = await holder.upstream.post("/v1/completions", encode_json(body), headers)
        return check_leg(reply, holder, "staging"), reply.elapsed_s
