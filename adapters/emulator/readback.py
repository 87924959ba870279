"""Bidirectional NIXL KV transfer (vLLM 0.32): a decode's KV read back by the next turn's prefill.

The wire and the rules are in protocols.py's docstring. Here:
- `ReadbackStore` (decode side): the pinned KV of each normally finished sequence, by request id,
  with its expiry (`decoder_kv_blocks_ttl`, wall seconds: a deadline, not a modelled duration);
  a read or the expiry releases the pin (the engine then lets the blocks be evicted).
- `SideChannelApp`: the decode's side channel port, serving the reads over HTTP.
- `KvPuller` (prefill side): vLLM's pull rule, the read, the content check and the failure path.

Content honesty: what a prefill reads is the decode's KV of that request, as content ids
(kv_content.py) of its prompt + generated tokens, as tainted as that decode's KV was. The prefill
compares them with its own prompt's ids at the same positions; a difference means it now runs on
wrong KV (`Taint`), so its text, and that of whatever reads its KV next, differs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from adapters.emulator.asgi import Receive, Scope, Send, read_body, send_json
from adapters.emulator.engine import Engine, KvPull, Sequence
from adapters.emulator.kv_content import (
    PulledKv,
    Taint,
    content_block_ids,
    first_mismatch,
    generated_token_ids,
    held_block_ids,
    ids_digest,
)
from adapters.emulator.protocols import NixlAnswer, ReadbackHandle

log = logging.getLogger(__name__)
_PATH = "/emulator/kv/"
_READ_TIMEOUT_S = 10.0


@dataclass(eq=False, slots=True)
class _Pinned:
    seq: Sequence
    tokens: list[int]  # the computed tokens (prompt + generated - 1): what the KV holds
    expiry: float  # time.perf_counter() at expiry, as the decode answers it
    timer: asyncio.TimerHandle


class ReadbackStore:
    """A bidirectional decode's pinned KV, one entry per finished request."""

    def __init__(self, engine: Engine, nixl: NixlAnswer, ttl_s: float) -> None:
        self.engine = engine
        self.nixl = nixl
        self.ttl_s = ttl_s
        self._pins: dict[str, _Pinned] = {}
        engine.on_pinned = self.pin

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, seq: Sequence) -> None:
        """Called by the engine as `seq` finishes: keep its KV for `ttl_s` or one read."""
        # the last sampled token was never fed back, so its KV does not exist
        tokens = seq.prompt + generated_token_ids(seq.text_seed, seq.generated - 1)
        timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, seq.request_id)
        old = self._pins.pop(seq.request_id, None)
        if old is not None:  # a reused request id: the older KV is unreachable now
            self._drop(old)
        self._pins[seq.request_id] = _Pinned(seq, tokens, time.perf_counter() + self.ttl_s, timer)

    def params(self, seq: Sequence) -> dict[str, Any] | None:
        """The decode's answer for `seq`: where its KV can be read (None when it is not pinned)."""
        pinned = self._pins.get(seq.request_id)
        if pinned is None or pinned.seq is not seq:
            return None
        ids = held_block_ids(pinned.tokens, self.nixl.block_size, seq.kv_taint)
        return self.nixl.decode_params(seq.request_id, ids, len(pinned.tokens), pinned.expiry)

    def read(self, request_id: str, first_block: int, num_tokens: int) -> list[int] | None:
        """The ids of blocks `first_block..` up to token `num_tokens` of a pinned request, releasing
        the pin; None when there is none, or it holds fewer tokens than asked."""
        pinned = self._pins.pop(request_id, None)
        if pinned is None:
            return None
        self._drop(pinned)
        if num_tokens > len(pinned.tokens):
            return None
        ids = held_block_ids(pinned.tokens[:num_tokens], self.nixl.block_size, pinned.seq.kv_taint)
        return ids[first_block:]

    def _expire(self, request_id: str) -> None:
        pinned = self._pins.pop(request_id, None)
        if pinned is not None:
            log.info("readback KV of %s expired unread", request_id)
            self._drop(pinned)

    def _drop(self, pinned: _Pinned) -> None:
        pinned.timer.cancel()
        self.engine.unpin(pinned.seq)


