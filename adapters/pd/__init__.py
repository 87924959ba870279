"""The P/D handshakes the gateway speaks with vLLM's and SGLang's KV connectors."""

from __future__ import annotations

from adapters.pd.base import Exchange, Outgoing, PDProtocol, Target
from adapters.pd.mixed import MixedProtocol
from adapters.pd.mooncake import MooncakeProtocol
from adapters.pd.nixl import NixlProtocol
from adapters.pd.sglang import SGLangProtocol

__all__ = ["Exchange", "Outgoing", "PDProtocol", "Target", "make_protocol"]


def make_protocol(name: str, *, mooncake_schema: str = "transfer_id", bootstrap_timeout_s: float = 5.0) -> PDProtocol:
    if name == "nixl":
        return NixlProtocol()
    if name == "mooncake":
        return MooncakeProtocol(mooncake_schema, timeout_s=bootstrap_timeout_s)
    if name == "sglang":
        return SGLangProtocol()
    if name == "mixed":
        return MixedProtocol()
    raise ValueError(f"unknown P/D protocol {name!r}")
