"""CPU per upstream POST, side by side: httpx, aiohttp and the gateway's own adapters/http1.py,
against one local uvicorn server, in one run.

    python benchmarks/bench_http_client.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

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


async def main(n: int, port: int) -> None:
    url = f"http://127.0.0.1:{port}/"
    results: dict[str, float] = {}
    async with httpx.AsyncClient() as c:
        for _ in range(100):
            await c.post(url, content=b"{}")
        t0 = time.process_time()
        for _ in range(n):
            _ = (await c.post(url, content=b"{}")).content
        results["httpx"] = (time.process_time() - t0) / n * 1e6
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            async with s.post(url, data=b"{}") as r:
                await r.read()
        t0 = time.process_time()
        for _ in range(n):
            async with s.post(url, data=b"{}") as r:
                await r.read()
        results["aiohttp"] = (time.process_time() - t0) / n * 1e6
    pool = Pool("127.0.0.1", port)
    headers = {"Content-Type": "application/json"}
    for _ in range(100):
        await (await pool.request("POST", "/", headers, b"{}")).read()
    t0 = time.process_time()
    for _ in range(n):
        await (await pool.request("POST", "/", headers, b"{}")).read()
    results["http1 (conductor)"] = (time.process_time() - t0) / n * 1e6
    await pool.close()
    base = results["http1 (conductor)"]
    print(f"{'client':<20} {'cpu us/POST':>12} {'vs http1':>9}")
    for name, us in results.items():
        print(f"{name:<20} {us:>12.0f} {us / base:>8.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--port", type=int, default=18997)
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER.replace("PORT", str(args.port))])
    try:
        time.sleep(1.5)
        asyncio.run(main(args.requests, args.port))
    finally:
        server.terminate()
