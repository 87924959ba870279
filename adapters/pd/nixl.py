"""vLLM NixlConnector handshake, as vLLM's toy_proxy_server.py drives it.

Prefill first: the prefill leg asks the connector to keep the KV for a remote decode and generates
one token; the `kv_transfer_params` of its answer (remote_engine_id, remote_block_ids, remote_host,
remote_port, ...) go to the decode leg verbatim, and the decode leg pulls the KV and streams.
"""

from __future__ import annotations

from adapters.pd.base import (
    Exchange,
    NoBootstrap,
    Outgoing,
    Target,
    cached_tokens_of,
    check_leg,
    encode_json,
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

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange:
        if decode is None:
            raise ValueError("nixl needs a decode instance")
        reply = await prefill.upstream.post(out.path, encode_json(prefill_body(out.body, PREFILL_PARAMS)), out.headers)
        answer = check_leg(reply, prefill, "prefill")
        decode_body = dict(out.body)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if params:
            decode_body["kv_transfer_params"] = params
        exchange = await open_leg(decode, out, decode_body)
        exchange.prefill_s = reply.elapsed_s
        exchange.prefill_cached_tokens = cached_tokens_of(answer)
        return exchange
