"""The two processes of the KV event teardown tests (tests/adapters/test_kv_events_teardown.py): run
as `python -m tests.adapters.kv_event_load publish N` or `... gateway MODE PORT...`.

publish: N engines' PUB sockets (vLLM binds them), each flooding [topic, seq, EventBatch] messages
as fast as this process can send them, far faster than a gateway applies them, so the gateway's SUB
sockets always hold a backlog (ZMQ's high-water marks drop the rest). Prints the ports as a JSON
line, then floods until killed.

gateway: one EventSubscriber per port, as the gateway runs them. Prints "ready" once every feed has
applied READY_BATCHES batches, then
- MODE "killed": waits until every subscriber has seen its connection cut (the test SIGKILLs the
  publisher: engines dying under load), applies what is left, and closes the subscribers;
- MODE "flooded": closes the subscribers while the flood goes on.
Exit status 0 once every close() returned within CLOSE_S; CLOSE_TIMEOUT when they did not. A libzmq
assertion aborts the process (SIGABRT), which the test sees as its exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time

import msgspec
import zmq
import zmq.asyncio

from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.kv_event_batch import EventBatch
from adapters.kv_events import EventSource, EventSubscriber
from conductor.core.block_keys import XxhashKeys

BS = 16
READY_BATCHES = 200
CLOSE_S = 10.0
CLOSE_TIMEOUT = 3  # exit status: close() did not return in time


def batches(count: int = 64, blocks: int = 16) -> list[bytes]:
    """Encoded EventBatches of a BlockStored each, a fresh chain per batch, cycled by the flood."""
    out = []
    for k in range(count):
        hashes = list(range(1 + k * blocks, 1 + (k + 1) * blocks))
        tokens = [(k * 131 + i) % 50_000 for i in range(blocks * BS)]
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens, "block_size": BS}
        out.append(msgspec.msgpack.encode([time.time(), [event], 0]))
    return out


def publish(engines: int) -> None:
    ctx = zmq.Context()
    socks = []
    for _ in range(engines):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        socks.append(sock)
    ports = [sock.bind_to_random_port("tcp://127.0.0.1") for sock in socks]
    print(json.dumps(ports), flush=True)
    payloads = batches()
    seq, parent = 0, os.getppid()
    while seq % 4096 or os.getppid() == parent:  # until killed, or orphaned by a test run cut short
        # a PUB socket drops what its subscriber's queue has no room for: this never blocks
        payload = payloads[seq % len(payloads)]
        for sock in socks:
            sock.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1


class RoundTrip:
    """A network round trip per batch, as a shared index (Redis) costs: a byte through a loopback
    socket to a thread that sends it back. The feed's task waits on real I/O meanwhile, and the
    event loop serves the other sockets' events."""

    def __init__(self) -> None:
        self.near, far = socket.socketpair()
        self.near.setblocking(False)
        threading.Thread(target=self._echo, args=(far,), daemon=True).start()
        self.lock = asyncio.Lock()  # one byte in flight: each feed gets its own reply

    @staticmethod
    def _echo(far: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the process is ending: the near end is gone
            while data := far.recv(1):
                far.sendall(data)

    async def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        async with self.lock:
            await loop.sock_sendall(self.near, b"x")
            await loop.sock_recv(self.near, 1)


class Cuts(logging.Handler):
    """Which subscribers logged their connection cut: an event once all of them have."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.waiting = set(names)
        self.all_cut = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "connection cut" in message:
            self.waiting = {n for n in self.waiting if f"from {n}:" not in message}
            if not self.waiting:
                self.all_cut.set()


async def gateway(mode: str, ports: list[int]) -> int:
    ctx = zmq.asyncio.Context()
    feeder = IndexFeeder(MemoryIndex(), XxhashKeys(BS), translate=True)
    names = [f"engine-{i}" for i in range(len(ports))]
    applied = dict.fromkeys(names, 0)
    ready = asyncio.Event()
    round_trip = RoundTrip()

    async def on_batch(instance: str, batch: EventBatch) -> None:
        await feeder.on_batch(instance, batch)
        applied[instance] += 1
        if min(applied.values()) >= READY_BATCHES:
            ready.set()
        if mode == "killed":
            await round_trip()

    cuts = Cuts(set(names))
    logging.getLogger("adapters.kv_events").addHandler(cuts)
    subs = [
        EventSubscriber(EventSource(n, f"tcp://*:{p}"), on_batch, feeder.on_resync, context=ctx, catch_up=False)
        for n, p in zip(names, ports, strict=True)
    ]
    for sub in subs:
        await sub.start()
    await ready.wait()
    print("ready", flush=True)
    if mode == "killed":
        await cuts.all_cut.wait()  # the feeds read on meanwhile: their backlogs outlive the engines
    try:
        async with asyncio.timeout(CLOSE_S):
            for sub in subs:
                await sub.close()
    except TimeoutError:
        return CLOSE_TIMEOUT
    ctx.destroy(linger=0)
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "publish":
        publish(int(rest[0]))
    else:
        sys.exit(asyncio.run(gateway(rest[0], [int(p) for p in rest[1:]])))
