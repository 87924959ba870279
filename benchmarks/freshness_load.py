"""bench_freshness's event load: a process of its own with one ZMQ PUB socket per engine instance,
publishing vLLM-format KV event batches (three frames: topic, 8-byte seq, msgpack EventBatch, as
vLLM's ZmqEventPublisher sends them) at a fixed total rate of block events per second.

The batches are built before the clock starts (benchmarks/common.event_payloads: chained
BlockStored events with their token ids and, once an instance's cache is full, BlockRemoved of as
many old blocks), then cycled, each instance's sequence numbers counting up, so publishing costs a
send per batch and the measured process (the gateway) does all the decoding and indexing.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq


def block_events(payload: bytes) -> int:
    """Stored + removed blocks in one encoded batch."""
    _, events, _ = msgspec.msgpack.decode(payload)
    return sum(len(e.get("block_hashes", ())) for e in events if isinstance(e, dict))


def publish_load(conn: Connection, instances: list[str], rate: float, blocks_per_batch: int, batches: int) -> None:
    """Child process body: bind a PUB per instance, send their endpoints, wait for (start, seconds),
    publish at `rate` block events/s in all until then, and send back what was sent and the CPU used."""
    from common import event_payloads

    payloads, _ = event_payloads(len(instances), batches, blocks_per_batch=blocks_per_batch, cache_blocks=2 * blocks_per_batch)
    per_instance = list(payloads.values())
    sizes = [[block_events(p) for p in batch_list] for batch_list in per_instance]
    ctx = zmq.Context()
    socks = []
    for _ in instances:
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.set_hwm(100_000)
        sock.bind("tcp://127.0.0.1:*")
        socks.append(sock)
    conn.send([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks])
    start_at, seconds = conn.recv()
    cpu0 = time.process_time()
    sent_events = sent_batches = 0
    seqs = [0] * len(socks)
    turn = 0
    while time.time() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    while (now := time.time()) < end:
        due = rate * (now - start_at)
        if sent_events >= due:
            time.sleep(0.001)  # ahead of the rate: ~1 ms of slack, batches leave in small bursts
            continue
        i = turn % len(socks)
        j = seqs[i] % batches
        socks[i].send_multipart((b"", seqs[i].to_bytes(8, "big"), per_instance[i][j]), flags=zmq.NOBLOCK)
        seqs[i] += 1
        sent_events += sizes[i][j]
        sent_batches += 1
        turn += 1
    report: dict[str, Any] = {
        "block_events": sent_events,
        "batches": sent_batches,
        "seconds": time.time() - start_at,
        "cpu_s": time.process_time() - cpu0,
    }
    conn.send(report)
    try:
        conn.recv()  # the sockets stay open while the gateway reads; it exits without a word
    except EOFError:
        pass
    for s in socks:
        s.close(linger=0)
    ctx.term()
