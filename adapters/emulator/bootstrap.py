"""The prefill instance's bootstrap server, and the decode side's wait on it.

Real endpoints (what routers and connectors read):
- `GET /query`: vLLM MooncakeBootstrapServer's `{dp_rank: {"engine_id", "worker_addr": {tp: {pp: addr}}}}`.
- `POST /register`: accepted and ignored (real prefill workers register themselves here).
- `GET /route`: SGLang's bootstrap query; `engine_rank=-1` answers the prefill's parallel layout,
  otherwise this worker's `{"rank_ip", "rank_port"}`.
- `GET /health`: 200.
Emulator coordination:
- `GET /emulator/transfer/{key}?timeout=S`: long-polls until the prefill published under `key` is
  done; 200 with `{"key", "status": "done"|"aborted", "prompt_tokens", "cached_tokens", "engine_id",
  "kv_seed"}` (kv_seed: the content seed of the prompt whose KV the key holds, kv_content.py),
  or 408 when nothing arrived within S seconds.
Both the done entries and the waiting keys are bounded (oldest dropped first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import msgspec

from adapters.emulator.asgi import Receive, Scope, Send, send_json
from adapters.emulator.kv_content import RemoteKv

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A finished (or aborted) prefill leg, as the decode leg learns it."""

    key: str
    status: str  # "done" | "aborted"
    prompt_tokens: int
    cached_tokens: int
    engine_id: str
    kv_seed: int


class TransferRegistry:
    """Prefill completions by key, with waiters; bounded in both."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._done: OrderedDict[str, TransferDone] = OrderedDict()
        self._waiters: OrderedDict[str, asyncio.Event] = OrderedDict()

    def publish(self, done: TransferDone) -> None:
        self._done[done.key] = done
        self._done.move_to_end(done.key)
        while len(self._done) > self.limit:
            self._done.popitem(last=False)
        event = self._waiters.pop(done.key, None)
        if event is not None:
            event.set()

    async def wait(self, key: str, wait_s: float) -> TransferDone | None:
        done = self._done.get(key)
        if done is not None:
            return done
        event = self._waiters.get(key)
        if event is None:
            event = self._waiters[key] = asyncio.Event()
            while len(self._waiters) > self.limit:
                _, stale = self._waiters.popitem(last=False)
                stale.set()  # its waiters re-check, find nothing and time out early
        try:
            await asyncio.wait_for(event.wait(), wait_s)
        except TimeoutError:
            return None
        return self._done.get(key)


class BootstrapApp:
    """ASGI app of the bootstrap server."""

    def __init__(self, registry: TransferRegistry, engine_id: str, worker_addr: str, block_size: int) -> None:
        self.registry = registry
        self.engine_id = engine_id
        self.worker_addr = worker_addr
        self.block_size = block_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        path: str = scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode())
        if path == "/query":
            addr = {"0": {"0": self.worker_addr}}
            await send_json(send, 200, {"0": {"engine_id": self.engine_id, "worker_addr": addr}})
        elif path == "/register":
            await send_json(send, 200, {"status": "ok"})
        elif path == "/route":
            rank = query.get("engine_rank", ["-1"])[0]
            if rank == "-1":
                await send_json(
                    send,
                    200,
                    {"prefill_attn_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1, "page_size": self.block_size},
                )
            else:
                host, _, port = self.worker_addr.rpartition(":")
                await send_json(send, 200, {"rank_ip": host, "rank_port": int(port)})
        elif path == "/health":
            await send_json(send, 200, {"status": "ok"})
        elif path.startswith("/emulator/transfer/"):
            key = path[len("/emulator/transfer/") :]
            timeout = min(float(query.get("timeout", ["30"])[0]), 300.0)
            done = await self.registry.wait(key, timeout)
            if done is None:
                await send_json(send, 408, {"key": key, "status": "pending"})
            else:
                await send_json(
                    send,
                    200,
                    {
                        "key": done.key,
                        "status": done.status,
                        "prompt_tokens": done.prompt_tokens,
                        "cached_tokens": done.cached_tokens,
                        "engine_id": done.engine_id,
                        "kv_seed": done.kv_seed,
                    },
                )
        else:
            await send_json(send, 404, {"detail": "Not Found"})


async def wait_for_prefill(session: aiohttp.ClientSession, url: str, deadline_s: float, poll_s: float = 30.0) -> RemoteKv | None:
    """Long-poll the prefill's bootstrap server; the KV it holds once that prefill is done.

    None (prefill aborted, unreachable, or not done by the deadline) makes the decode leg prefill
    locally, as vLLM's decode does when a KV load fails (kv_load_failure_policy=recompute).
    """
    end = time.monotonic() + deadline_s
    failures = 0
    while (left := end - time.monotonic()) > 0 and failures < 5:
        timeout = min(poll_s, left)
        try:
            async with session.get(
                url, params={"timeout": f"{timeout:.3f}"}, timeout=aiohttp.ClientTimeout(total=timeout + 10)
            ) as resp:
                if resp.status == 408:
                    continue
                body: Any = await resp.json(content_type=None)
                if resp.status == 200 and isinstance(body, dict):
                    if body.get("status") != "done":
                        return None
                    seed = body.get("kv_seed")
                    return RemoteKv(seed if isinstance(seed, int) and not isinstance(seed, bool) else None)
                log.warning("bootstrap %s answered %s", url, resp.status)
                return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("bootstrap %s unreachable: %s", url, exc)
            failures += 1
            await asyncio.sleep(min(0.2, max(left, 0)))
    return None
