"""vLLM KV cache events over ZMQ, in vLLM's wire format (`vllm/distributed/kv_events.py`).

- PUB socket: bound when the endpoint has `*` or `::` or is ipc/inproc, otherwise connected (the
  subscriber binds), exactly vLLM's rule.
- Every message is three frames: `[topic, seq as 8-byte big-endian unsigned, msgpack payload]`.
- Payload: an EventBatch encoded as a msgpack array `[ts, events, data_parallel_rank]`; each event a
  msgpack map whose first key is `"type"` (msgspec's tagged struct): `BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`. Fields whose default is None and whose value is None are omitted (msgspec
  `omit_defaults`), the others are always present, as vLLM encodes them.
- Optional ROUTER replay socket (always bound): a request `[client_id, b"", start_seq (8 bytes)]`
  is answered with `[client_id, b"", seq, payload]` for every buffered batch with seq >= start_seq,
  then the end marker `[client_id, b"", (-1 as 8-byte signed big-endian), b""]`.
- The replay buffer is bounded (`buffer_steps` batches).
- A LoRA adapter's blocks: `lora_id` (the adapter's number, deprecated in vLLM), `lora_name`, and
  per block the extra keys untagged, `[name]` (vLLM's `to_event_extra_keys`); the adapter's path,
  which its hashes include, is never in the event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from adapters.emulator.config import EmulatorConfig
from adapters.emulator.lora import LoraAdapter
from adapters.emulator.prefix_cache import CacheChanges
from adapters.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _endpoint(sock: zmq.Socket[Any]) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def binds(endpoint: str) -> bool:
    """vLLM's heuristic: bind a stable (wildcard / local) endpoint, connect to a concrete host."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def block_stored(
    block_hashes: list[int], parent: int | None, token_ids: list[int], block_size: int, lora: LoraAdapter | None = None
) -> dict[str, Any]:
    """A BlockStored event as vLLM's block pool fills it for a request with no multimodal input
    nor cache salt, run on the base model or on the adapter `lora`."""
    return {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None if lora is None else lora.lora_id,
        "medium": MEDIUM_GPU,
        "lora_name": None if lora is None else lora.name,
        # one entry per block; vLLM sends the list even when every entry is None
        "extra_keys": [None if lora is None else [lora.name] for _ in block_hashes],
        "group_idx": 0,
    }


def block_removed(block_hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": MEDIUM_GPU, "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def events_for(changes: CacheChanges, block_size: int) -> list[dict[str, Any]]:
    """Removals first (they made room), then stores, as one engine step reports them."""
    events: list[dict[str, Any]] = []
    if changes.removed:
        events.append(block_removed(list(changes.removed)))
    for run in changes.stored:
        events.append(block_stored(list(run.block_hashes), run.parent_block_hash, list(run.token_ids), block_size, run.lora))
    return events


class KvEventPublisher:
    """Publishes EventBatches; call `start()` inside the running loop and `close()` at shutdown."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        delay_s: float = 0.0,
    ) -> None:
        self.endpoint = endpoint
        self.delay_s = delay_s  # each batch is sent this long after its step: a loaded engine's lag
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._replay_task: asyncio.Task[None] | None = None
        self.published = 0  # batches sent, for tests and logs

    @property
    def bound_endpoint(self) -> str:
        """The PUB endpoint as bound (resolves `tcp://*:0` to the real port)."""
        return _endpoint(self._pub) if binds(self.endpoint) else self.endpoint

    @property
    def bound_replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return _endpoint(self._replay)

    def start(self) -> None:
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Send one batch now. PUB never blocks: past the high-water mark ZMQ drops, as in vLLM."""
        if not events:
            return
        payload = self._encode([time.time(), events, self._dp_rank])
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.published += 1
        if self.delay_s > 0:  # one delay for all: the batches keep their order
            asyncio.get_running_loop().call_later(self.delay_s, self._send, seq, payload)
        else:
            self._send(seq, payload)

    def _send(self, seq: int, payload: bytes) -> None:
        if self._pub.closed:
            return
        try:
            # An asyncio socket's send returns a future; PUB sends complete immediately.
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # no peer, HWM reached: the replay buffer still has it
            log.debug("kv event batch %d not sent: %s", seq, exc)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client_id, b"", END_SEQ, b""))

    async def close(self) -> None:
        await cancel_and_wait(self._replay_task)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def publisher_for(config: EmulatorConfig) -> KvEventPublisher | None:
    """vLLM's KV events publisher, where the worker is configured with an endpoint."""
    if not config.kv_events_endpoint:
        return None
    replay, topic, steps = config.kv_events_replay_endpoint, config.kv_events_topic, config.kv_events_buffer_steps
    return KvEventPublisher(
        config.kv_events_endpoint, replay_endpoint=replay, topic=topic, buffer_steps=steps, delay_s=config.kv_events_delay_s
    )
