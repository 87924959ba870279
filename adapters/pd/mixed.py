"""Non-disaggregated workers: one leg, the worker prefills and decodes."""

from __future__ import annotations

from adapters.pd.base import Exchange, Outgoing, Target, open_leg


class MixedProtocol:
    name = "mixed"

    async def start(self, prefills: list[Target]) -> None:
        return None

    def ready(self, target: Target) -> bool:
        return True

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange:
        return await open_leg(prefill, out, out.body)
