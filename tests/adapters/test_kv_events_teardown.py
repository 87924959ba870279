"""Engines dying, and the gateway shutting down, while its KV event feeds hold a backlog (issue 33):
the gateway process survives and EventSubscriber.close() returns.

Both sides run in processes of their own (tests/adapters/kv_event_load.py): a libzmq assertion
aborts the whole process, and a feed that never yields stops its whole event loop, neither of which
a test could watch from inside. The publisher floods real PUB sockets far faster than the gateway
applies the batches; "killed" SIGKILLs the publisher (engines dying under load) and then closes the
subscribers, "flooded" closes them while the flood goes on. Before the fix, "killed" aborted in
libzmq (`Assertion failed: !_more (src/fq.cpp:80)`: the reconnect after the cut disconnected the SUB
socket while ZMQ held the first frame of a queued message), and in "flooded" the first feed never
let the event loop go (each receive of a queued frame returns at once), so the other feeds, and any
close(), never ran.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.adapters.kv_event_load import CLOSE_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
ENGINES = 4
START_S = 60.0  # generous bounds on a busy box: they fail the test, they never pace it
EXIT_S = 60.0

Process = asyncio.subprocess.Process


async def spawn(*args: str) -> Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.adapters.kv_event_load",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[Process, list[int]]]:
    proc = await spawn("publish", str(ENGINES))
    try:
        assert proc.stdout is not None
        ports = json.loads(await asyncio.wait_for(proc.stdout.readline(), START_S))
        yield proc, ports
    finally:
        await stop(proc)


async def stop(proc: Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


@pytest.mark.parametrize("mode", ["killed", "flooded"])
async def test_the_gateway_survives_and_closes_its_feeds_under_a_backlog(publisher: tuple[Process, list[int]], mode: str) -> None:
    pub, ports = publisher
    gw = await spawn("gateway", mode, *map(str, ports))
    try:
        assert gw.stdout is not None
        try:
            line = await asyncio.wait_for(gw.stdout.readline(), START_S)
        except TimeoutError:
            pytest.fail(f"not every feed applied its first batches within {START_S} s: one kept the event loop to itself")
        assert line == b"ready\n", (line, await gw.stderr.read() if gw.stderr else b"")
        if mode == "killed":
            pub.send_signal(signal.SIGKILL)
            await pub.wait()
        try:
            out, err = await asyncio.wait_for(gw.communicate(), EXIT_S)
        except TimeoutError:
            pytest.fail(f"the gateway process did not end within {EXIT_S} s: its event loop is stuck")
    finally:
        await stop(gw)
    assert b"Assertion failed" not in err, err.decode(errors="replace")
    assert gw.returncode != -signal.SIGABRT, "the gateway process aborted"
    assert gw.returncode != CLOSE_TIMEOUT, "EventSubscriber.close() did not return in time"
    assert gw.returncode == 0 and out == b"closed\n", (gw.returncode, out, err.decode(errors="replace"))
