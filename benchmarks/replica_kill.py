"""`python benchmarks/bench_replicas.py --compare kill`: three replicas, one of them SIGKILLed part-way
through the replay (no graceful shutdown: its load table is left to expire, its connections cut).

Two runs on fresh clusters at the same rate: three replicas with no kill, then the same replay with
replica 2 killed just before request `--kill-after` x N is due. The client stands for a load balancer with
passive health checks: a connection refused marks the replica down and the request goes to the next
one up (counted as a retry); from then on the requests are spread over the survivors. A request cut
mid-stream is not retried (it is not idempotent): it is an error at the client, a loss.

Printed per run: SLO attainment (met / sent, by the TTFT SLO, by the TBT SLO and by both; a 429 or
an error is a miss) of the requests due before the kill, of those sent to the survivors among them,
and of those due after it (the first 2 s after apart), with the errors and retries. For the kill
run, how long the dead replica's in-flight table went on counting, in seconds from the kill: in
Redis (its table key and its entry in the members set) and in each survivor's own view (its
`conductor_load_share_peers` gauge on /metrics falling to 1), with the key's remaining TTL at the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from conductor.demo.cluster import Child, ChildGroup
from conductor.demo.run import DEFAULT_MODEL
from traces.live_client import HttpOutcome, stream_completion
from traces.synth import SynthRequest


def completion_body(item: SynthRequest) -> dict[str, Any]:
    """The streamed completion a replay sends for one trace request (bench_replicas.py's too)."""
    return {
        "model": DEFAULT_MODEL,
        "prompt": list(item.prompt),
        "max_tokens": item.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }


VICTIM = 2  # the replica killed: one of the extra gateways (replica 0 is the cluster's own)
LOAD_PREFIX = "conductor:load:"  # RedisLoadShare's default key prefix
_PEERS = re.compile(rb"^conductor_load_share_peers ([0-9.eE+-]+)", re.M)
EARLY_S = 2.0  # "just after the kill": the dead table's TTL (1 s) and a margin


@dataclass
class Served:
    index: int
    replica: int  # the replica that answered (after any retry)
    due_s: float  # seconds from the replay start
    http: HttpOutcome


@dataclass
class Release:
    """Seconds from the kill until the dead replica's table stopped counting (None: not within the watch)."""

    key_pttl_at_kill_s: float | None = None
    turn_held_at_kill: bool = False
    key_gone_s: float | None = None
    member_gone_s: float | None = None
    survivors_s: list[float | None] = field(default_factory=list)


class Balancer:
    """Round robin over the replicas up; a connection refused marks one down (a failed health check)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.down: set[int] = set()
        self.retries = 0

    def pick(self, i: int, tried: set[int]) -> int | None:
        up = [r for r in range(self.n) if r not in self.down and r not in tried]
        if not up:
            return None
        return i % self.n if len(up) == self.n else up[i % len(up)]


def refused(http: HttpOutcome) -> bool:
    """Nothing listened on the replica's port: safe to send the request elsewhere."""
    return http.status == "error" and http.http_status is None and (http.message or "").startswith("ClientConnectorError")


def replica_id(child: Child) -> str:
    """The load share replica id in the config the child was started with."""
    argv = list(child.proc.args)  # type: ignore[arg-type]
    config = yaml.safe_load(Path(str(argv[argv.index("--config") + 1])).read_text(encoding="utf-8"))
    return str(config["load_share"]["replica_id"])


async def peers_seen(session: aiohttp.ClientSession, url: str) -> float | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.get(url + "/metrics") as resp:
            found = _PEERS.search(await resp.read())
            return float(found.group(1)) if found else None
    return None


async def watch_release(redis_url: str, victim: str, survivors: Sequence[str], limit_s: float = 30.0) -> Release:
    """Poll Redis (every 5 ms) and the survivors' /metrics (every 20 ms) from the kill on."""
    loop = asyncio.get_running_loop()
    killed = loop.time()
    key, members, turn = f"{LOAD_PREFIX}{victim}", f"{LOAD_PREFIX}replicas", f"{LOAD_PREFIX}turn"
    out = Release(survivors_s=[None] * len(survivors))
    client = aioredis.Redis.from_url(redis_url)
    probe = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
    try:
        pttl, holder = await client.pttl(key), await client.get(turn)
        out.key_pttl_at_kill_s = pttl / 1000 if pttl >= 0 else None
        out.turn_held_at_kill = holder == victim.encode()
        last_scrape = -1.0
        while loop.time() - killed < limit_s:
            now = loop.time() - killed
            if out.key_gone_s is None and not await client.exists(key):
                out.key_gone_s = now
            if out.member_gone_s is None and await client.zscore(members, victim) is None:
                out.member_gone_s = now
            if now - last_scrape >= 0.02:
                last_scrape = now
                for j, url in enumerate(survivors):
                    if out.survivors_s[j] is None and await peers_seen(probe, url) == len(survivors) - 1:
                        out.survivors_s[j] = loop.time() - killed
            if None not in (out.key_gone_s, out.member_gone_s, *out.survivors_s):
                break
            await asyncio.sleep(0.005)
    finally:
        await probe.close()
        await client.aclose()
    return out


async def replay_with_kill(
    urls: Sequence[str], requests: Sequence[SynthRequest], args: argparse.Namespace, victim: tuple[Child, str] | None
) -> tuple[list[Served], float, Release | None, int]:
    """The replay (request i to replica i mod 3 while all are up); `victim` SIGKILLed just before
    request kill_after x N is due. (outcomes, the kill's time from the start, the release watch, retries)."""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    sessions = [aiohttp.ClientSession(base_url=u, timeout=timeout, connector=aiohttp.TCPConnector(limit=256)) for u in urls]
    balancer = Balancer(len(urls))
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    at = [(r.arrival_s - ordered[0].arrival_s) / args.speedup for r in ordered]  # due, from the start
    split = int(len(ordered) * args.kill_after)
    # half-way from the last earlier arrival: requests sent in the same instant as the kill met
    # pooled connections the dying process had not closed yet (resets no schedule would line up)
    kill_s = (max((a for a in at if a < at[split]), default=0.0) + at[split]) / 2
    start = loop.time()
    survivors = [u for r, u in enumerate(urls) if r != VICTIM]
    watching: asyncio.Task[Release] | None = None

    async def one(i: int, item: SynthRequest, due: float) -> Served:
        body = completion_body(item)
        tried: set[int] = set()
        while True:
            r = balancer.pick(i, tried)
            assert r is not None, "every replica refused"
            http = await stream_completion(sessions[r], body)
            if not refused(http):
                return Served(i, r, due - start, http)
            balancer.down.add(r)
            balancer.retries += 1
            tried.add(r)

    try:
        tasks = []
        for i, item in enumerate(ordered):
            if victim is not None and watching is None and at[i] >= kill_s:
                await asyncio.sleep(max(0.0, start + kill_s - loop.time()))
                os.kill(victim[0].proc.pid, signal.SIGKILL)
                watching = asyncio.create_task(watch_release(args.redis_url, victim[1], survivors))
            await asyncio.sleep(max(0.0, start + at[i] - loop.time()))
            tasks.append(asyncio.create_task(one(i, item, start + at[i])))
        served = list(await asyncio.gather(*tasks))
        release = await watching if watching is not None else None
    finally:
        for s in sessions:
            await s.close()
    return served, kill_s, release, balancer.retries


def attainment(rows: Sequence[Served], args: argparse.Namespace) -> dict[str, Any]:
    """Met / sent by the TTFT SLO, the TBT SLO and both; errors among them."""
    ok = [s.http for s in rows if s.http.status == "ok"]
    ttft = [h for h in ok if h.ttft_s is not None and h.ttft_s <= args.slo_ttft]
    tbt = [h for h in ok if h.tbt_s is None or h.tbt_s <= args.slo_tbt]
    both = [h for h in ttft if h.tbt_s is None or h.tbt_s <= args.slo_tbt]
    n = max(1, len(rows))
    errors = sum(1 for s in rows if s.http.status == "error")
    return {"n": len(rows), "ttft": len(ttft) / n, "tbt": len(tbt) / n, "both": len(both) / n, "errors": errors}


def figures(served: Sequence[Served], split_s: float, args: argparse.Namespace) -> dict[str, Any]:
    before = [s for s in served if s.due_s < split_s]
    after = [s for s in served if s.due_s >= split_s]
    return {
        "before_all": attainment(before, args),
        "before_survivors": attainment([s for s in before if s.replica != VICTIM], args),
        "after": attainment(after, args),
        "after_first_2s": attainment([s for s in after if s.due_s < split_s + EARLY_S], args),
        "after_rest": attainment([s for s in after if s.due_s >= split_s + EARLY_S], args),
        "lost_on_victim": sum(1 for s in served if s.http.status == "error" and s.replica == VICTIM),
        # no byte of a response: a balancer that retries resets before the response would have
        "reset_before_response": sum(
            1 for s in served if s.http.status == "error" and s.http.chunks == 0 and s.http.ttft_s is None
        ),
        "errors": sum(1 for s in served if s.http.status == "error"),
        # each loss: when it was due against the kill, on which replica, after how many chunks, why
        "error_list": [
            f"#{s.index} due {s.due_s - split_s:+.3f}s on {s.replica}, {s.http.chunks} chunks: {(s.http.message or '?')[:50]}"
            for s in served
            if s.http.status == "error"
        ],
    }


# bench_replicas.start_mode: (replicas, args, group, Redis URL) -> (client URLs, prefill URLs, metrics URLs)
StartMode = Callable[[int, argparse.Namespace, ChildGroup, str], tuple[list[str], list[str], list[str]]]


def run_one(
    kill: bool, args: argparse.Namespace, requests: Sequence[SynthRequest], redis_url: str, start_mode: StartMode
) -> dict[str, Any]:
    log_dir = Path(args.log_root) / ("kill" if kill else "no-kill")
    log_dir.mkdir(parents=True, exist_ok=True)
    group = ChildGroup(log_dir)
    try:
        urls, _, _ = start_mode(3, args, group, redis_url)
        child = next(c for c in group.children if c.name == f"gateway-{VICTIM}")
        victim = (child, replica_id(child)) if kill else None
        print(f"three replicas ready{' (one to be killed)' if kill else ''}; replaying {len(requests)} requests", file=sys.stderr)
        run_args = argparse.Namespace(**{**vars(args), "redis_url": redis_url})
        served, split_s, release, retries = asyncio.run(replay_with_kill(urls, requests, run_args, victim))
        dead = [c for c in group.dead() if c is not child or not kill]
        if dead:
            raise RuntimeError(f"{dead[0].name} died:\n{dead[0].log_tail()}")
    finally:
        group.stop()
    out = {"kill": kill, "split_s": split_s, "retries": retries, **figures(served, split_s, args)}
    # per request, for --json: [index, replica, due from the kill, status, 429 reason or error kind, TTFT, TBT]
    out["requests"] = [
        [s.index, s.replica, s.due_s - split_s, s.http.status, s.http.reason, s.http.ttft_s, s.http.tbt_s] for s in served
    ]
    if release is not None:
        out["release"] = vars(release)
    return out


def run_kill(
    args: argparse.Namespace, requests: Sequence[SynthRequest], redis_url: str, log_root: Path, start_mode: StartMode
) -> None:
    """The two runs, printed (and written to --json)."""
    started = time.monotonic()
    args = argparse.Namespace(**{**vars(args), "log_root": str(log_root)})
    rows = [run_one(kill, args, requests, redis_url, start_mode) for kill in (False, True)]
    print_kill(rows, args)
    print(f"(both runs in {time.monotonic() - started:.0f}s)", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"settings": vars(args), "runs": rows}, indent=2) + "\n", encoding="utf-8")


