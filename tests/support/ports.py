"""Free loopback ports for the servers a test starts, chosen where nothing else takes them.

A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from the ephemeral range
(net.ipv4.ip_local_port_range, 32768-60999 on Linux), the same range every outgoing connection's
local port is drawn from. Between a test learning such a port and a child process binding it
(a second or more for an interpreter to start), any client connection on the machine -- an engine
talking to another, a Redis client -- may take it, and the server then fails with EADDRINUSE
(seen in the suite: an emulator that could not bind the port it was given). Ports below the
ephemeral range are handed to no connection, so the only ones that can collide are those other
servers picked, which a random choice over ~12,000 ports makes rare, and the bind check catches
when it is taken now. Ports handed out in this process are not handed out again.

Under pytest-xdist each worker process draws from its own slice of that range: a port one worker
gives a test for "nowhere" (a ZMQ client whose server never starts, or has stopped) is dialled again
and again, since ZMQ reconnects, and another worker's server bound there receives those messages. In
a CI run a vLLM prefill's NIXL handshake listener, on a port another worker had handed out, got such
a message, died on it, and every P/D handshake with that engine then timed out.
"""

from __future__ import annotations

import os
import random
import socket


def _slice(low: int, high: int) -> tuple[int, int]:
    """This xdist worker's share of [low, high), or all of it outside xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1):
        return low, high
    width = (high - low) // int(count)
    start = low + width * (int(worker[2:]) % int(count))
    return start, start + width


LOW, HIGH = _slice(20_000, 32_000)  # below Linux's default ephemeral range (32768-60999)
_given: set[int] = set()
_rng = random.Random()


def _free(port: int, kind: int = socket.SOCK_STREAM) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port that is free now, outside the ephemeral range, not given out before here."""
    return free_port_run(1, kind)


def free_port_run(n: int, kind: int = socket.SOCK_STREAM) -> int:
    """The first of `n` consecutive such ports (e.g. the admin ports of N workers)."""
    for _ in range(1000):
        base = _rng.randrange(LOW, HIGH - n)
        run = range(base, base + n)
        if not _given.intersection(run) and all(_free(p, kind) for p in run):
            _given.update(run)
            return base
    raise RuntimeError(f"no run of {n} free ports found in {LOW}-{HIGH}")
