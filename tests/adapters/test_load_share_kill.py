"""A replica SIGKILLed while it holds in-flight load and the fleet's decision turn (issue 33): what it
left in Redis carries the expiry the code set (its table: the share's ttl_ms; the turn: hold_ms),
never none, and the survivor stops counting its load and takes the turn without anyone cleaning up.

The dying replica is a real process (a RedisLoadShare with turns, a prefill and a stream in its
table, publishing every beat). Once the survivor counts its load, the test tells it to die: it takes
the turn as a decision does and SIGKILLs itself before the release can run (killed mid-decision, at
a point the test does not have to race for). Against the real Redis on 127.0.0.1:6379, each test
its own key prefix. No wall-clock assertion: the waits poll for a state with a generous bound,
which only a hang reaches.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from adapters.load_share import RedisLoadShare

URL = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parents[2]
START_S = 60.0  # generous: a bound for a hang, never a pace

# the dying replica: argv url, prefix; "ready" once published; on a line from the test it takes the
# turn and kills itself while holding it
DYING = """
import asyncio, os, signal, sys, time
from adapters.load_share import RedisLoadShare

async def main(url: str, prefix: str) -> None:
    share = RedisLoadShare(url, "dying", interval_s=0.05, prefix=prefix, timeout_s=2.0, turns=True)
    table = {"prefill-0": ([(4000, 0, time.time())], []), "decode-0": ([], [(4000, 200, True)])}
    await share.start(lambda: table)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # beats go on meanwhile
    await share.refresh(0.0)  # a decision takes the turn; its release is due two loop turns on
    assert share.turn is not None and share.turn.holding
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def until(cond: Callable[[], Awaitable[bool]], within_s: float = START_S) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.02)
    return await cond()


async def test_a_replica_killed_holding_load_and_the_turn_leaves_nothing_that_outlives_its_ttl(prefix: str) -> None:
    registry = CollectorRegistry()
    survivor = RedisLoadShare(URL, "survivor", interval_s=0.05, prefix=prefix, timeout_s=2.0, turns=True, registry=registry)

    def peers() -> float | None:  # what the survivor's /metrics says it counts
        return registry.get_sample_value("conductor_load_share_peers")

    await survivor.start(dict)
    client = aioredis.Redis.from_url(URL)
    dying = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DYING, URL, prefix, cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert dying.stdout is not None and dying.stdin is not None
        assert await asyncio.wait_for(dying.stdout.readline(), START_S) == b"ready\n"

        async def counted() -> bool:
            await survivor.sync()
            return peers() == 1 and "prefill-0" in survivor.remote()

        assert await until(counted)  # the survivor counts the dying replica's load: there is something to release
        dying.stdin.write(b"die\n")
        await dying.stdin.drain()
        assert await dying.wait() == -signal.SIGKILL  # killed holding the turn (a failed assert exits 1)
        async with client.pipeline(transaction=False) as pipe:
            pipe.pttl(f"{prefix}dying")
            pipe.pttl(f"{prefix}turn")
            pipe.get(f"{prefix}turn")
            table_ttl, turn_ttl, holder = await pipe.execute()

        # what it left expires by itself, no later than the code said (-2: already gone; -1, no
        # expiry, would keep its load counted, or the turn held, for good)
        assert table_ttl == -2 or 0 < table_ttl <= survivor.ttl_ms
        assert survivor.turn is not None
        assert turn_ttl == -2 or (0 < turn_ttl <= survivor.turn.hold_ms and holder == b"dying")

        async def released() -> bool:
            await survivor.sync()
            members = await client.zrange(f"{prefix}replicas", 0, -1)
            return peers() == 0 and survivor.remote() == {} and b"dying" not in members

        assert await until(released), (peers(), survivor.remote())

        async def turn_taken() -> bool:
            await survivor.refresh(0.0)
            return survivor.turn is not None and survivor.turn.holding

        assert await until(turn_taken), survivor.turn.counts
    finally:
        if dying.returncode is None:
            dying.kill()
            await dying.wait()
        await survivor.close()
        await client.aclose()