def _cell(a: dict[str, Any]) -> str:
    return f"{a['both']:6.1%} {a['ttft']:6.1%} {a['tbt']:6.1%} {a['errors']:3d} (n={a['n']})"


def print_kill(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nkill at request {int(args.kill_after * args.requests)} of {args.requests}, speed-up {args.speedup}x")
    print(f"{'slice':<28}{'run':<9} {'both':>6} {'TTFT':>6} {'TBT':>6} err")
    for key in ("before_all", "before_survivors", "after", "after_first_2s", "after_rest"):
        for row in rows:
            print(f"{key:<28}{'kill' if row['kill'] else 'no kill':<9} {_cell(row[key])}")
    for row in rows:
        name = "kill" if row["kill"] else "no kill"
        print(
            f"{name}: errors {row['errors']} (on the killed replica {row['lost_on_victim']}, before any response "
            f"{row['reset_before_response']}), retries after a refused connection {row['retries']}"
        )
        for line in row["error_list"]:
            print(f"  error: {line}")
    release = rows[-1].get("release")
    if release:
        seen = [f"{s:.3f}" if s is not None else "never" for s in release["survivors_s"]]
        print(
            f"dead replica's table (s after the kill): key TTL left at kill {release['key_pttl_at_kill_s']}, "
            f"key gone {release['key_gone_s']}, member gone {release['member_gone_s']}, survivors' view {seen}; "
            f"held the turn at kill: {release['turn_held_at_kill']}"
        )
        known = [s for s in release["survivors_s"] if s is not None]
        if known:
            print(f"release in the survivors' view: median {statistics.median(known):.3f} s, max {max(known):.3f} s")