class SideChannelApp:
    """ASGI app on the decode's side channel port: `POST /emulator/kv/{request_id}/read`."""

    def __init__(self, store: ReadbackStore, engine_id: str) -> None:
        self.store = store
        self.engine_id = engine_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if scope["method"] != "POST" or not path.startswith(_PATH) or not path.endswith("/read"):
            await send_json(send, 404, {"detail": "Not Found"})
            return
        request_id = path[len(_PATH) : -len("/read")]
        raw = await read_body(receive, 1 << 16)
        try:
            body = msgspec.json.decode(raw or b"{}")
            engine_id, first, tokens = str(body["engine_id"]), int(body["first_block"]), int(body["num_tokens"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            await send_json(send, 400, {"detail": "engine_id, first_block and num_tokens are required"})
            return
        if engine_id != self.engine_id:  # NIXL's handshake would refuse another engine's handle
            await send_json(send, 409, {"status": "wrong engine", "engine_id": self.engine_id})
            return
        ids = self.store.read(request_id, first, tokens)
        if ids is None:
            await send_json(send, 404, {"status": "gone", "request_id": request_id})
        else:
            await send_json(send, 200, {"block_ids": ids})


class KvPuller:
    """A bidirectional prefill's side: decides, reads and checks what it pulls from a decode."""

    def __init__(
        self, session: Callable[[], aiohttp.ClientSession], block_size: int, threshold: int, on_failure: Callable[[], None]
    ) -> None:
        self.session = session
        self.block_size = block_size
        self.threshold = threshold
        self.on_failure = on_failure
        self._notices: set[asyncio.Task[list[int] | None]] = set()

    def pull(self, handle: ReadbackHandle) -> KvPull:
        async def run(seq: Sequence, local_tokens: int) -> PulledKv | None:
            return await self._pull(handle, seq, local_tokens)

        return run

    async def _pull(self, handle: ReadbackHandle, seq: Sequence, local: int) -> PulledKv | None:
        size = self.block_size
        wanted = handle.num_tokens if handle.num_tokens is not None else handle.num_blocks * size
        end = min(wanted, seq.prompt_tokens)
        count = end - local
        if count <= 0 or count < self.threshold:
            self.release(handle)  # nothing to pull; the holder is told all the same, so it frees the blocks now
            return None
        ids = await self._read(handle, local // size, end) if handle.num_blocks * size >= end else None
        if ids is None:  # vLLM's kv_load_failure_policy=recompute: the prefill computes it all
            log.warning(
                "KV readback of %s from %s:%d failed; recomputing %d tokens", handle.request_id, handle.host, handle.port, count
            )
            self.on_failure()
            return None
        own = content_block_ids(seq.prompt[:end], size)[local // size :]
        bad = first_mismatch(ids, own)
        if bad is None:
            return PulledKv(count, seq.kv_taint, seq.kv_seed)
        # wrong KV from block `first` on; the garbage depends on what was read
        taint = Taint(local // size + bad, ids_digest(ids))
        return PulledKv(count, taint, held_block_ids(seq.prompt, size, taint)[-1])

    def release(self, handle: ReadbackHandle) -> None:
        """Tell the holder of `handle` its pinned KV is no longer wanted (NIXL's free notification),
        in the background."""
        task = asyncio.get_running_loop().create_task(self._read(handle, 0, 0))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def _read(self, handle: ReadbackHandle, first_block: int, num_tokens: int) -> list[int] | None:
        body = {"engine_id": handle.engine_id, "first_block": first_block, "num_tokens": num_tokens}
        try:
            async with self.session().post(handle.url, json=body, timeout=aiohttp.ClientTimeout(total=_READ_TIMEOUT_S)) as resp:
                answer: Any = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("side channel %s unreachable: %s", handle.url, exc)
            return None
        if resp.status != 200 or not isinstance(answer, dict):
            if num_tokens:
                log.warning("side channel %s answered %s: %s", handle.url, resp.status, answer)
            return None
        ids = answer.get("block_ids")
        return ids if isinstance(ids, list) and all(type(b) is int for b in ids) else None
