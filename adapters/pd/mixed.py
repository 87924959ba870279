"""Non-disaggregated workers: one leg, the worker prefills and decodes."""

from __future__ import annotations

from adapters.pd.base import Exchange, NoBootstrap, Outgoing, Target, open_leg


class MixedProtocol(NoBootstrap):
    name = "mixed"

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange:
        return await open_leg(prefill, out, out.body)
