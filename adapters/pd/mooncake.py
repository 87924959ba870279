"""vLLM MooncakeConnector handshake, as vLLM's mooncake_connector_proxy.py drives it.

At start-up the gateway asks each prefill instance's bootstrap server (`GET /query`) for its engine
id. Per request, both legs go out at once, paired by one transfer id: the prefill leg generates one
token and keeps the KV; the decode leg names the prefill engine and its bootstrap address and pulls
the KV itself.

vLLM has renamed these fields across versions, so every field name lives in one MooncakeSchema
below, chosen by the `mooncake_schema` setting:

- `transfer_id` (vLLM 0.32, current): P {do_remote_decode, do_remote_prefill, transfer_id};
  D {do_remote_decode, do_remote_prefill, remote_engine_id, remote_bootstrap_addr, transfer_id}.
  /query answers {dp_rank: {"engine_id": ..., "worker_addr": ...}}.
- `engine_id` (the proxy before transfer ids): no transfer id; D carries remote_bootstrap_addr,
  remote_engine_id and remote_dp_rank; P gets the X-data-parallel-rank header. /query answers
  {engine_id: {dp_rank: ...}}.
- `bootstrap_server` (the first proxy): no /query; D carries bootstrap_server_host and
  bootstrap_server_port.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from adapters.pd.base import Exchange, Outgoing, Target, decode_json, prefill_body
from adapters.pd.concurrent import concurrent_exchange
from conductor.core.errors import ConfigError, NoHealthyInstance

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    dp_rank: int
    bootstrap_addr: str  # http://host:port of the prefill's bootstrap server


@dataclass(frozen=True, slots=True)
class MooncakeSchema:
    name: str
    needs_query: bool
    prefill: Callable[[str, EngineInfo | None], dict[str, Any]]  # (transfer_id, engine) -> params
    decode: Callable[[str, EngineInfo | None, Target], dict[str, Any]]
    prefill_headers: Callable[[EngineInfo | None], dict[str, str]]


def _no_headers(engine: EngineInfo | None) -> dict[str, str]:
    return {}


def _engine(engine: EngineInfo | None) -> EngineInfo:
    if engine is None:
        raise NoHealthyInstance("the prefill instance's Mooncake engine id is not known yet (bootstrap /query)")
    return engine


SCHEMAS: dict[str, MooncakeSchema] = {
    "transfer_id": MooncakeSchema(
        name="transfer_id",
        needs_query=True,
        prefill=lambda tid, eng: {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
        decode=lambda tid, eng, p: {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": _engine(eng).engine_id,
            "remote_bootstrap_addr": _engine(eng).bootstrap_addr,
            "transfer_id": tid,
        },
        prefill_headers=_no_headers,
    ),
    "engine_id": MooncakeSchema(
        name="engine_id",
        needs_query=True,
        prefill=lambda tid, eng: {"do_remote_decode": True, "do_remote_prefill": False},
        decode=lambda tid, eng, p: {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": _engine(eng).bootstrap_addr,
            "remote_engine_id": _engine(eng).engine_id,
            "remote_dp_rank": _engine(eng).dp_rank,
        },
        prefill_headers=lambda eng: {"X-data-parallel-rank": str(_engine(eng).dp_rank)},
    ),
    "bootstrap_server": MooncakeSchema(
        name="bootstrap_server",
        needs_query=False,
        prefill=lambda tid, eng: {"do_remote_decode": True, "do_remote_prefill": False},
        decode=lambda tid, eng, p: {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "bootstrap_server_host": p.host,
            "bootstrap_server_port": p.bootstrap_port,
        },
        prefill_headers=_no_headers,
    ),
}


def parse_query(answer: Any, bootstrap_addr: str) -> EngineInfo:
    """The engine serving data-parallel rank 0 (the lowest rank) from a bootstrap /query answer,
    in either shape vLLM has used."""
    if not isinstance(answer, dict) or not answer:
        raise ValueError(f"bootstrap /query answered {answer!r}: no engine registered yet")
    first_key = next(iter(answer))
    first = answer[first_key]
    if isinstance(first, dict) and "engine_id" in first:  # {dp_rank: {"engine_id": ...}}
        by_rank = {int(k): v for k, v in answer.items()}
        rank = min(by_rank)
        return EngineInfo(str(by_rank[rank]["engine_id"]), rank, bootstrap_addr)
    if isinstance(first, dict):  # {engine_id: {dp_rank: ...}}
        rank = min(int(r) for r in first)
        return EngineInfo(str(first_key), rank, bootstrap_addr)
    raise ValueError(f"bootstrap /query answered an unknown shape: {answer!r}")


class MooncakeProtocol:
    name = "mooncake"
    prefill_answers_first = False  # both legs are sent at once

    def __init__(self, schema: str = "transfer_id", *, retry_s: float = 1.0, timeout_s: float = 5.0) -> None:
        if schema not in SCHEMAS:
            raise ConfigError(f"unknown mooncake_schema {schema!r}; choose one of {sorted(SCHEMAS)}")
        self.schema = SCHEMAS[schema]
        self._engines: dict[str, EngineInfo] = {}
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, prefills: list[Target]) -> None:
        if not self.schema.needs_query:
            return
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s))
        for target in prefills:
            if target.bootstrap_port is None:
                raise ConfigError(f"prefill {target.name} needs a bootstrap port for the mooncake protocol")
            self._tasks.append(asyncio.create_task(self._discover(target)))
        # Give the bootstrap servers a moment, but do not block start-up on a slow prefill:
        # until its engine id is known an instance is simply not ready.
        await asyncio.wait(self._tasks, timeout=self._timeout_s)

    async def _discover(self, target: Target) -> None:
        addr = f"http://{target.host}:{target.bootstrap_port}"
        assert self._session is not None
        while True:
            try:
                async with self._session.get(addr + "/query") as resp:
                    data = await resp.read()
                    if resp.status == 200:
                        self._engines[target.name] = parse_query(decode_json(data), addr)
                        log.info("prefill %s: mooncake engine %s", target.name, self._engines[target.name].engine_id)
                        return
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.debug("bootstrap %s not ready: %s", addr, exc)
            await asyncio.sleep(self._retry_s)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._session is not None:
            await self._session.close()

    def ready(self, target: Target) -> bool:
        return not self.schema.needs_query or target.name in self._engines

    def engine(self, name: str) -> EngineInfo | None:
        return self._engines.get(name)

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange:
        if decode is None:
            raise ValueError("mooncake P/D needs a decode instance")
        engine = self._engines.get(prefill.name)
        # one id per attempt: a failover to another prefill must not meet KV kept under the old one
        transfer_id = f"xfer-{out.request_id}-{secrets.token_hex(4)}"
        p_body = prefill_body(out.body, self.schema.prefill(transfer_id, engine))
        d_body = dict(out.body)
        d_body["kv_transfer_params"] = self.schema.decode(transfer_id, engine, prefill)
        headers = {**out.headers_for("prefill"), **self.schema.prefill_headers(engine)}
        return await concurrent_exchange(out, prefill, p_body, decode, d_body, prefill_headers=headers)
