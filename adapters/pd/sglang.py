"""SGLang's bootstrap handshake, as sglang-router and SGLang's mini load balancer drive it.

The same body goes to both legs at once, with `bootstrap_host` (the prefill's host),
`bootstrap_port` (its bootstrap server) and `bootstrap_room` (a random 63-bit id that pairs the
two legs) added; the decode leg answers the client.
"""

from __future__ import annotations

import secrets

from adapters.pd.base import Exchange, NoBootstrap, Outgoing, Target
from adapters.pd.concurrent import concurrent_exchange


def bootstrap_room() -> int:
    return secrets.randbits(63)


class SGLangProtocol(NoBootstrap):
    name = "sglang"

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange:
        if decode is None:
            raise ValueError("sglang P/D needs a decode instance")
        body = dict(out.body)
        body["bootstrap_host"] = prefill.host
        body["bootstrap_port"] = prefill.bootstrap_port
        body["bootstrap_room"] = bootstrap_room()
        return await concurrent_exchange(out, prefill, body, decode, body)
