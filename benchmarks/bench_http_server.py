"""CPU per request of the server layer alone, side by side: the gateway's own connection protocol
(adapters/http1_server.py) against uvicorn's httptools and h11 protocols, each running the same
small ASGI app under the same uvicorn Server, with wrk as the load.

    python benchmarks/bench_http_server.py [--seconds 3] [--rounds 5] [--concurrency 1,64]

The app does what the gateway's hot path does with a request: reads the whole body, watches for the
client leaving (the `conductor.on_disconnect` extension where the server offers it, else a task
waiting in receive(), as conductor/server/endpoint.py does), then answers either one JSON body or a 32-event
SSE stream. What differs between the rows is the server protocol only. Servers take turns for
`--rounds` rounds in alternating order; each one's median round is printed with the ratio to
uvicorn's httptools protocol (this machine is shared and noisy: read the ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_gateway import scripts, wrk
from common import Processes, free_port, wait_http

from tests.support.asgi import lifespan, whole_body

PROTOCOLS = {"conductor": "adapters.http1_server:HttpServerConnection", "httptools": "httptools", "h11": "h11"}
ANSWER = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"abcdefgh"}]}'
EVENT = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"a"}]}\n\n'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The benchmark's application (served by `--serve`)."""
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        return
    body = await whole_body(receive)
    task = asyncio.current_task()
    assert task is not None
    hook = (scope.get("extensions") or {}).get("conductor.on_disconnect")
    watcher = None
    if hook is not None:
        hook(task.cancel)
    else:

        async def watch() -> None:
            if (await receive())["type"] == "http.disconnect":
                task.cancel()

        watcher = asyncio.create_task(watch())
    try:
        if b'"stream":true' in body:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")],
                }
            )
            for _ in range(32):
                await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"abc")],
                }
            )
            await send({"type": "http.response.body", "body": ANSWER})
    finally:
        if watcher is not None:
            watcher.cancel()


def serve(protocol: str, port: int) -> None:
    import uvicorn

    uvicorn.run(
        "bench_http_server:app",
        host="127.0.0.1",
        port=port,
        http=protocol,
        loop="uvloop",
        log_level="error",
        access_log=False,
        proxy_headers=False,
        app_dir=str(Path(__file__).parent),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--serve", nargs=2, metavar=("PROTOCOL", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        wrk_scripts = scripts(Path(tmp))
        servers: dict[str, tuple[str, int]] = {}
        for name, protocol in PROTOCOLS.items():
            port = free_port()
            proc = procs.start(
                [sys.executable, __file__, "--serve", protocol, str(port)],
                quiet=True,
                pythonpath=Path(__file__).resolve().parent.parent,
            )
            servers[name] = (f"http://127.0.0.1:{port}", proc.pid)
        for url, _ in servers.values():
            wait_http(url + "/")
        print(f"{'body, concurrency':<22} {'server':<10} {'req/s':>8} {'us/req':>8} {'vs httptools':>12}  rounds (us/req)")
        for mode in ("non-stream", "stream32"):
            for conc in (int(c) for c in args.concurrency.split(",")):
                cpu: dict[str, list[float]] = {name: [] for name in servers}
                rps: dict[str, list[float]] = {name: [] for name in servers}
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    for name in order:
                        url, pid = servers[name]
                        wrk(url + "/v1/completions", wrk_scripts[mode], conc, 1, [pid])  # warm-up
                        load = wrk(url + "/v1/completions", wrk_scripts[mode], conc, args.seconds, [pid])
                        assert load.errors == 0, f"{name}: {load.errors} errors"
                        assert load.cpu_us_per_request is not None
                        cpu[name].append(load.cpu_us_per_request)
                        rps[name].append(load.rps)
                base = statistics.median(cpu["httptools"])
                for name in servers:
                    med = statistics.median(cpu[name])
                    rounds = " ".join(f"{x:.0f}" for x in cpu[name])
                    print(
                        f"{mode + ' c' + str(conc):<22} {name:<10} {statistics.median(rps[name]):>8.0f} "
                        f"{med:>8.1f} {med / base:>11.2f}x  {rounds}"
                    )


if __name__ == "__main__":
    main()
