"""One gateway vs three replicas in front of the same emulated cluster: `python benchmarks/bench_replicas.py`;
one gateway process vs `--workers 2` on one port: `python benchmarks/bench_replicas.py --compare workers`.

Each mode gets a fresh cluster (emulated 2 prefill + 2 decode workers, vLLM KV events on, the
bundled Qwen3-8B/H800 timing, as `conductor demo` starts them) and replays the same slice of
Mooncake's conversation trace (the same synthesized prompts, token for token):
- one: a single gateway;
- three: three gateway processes from the same settings with distinct replica ids, sharing
  in-flight load (`load_share: redis`) and the KV index (`kv.index: redis`) through a Redis of the
  benchmark's own, the client sending request i to replica i mod 3.
Both modes run with the same settings (Redis load share and index), so the only difference is the
replica count. Every run uses a fresh key prefix and fresh replica ids. With `--compare workers`
the two modes are one gateway process and one gateway of two worker processes on one port
(SO_REUSEPORT: the kernel spreads the client's connections), sharing in-flight load through shared
memory, each with its own in-memory KV index fed by every worker's events; no Redis.

Printed: goodput (requests meeting both SLOs per second) of each mode and their ratio (goal: three
within 5% of one), and queue imbalance measured at the prefill workers (their
vllm:num_requests_waiting gauge, polled every 50 ms): per instance the peak of prefills waiting;
the mean over samples of the spread between the most and least loaded instance; the share of
samples in which one instance had 2+ prefills waiting while another had none (an over-commit);
and the spread of prompt tokens each prefill instance computed (vllm:prompt_tokens). Per gateway
(replica or worker process), from its /metrics: the MAPE of its TTFT and prefill-leg predictions
over its recent window, and the predictor lessons it learned from the others.

Replicas and worker processes decide in turn (`load_share.turns`, adapters/decision_turn.py) unless
`--turns off`; `--compare both` runs the two pairs in one invocation; `--logs DIR` keeps every
process's log (with `--gateway-log-level info`, the decisions); `--compare kill`: benchmarks/replica_kill.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PrivateRedis, free_port, wait_http
from replica_kill import completion_body, run_kill

from conductor.demo.cluster import ChildGroup, ClusterSpec, start_cluster, wait_ready
from conductor.demo.run import DEFAULT_MODEL
from tests.support.servers import free_port_run
from traces.formats import load_trace, resolve_trace
from traces.live_client import prediction_errors, stream_completion
from traces.live_results import LiveOutcome, LiveResult, summarize
from traces.synth import PromptSynthesizer, SynthRequest

_WAITING = re.compile(rb"^vllm:num_requests_waiting(?:\{[^}]*\})? ([0-9.eE+-]+)", re.M)
_PROMPT_TOKENS = re.compile(rb"^vllm:prompt_tokens_total(?:\{[^}]*\})? ([0-9.eE+-]+)", re.M)
_LESSONS_IN = re.compile(rb'^conductor_worker_lessons_total\{event="received"\} ([0-9.eE+-]+)', re.M)
_REJECTIONS = re.compile(rb'^conductor_rejections_total\{reason="([^"]+)"\} ([0-9.eE+-]+)', re.M)


def start_mode(
    replicas: int, args: argparse.Namespace, group: ChildGroup, redis_url: str
) -> tuple[list[str], list[str], list[str]]:
    """Emulators and `replicas` gateways (or, comparing workers, one gateway of `replicas` worker
    processes); (client URLs, prefill URLs, metrics URLs), all ready."""
    run = uuid.uuid4().hex[:8]
    if args.compare == "workers":
        admin = free_port_run(replicas)  # worker i serves its /metrics on admin + i
        shared: dict[str, Any] = {"workers": replicas, "admin_port": admin} if replicas > 1 else {}
        shared["load_share"] = {"turns": args.turns == "on"}  # the workers' flock (one process: nothing to share)
    else:
        shared = {
            "load_share": {
                "mode": "redis",
                "redis_url": redis_url,
                "replica_id": f"bench-{run}-0",
                "sync_interval_s": args.sync_interval,
                "turns": args.turns == "on",
            },
            "kv": {"index": "redis", "redis_url": redis_url, "redis_prefix": f"bench:replicas:{run}:kv:"},
        }
    shared["share_lessons"] = args.share_lessons == "on"
    if args.gateway_log_level != "warning":  # info: every decision and outcome logged (costs CPU)
        shared["logs"] = {"level": args.gateway_log_level}
    spec = ClusterSpec(
        n_prefill=args.prefill,
        n_decode=args.decode,
        pd_protocol="nixl",
        policy=args.policy,
        model=DEFAULT_MODEL,
        time_scale=1.0,
        noise=0.05,
        slo_ttft_s=args.slo_ttft,
        slo_tbt_s=args.slo_tbt,
        gateway_extra=shared,
        policy_options=json.loads(args.policy_options),
    )
    cluster = start_cluster(spec, group)
    urls = [cluster.gateway_url]
    if args.compare == "workers":
        wait_ready(cluster, group)
        if replicas == 1:
            return urls, list(cluster.prefill_urls), urls
        # the client opens several connections to the one port; the kernel spreads them
        return urls * replicas, list(cluster.prefill_urls), [f"http://127.0.0.1:{admin + i}" for i in range(replicas)]
    base = yaml.safe_load(cluster.config_path.read_text(encoding="utf-8"))
    for r in range(1, replicas):
        port = free_port()
        config = {**base, "port": port, "load_share": {**base["load_share"], "replica_id": f"bench-{run}-{r}"}}
        path = cluster.config_path.with_name(f"gateway-{r}.yaml")
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        url = f"http://127.0.0.1:{port}"
        group.start(f"gateway-{r}", [sys.executable, "-m", "conductor", "serve", "--config", str(path)], None)
        urls.append(url)
    wait_ready(cluster, group)
    for url in urls[1:]:
        wait_http(url + "/ready", timeout=90)
    return urls, list(cluster.prefill_urls), urls


class QueueSampler:
    """Polls every prefill worker's waiting gauge; the samples say how evenly prefills were spread."""

    def __init__(self, prefill_urls: Sequence[str], interval_s: float = 0.05) -> None:
        self.urls = list(prefill_urls)
        self.interval_s = interval_s
        self.samples: list[list[float]] = []

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            row = []
            for url in self.urls:
                try:
                    async with session.get(url + "/metrics") as resp:
                        found = _WAITING.search(await resp.read())
                    row.append(float(found.group(1)) if found else 0.0)
                except (aiohttp.ClientError, TimeoutError):
                    row.append(0.0)
            self.samples.append(row)
            await asyncio.sleep(self.interval_s)

    def figures(self) -> dict[str, Any]:
        busy = [s for s in self.samples if any(s)]  # idle moments say nothing about balance
        spreads = [max(s) - min(s) for s in busy]
        over = sum(1 for s in busy if max(s) >= 2 and min(s) == 0)
        return {
            "peak_waiting": [max((s[i] for s in self.samples), default=0.0) for i in range(len(self.urls))],
            "mean_spread": sum(spreads) / len(spreads) if spreads else 0.0,
            "overcommit_share": over / len(busy) if busy else 0.0,
            "busy_samples": len(busy),
            "samples": len(self.samples),
        }


