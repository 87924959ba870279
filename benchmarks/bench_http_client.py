"""CPU per upstream POST, side by side: httpx, aiohttp and the gateway's own adapters/http1.py,
against one local uvicorn server, in one run.

    python benchmarks/bench_http_client.py [--requests 3000] [--rounds 3]

Each client sends the headers a gateway leg carries (Content-Type, X-Request-ID, Authorization).
The clients take turns for `--rounds` rounds and each one's best round is printed: on a shared
machine the best of a few is the figure least disturbed by other work.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx

from adapters.http1 import Pool

SERVER = """
import uvicorn
async def app(scope, receive, send):
    if scope['type'] != 'http':
        return
    await send({'type': 'http.response.start', 'status': 200, 'headers': [(b'content-type', b'application/json')]})
    await send({'type': 'http.response.body', 'body': b'{"ok": 1}'})
uvicorn.run(app, host='127.0.0.1', port=PORT, log_level='error', access_log=False)
"""

HEADERS = {"Content-Type": "application/json", "X-Request-ID": "cmpl-0123456789abcdef", "Authorization": "Bearer sk-x"}


async def cpu_per_call(call: Callable[[], Awaitable[None]], n: int) -> float:
    for _ in range(100):
        await call()
    t0 = time.process_time()
    for _ in range(n):
        await call()
    return (time.process_time() - t0) / n * 1e6


async def main(n: int, port: int, rounds: int) -> None:
    url = f"http://127.0.0.1:{port}/"
    async with httpx.AsyncClient() as client, aiohttp.ClientSession() as session:
        pool = Pool("127.0.0.1", port)

        async def with_httpx() -> None:
            _ = (await client.post(url, content=b"{}", headers=HEADERS)).content

        async def with_aiohttp() -> None:
            async with session.post(url, data=b"{}", headers=HEADERS) as r:
                await r.read()

        async def with_http1() -> None:
            await (await pool.request("POST", "/", HEADERS, b"{}")).read()

        clients = {"httpx": with_httpx, "aiohttp": with_aiohttp, "http1 (conductor)": with_http1}
        results: dict[str, float] = {}
        for _ in range(rounds):
            for name, call in clients.items():
                us = await cpu_per_call(call, n)
                results[name] = min(us, results.get(name, us))
        await pool.close()
    base = results["http1 (conductor)"]
    print(f"{'client':<20} {'cpu us/POST':>12} {'vs http1':>9}")
    for name, us in results.items():
        print(f"{name:<20} {us:>12.0f} {us / base:>8.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=18997)
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER.replace("PORT", str(args.port))])
    try:
        time.sleep(1.5)
        asyncio.run(main(args.requests, args.port, args.rounds))
    finally:
        server.terminate()
