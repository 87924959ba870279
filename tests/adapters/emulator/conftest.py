"""Shared fixtures: emulators as real subprocesses, and a KV event subscriber written from vLLM's
published wire format only (ZMQ SUB + a generic msgpack decoder; no project code)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from tests.support.emulator import Emulator, start_emulator

# Marker prompts of 129 tokens (a full block stored at any block size up to 128), told apart by
# tokens 3 and 4; no other test prompt repeats a token three times in a row.
_MARK = 249


def _marker(n: int) -> list[int]:
    return [_MARK, _MARK, _MARK, n // 250 % 250, n % 250] + [_MARK] * 124


def _marker_index(event: dict[str, Any]) -> int | None:
    tokens = event.get("token_ids") or []
    if event.get("type") == "BlockStored" and tokens[:3] == [_MARK] * 3 and len(tokens) >= 5:
        return int(tokens[3]) * 250 + int(tokens[4])
    return None


def _newest_marker(batches: list[tuple[bytes, int, list[Any]]], newest: int) -> int:
    found = [i for _, _, batch in batches for e in batch[1] if (i := _marker_index(e)) is not None]
    return max([newest, *found])


class Subscriber:
    """Receives `[topic, seq, payload]` messages; payload = msgpack `[ts, events, dp_rank]`.

    Every read is bounded generously (`within_s`), to fail a hang, never to time the emulator."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def join(self, emu: Emulator, within_s: float = 30.0) -> None:
        """Return once the subscription is live and nothing published before now is left to read.

        ZMQ's slow joiner: a SUB misses what is published before its subscription reaches the
        publisher, and no fixed wait makes sure it has. So publish marker batches until one arrives:
        every later one arrives too, in order. Read up to the last marker, then reset the emulator
        (the markers leave its cache and request log) and read up to that AllBlocksCleared."""
        deadline = time.monotonic() + within_s
        sent, newest = 0, -1
        with httpx.Client(timeout=30.0) as client:
            while newest < 0:  # not joined yet: one more marker, then a short look for any
                assert time.monotonic() < deadline, f"none of {sent} marker batches arrived"
                client.post(emu.url + "/v1/completions", json={"prompt": _marker(sent), "max_tokens": 1}).raise_for_status()
                sent += 1
                newest = _newest_marker(self.batches(within_s=0.05), newest)
            while newest < sent - 1:  # joined: the later markers are on their way, in order
                batches = self.batches(within_s=max(deadline - time.monotonic(), 0.0), until=1)
                assert batches, f"markers {newest + 1}..{sent - 1} never arrived"
                newest = _newest_marker(batches, newest)
            client.post(emu.url + "/emulator/reset").raise_for_status()
        self.read_until(lambda e: e["type"] == "AllBlocksCleared", max(deadline - time.monotonic(), 1.0))

    def batches(self, within_s: float = 30.0, until: int | None = None) -> list[tuple[bytes, int, list[Any]]]:
        """Messages received within `within_s` (or as soon as `until` of them arrived)."""
        out: list[tuple[bytes, int, list[Any]]] = []
        deadline = time.monotonic() + within_s
        while (left := deadline - time.monotonic()) > 0 and (until is None or len(out) < until):
            if not self.sock.poll(int(left * 1000)):
                break
            topic, seq, payload = self.sock.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        return out

    def read_until(self, last: Callable[[dict[str, Any]], bool], within_s: float = 30.0) -> list[dict[str, Any]]:
        """Every event received, up to and including the first for which `last(event)` holds."""
        deadline = time.monotonic() + within_s
        out: list[dict[str, Any]] = []
        while True:
            left = deadline - time.monotonic()
            batch = self.batches(within_s=left, until=1) if left > 0 else []
            assert batch, f"no event ended the read within {within_s} s; got {[e['type'] for e in out]}"
            for event in batch[0][2][1]:
                out.append(event)
                if last(event):
                    return out

    def events_until_reset(self, emu: Emulator) -> list[dict[str, Any]]:
        """Everything published since the last read: the emulator is reset, and what came before
        its AllBlocksCleared (which comes after every event of the requests already answered) returned."""
        httpx.post(emu.url + "/emulator/reset", timeout=30).raise_for_status()
        return self.read_until(lambda e: e["type"] == "AllBlocksCleared")[:-1]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def subscriber() -> Iterator[Any]:
    subs: list[Subscriber] = []

    def make(emu: Emulator) -> Subscriber:
        """A subscriber to `emu`'s KV events that has joined: it gets every batch published after this."""
        assert emu.kv_events_endpoint is not None
        sub = Subscriber(emu.kv_events_endpoint)
        subs.append(sub)
        sub.join(emu)
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
