"""Shared fixtures: emulators as real subprocesses, and a KV event subscriber written from vLLM's
published wire format only (ZMQ SUB + a generic msgpack decoder; no project code)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from tests.support.emulator import Emulator, start_emulator


class Subscriber:
    """Receives `[topic, seq, payload]` messages; payload = msgpack `[ts, events, dp_rank]`."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        time.sleep(0.3)  # ZMQ slow joiner: let the subscription reach the publisher

    def batches(self, timeout: float = 2.0, until: int | None = None) -> list[tuple[bytes, int, list[Any]]]:
        """Messages received within `timeout` (or as soon as `until` of them arrived)."""
        out: list[tuple[bytes, int, list[Any]]] = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and (until is None or len(out) < until):
            if not self.sock.poll(int(left * 1000)):
                break
            topic, seq, payload = self.sock.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        return out

    def events(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        return [event for _, _, batch in self.batches(timeout) for event in batch[1]]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def subscriber() -> Iterator[Any]:
    subs: list[Subscriber] = []

    def make(endpoint: str) -> Subscriber:
        sub = Subscriber(endpoint)
        subs.append(sub)
        return sub

    yield make
    for sub in subs:
        sub.close()


@pytest.fixture(scope="module")
def mixed() -> Iterator[Emulator]:
    """A mixed instance, fast clock, events on, a prefix cache of 64 blocks of 16 tokens."""
    with start_emulator(
        "mixed", kv_events=True, kv_events_replay=True, time_scale=0.01, kv_capacity_tokens=1024, hash_algo="sha256_cbor"
    ) as emu:
        yield emu


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as c:
        yield c
