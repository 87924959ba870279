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
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20_000, 32_000  # below Linux's default ephemeral range (32768-60999)
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