async def prompt_tokens(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[float]:
    out = []
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            found = _PROMPT_TOKENS.search(await resp.read())
        out.append(float(found.group(1)) if found else 0.0)
    return out


async def rejection_reasons(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, int]:
    """The gateways' SLO rejections by reason, summed over replicas."""
    out: dict[str, int] = {}
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            for reason, n in _REJECTIONS.findall(await resp.read()):
                out[reason.decode()] = out.get(reason.decode(), 0) + int(float(n))
    return out


async def prediction_mapes(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, tuple[float, float]]]:
    """Per gateway (replica or worker process), per predicted component ("ttft", the prefill leg
    "queue_and_prefill", ...): (samples, MAPE) over its recent error window, from its /metrics."""
    out = []
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            out.append(prediction_errors((await resp.read()).decode()))
    return out


async def lessons_received(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[int]:
    """Per gateway: the other processes' or replicas' predictor lessons it learned."""
    out = []
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            found = _LESSONS_IN.search(await resp.read())
        out.append(int(float(found.group(1))) if found else 0)
    return out


async def replay_spread(
    urls: Sequence[str],
    prefill_urls: Sequence[str],
    requests: Sequence[SynthRequest],
    args: argparse.Namespace,
    label: str,
    metrics_urls: Sequence[str],
) -> tuple[LiveResult, dict[str, Any]]:
    """Send request i to urls[i % len(urls)] at its (sped-up) arrival; the outcomes and the queue figures."""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    sessions = [aiohttp.ClientSession(base_url=u, timeout=timeout, connector=aiohttp.TCPConnector(limit=256)) for u in urls]
    probe = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
    sampler = QueueSampler(prefill_urls)
    try:
        tokens_before = await prompt_tokens(probe, prefill_urls)
        sampling = asyncio.create_task(sampler.run(probe))
        start = loop.time()
        first = min(r.arrival_s for r in requests)

        async def one(i: int, item: SynthRequest, due: float) -> LiveOutcome:
            sent = loop.time()
            body = completion_body(item)
            http = await stream_completion(sessions[i % len(sessions)], body)
            return LiveOutcome(item.line, due - start, sent - due, len(item.prompt), item.max_tokens, http)

        tasks = []
        for i, item in enumerate(sorted(requests, key=lambda r: r.arrival_s)):
            due = start + (item.arrival_s - first) / args.speedup
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            tasks.append(asyncio.create_task(one(i, item, due)))
        outcomes = list(await asyncio.gather(*tasks))
        sampling.cancel()
        tokens_after = await prompt_tokens(probe, prefill_urls)
        reasons = await rejection_reasons(probe, metrics_urls)
        mapes = await prediction_mapes(probe, metrics_urls)
        learned = await lessons_received(probe, metrics_urls)
    finally:
        for s in sessions:
            await s.close()
        await probe.close()
    wall = max(o.scheduled_s + o.lag_s + o.http.elapsed_s for o in outcomes)
    result = summarize(
        outcomes,
        label=label,
        n_prefill=args.prefill,
        n_decode=args.decode,
        slo_ttft_s=args.slo_ttft,
        slo_tbt_s=args.slo_tbt,
        wall_s=wall,
    )
    queues = sampler.figures()
    computed = [a - b for a, b in zip(tokens_after, tokens_before, strict=True)]
    mean = sum(computed) / len(computed) if computed else 0.0
    queues["prompt_tokens_per_instance"] = computed
    queues["prompt_tokens_max_over_mean"] = max(computed) / mean if mean else 0.0
    queues["rejections_by_reason"] = reasons
    queues["ttft_mape"] = [m.get("ttft", (0, 0.0))[1] for m in mapes]
    queues["ttft_mape_samples"] = [int(m.get("ttft", (0, 0.0))[0]) for m in mapes]
    queues["lessons_received"] = learned
    queues["leg_mape"] = [m.get("queue_and_prefill", (0, 0.0))[1] for m in mapes]  # where the TTFT error comes from
    return result, queues


def run_mode(
    replicas: int, args: argparse.Namespace, requests: Sequence[SynthRequest], redis_url: str, log_root: Path
) -> dict[str, Any]:
    log_dir = log_root / f"{replicas}-{args.compare}"
    log_dir.mkdir(parents=True, exist_ok=True)
    group = ChildGroup(log_dir)
    try:
        urls, prefill_urls, metrics_urls = start_mode(replicas, args, group, redis_url)
        label = f"{replicas} {'worker process' if args.compare == 'workers' else 'replica'}(s)"
        print(f"{label} ready at {', '.join(sorted(set(urls)))}; replaying {len(requests)} requests", file=sys.stderr)
        result, queues = asyncio.run(replay_spread(urls, prefill_urls, requests, args, label, metrics_urls))
        dead = group.dead()
        if dead:
            raise RuntimeError(f"{dead[0].name} died:\n{dead[0].log_tail()}")
    finally:
        group.stop()
    run = result.run
    return {
        "replicas": replicas,
        "requests": run.requests,
        "completed": run.completed,
        "rejected": run.rejected,
        "errors": sum(result.errors.values()),
        "slo_met": run.slo_met,
        "goodput_rps": run.goodput_rps,
        "ttft_p50_s": run.ttft.p50,
        "ttft_p99_s": run.ttft.p99,
        "tbt_p99_s": run.tbt.p99,
        **queues,
    }


def print_table(rows: list[dict[str, Any]], compare: str) -> None:
    one, three = rows
    names = ("one process", "--workers 2") if compare == "workers" else ("one gateway", "three replicas")
    fields = [
        ("requests", "{:d}"),
        ("completed", "{:d}"),
        ("rejected", "{:d}"),
        ("errors", "{:d}"),
        ("slo_met", "{:d}"),
        ("goodput_rps", "{:.3f}"),
        ("ttft_p50_s", "{:.3f}"),
        ("ttft_p99_s", "{:.3f}"),
        ("tbt_p99_s", "{:.4f}"),
        ("mean_spread", "{:.2f}"),
        ("overcommit_share", "{:.1%}"),
        ("prompt_tokens_max_over_mean", "{:.2f}"),
    ]
    print(f"\n{'figure':<30}{names[0]:>16}{names[1]:>16}")
    for name, fmt in fields:
        print(f"{name:<30}{fmt.format(one[name]):>16}{fmt.format(three[name]):>16}")
    print(
        f"{'peak waiting per prefill':<30}{[int(x) for x in one['peak_waiting']]!s:>16}"
        f"{[int(x) for x in three['peak_waiting']]!s:>16}"
    )
    print(f"{'rejections by reason':<30}{one['rejections_by_reason']!s:>16}{three['rejections_by_reason']!s:>16}")
    for row, name in ((one, names[0]), (three, names[1])):
        each = ", ".join(f"{m:.1%} (n={n})" for m, n in zip(row["ttft_mape"], row["ttft_mape_samples"], strict=True))
        legs = ", ".join(f"{m:.1%}" for m in row["leg_mape"])
        learned = row["lessons_received"]
        print(f"TTFT MAPE per gateway, {name}: {each}; prefill leg: {legs}; lessons learned from the others: {learned}")
    ratio = three["goodput_rps"] / one["goodput_rps"] if one["goodput_rps"] else 0.0
    verdict = "PASS" if ratio >= 0.95 else "MISS"
    print(f"\ngoodput {names[1]} / {names[0]}: {ratio:.3f}  {verdict} (goal: within 5% of one gateway)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=150, help="first N requests of the trace")
    ap.add_argument("--trace", default="conversation-head400")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--policy", default="kvcache_aware")
    ap.add_argument("--speedup", type=float, default=1.5, help="replay arrivals this many times faster")
    ap.add_argument("--length-scale", type=float, default=0.125)
    ap.add_argument("--slo-ttft", type=float, default=0.5)
    ap.add_argument("--slo-tbt", type=float, default=0.04)
    ap.add_argument("--sync-interval", type=float, default=0.1, help="load_sync_interval_s of every replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy-options", default="{}", help="JSON, e.g. '{\"ttft_bound_shift_s\": 0.2}'")
    ap.add_argument("--json", dest="json_out", default=None, metavar="FILE")
    ap.add_argument("--gateway-log-level", default="warning", choices=("debug", "info", "warning"))
    ap.add_argument("--logs", default=None, metavar="DIR", help="keep every process's log here (default: a temporary directory)")
    ap.add_argument(
        "--turns",
        choices=("on", "off"),
        default="on",
        help="whether replicas or worker processes decide in turn (load_share.turns, adapters/decision_turn.py)",
    )
    ap.add_argument(
        "--share-lessons",
        choices=("on", "off"),
        default="on",
        help="whether the worker processes or replicas learn from each other's outcomes (share_lessons)",
    )
    ap.add_argument(
        "--compare",
        choices=("replicas", "workers", "both", "kill"),
        default="replicas",
        help="three Redis-sharing replicas, or one gateway of two worker processes, against one; both: the two pairs in one run",
    )
    ap.add_argument("--kill-after", type=float, default=1 / 3, help="--compare kill: the share of requests sent before the kill")
    args = ap.parse_args()
    synth = PromptSynthesizer(args.length_scale, seed=args.seed)
    trace = load_trace(resolve_trace(args.trace), limit=args.requests).requests
    requests = synth.synthesize_all(trace)
    started = time.monotonic()
    compares = ("replicas", "workers") if args.compare == "both" else (args.compare,)
    tables: dict[str, list[dict[str, Any]]] = {}
    with PrivateRedis() as server, tempfile.TemporaryDirectory(prefix="bench-replicas-") as logs:
        log_root = Path(args.logs or logs)  # --logs: the gateways' decision logs kept for reading after
        if args.compare == "kill":
            return run_kill(args, requests, server.url, log_root, start_mode)
        for compare in compares:
            mode = argparse.Namespace(**{**vars(args), "compare": compare})
            tables[compare] = [run_mode(n, mode, requests, server.url, log_root) for n in (1, 2 if compare == "workers" else 3)]
    for compare, rows in tables.items():
        print_table(rows, compare)
    print(f"(all runs in {time.monotonic() - started:.0f}s)", file=sys.stderr)
    if args.json_out:
        runs = tables[args.compare] if args.compare != "both" else tables
        Path(args.json_out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
