"""The clusters of the live benches (benchmarks/bench_live_vs_peers.py, benchmarks/bench_tenants.py):
starting the workers and the routers, and reading them.

The routers a run can put in front of the workers (`RouterSpec`, `ROUTERS`: Conductor's columns,
vllm-router's, sglang-router's); the emulated vLLM workers (`start_workers`: all mixed, or prefill and
decode over NIXL; KV events on); each router's start-up with its configuration (`start_router`:
Conductor's gateway YAML, kvcache_aware's predictor params scaled like the workers by `scaled_params`;
vllm-router's and sglang-router's command lines); `wait_up` until all answer, `start_cluster` for all
three. Which peers this box can run (`find_peers`), at which versions (`versions`), which timing the
workers and Conductor's predictors start from (`profiles`, `idle_ceiling`). What a run reads off them:
the workers' prefix-cache counters (`worker_prefix_counters`), Conductor's KV figures
(`gateway_kv_figures`), vllm-router kv_aware's (`vllm_kv_figures`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conductor.demo.cluster import ChildGroup, free_ports
from traces.formats import TraceRequest
from traces.synth import PromptSynthesizer

MODEL = "Qwen/Qwen3-8B"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One column: which router, which policy."""

    name: str
    kind: str  # conductor | vllm | sglang
    policy: str
    admission: str = "predicted"  # Conductor kvcache_aware and judged (its judge's) only
    options: tuple[tuple[str, Any], ...] = ()  # further policy options (Conductor)


ALGORITHM1 = (("ttft_slack", None), ("inflight_prefixes", False))  # the lowest TTFT, blind to prefixes in flight

ROUTERS = (
    RouterSpec("conductor kv+adm", "conductor", "kvcache_aware", "predicted"),
    RouterSpec("conductor alg1+adm", "conductor", "kvcache_aware", "predicted", ALGORITHM1),
    RouterSpec("conductor kv", "conductor", "kvcache_aware", "none"),
    RouterSpec("conductor rr", "conductor", "round_robin"),
    # round robin places, kvcache_aware's judge admits: its predictors, bounds and admission (policies/judged.py)
    RouterSpec("conductor rr+adm", "conductor", "judged", "predicted", (("place", "round_robin"),)),
    RouterSpec("vllm-router rr", "vllm", "round_robin"),
    RouterSpec("vllm-router cache", "vllm", "cache_aware"),
    RouterSpec("vllm-router p2", "vllm", "power_of_two"),
    RouterSpec("vllm-router kv", "vllm", "kv_aware"),
    RouterSpec("sglang-router cache", "sglang", "cache_aware"),
)


def scaled_params(time_scale: float, log_dir: Path) -> str:
    """kvcache_aware's predictor params, fitted from the bundled profile and scaled like the workers."""
    from predictors.profile import bundled_profile, fit_profiles

    path = log_dir / "predictor-params.json"
    fit_profiles([bundled_profile()]).scaled(time_scale, time_scale, time_scale).save(path)
    return str(path)


def start_workers(group: ChildGroup, n: int, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """`n` emulators with KV events on, by role: all mixed, or (`--shape pd`) half prefill, half
    decode speaking NIXL; the same seeds on every cluster."""
    roles = ["mixed"] * n if args.shape == "mixed" else ["prefill"] * (n // 2) + ["decode"] * (n - n // 2)
    ports = iter(free_ports(3 * n))
    workers: dict[str, list[dict[str, Any]]] = {}
    for i, role in enumerate(roles):
        port, events, side = next(ports), next(ports), next(ports)
        url = f"http://127.0.0.1:{port}"
        group.start(
            f"{role}-{i}",
            [
                sys.executable,
                "-m",
                "adapters.emulator",
                "--role",
                role,
                "--pd-protocol",
                "nixl",
                "--port",
                str(port),
                "--model",
                MODEL,
                "--time-scale",
                repr(args.time_scale),
                "--noise",
                repr(args.noise),
                "--seed",
                str(i),
                "--engine-id",
                f"bench-{role}-{i}",
                "--side-channel-port",
                str(side),
                "--log-level",
                "warning",
                "--kv-events-endpoint",
                f"tcp://*:{events}",
                *(["--profile", profile] if (profile := getattr(args, "worker_profile", None)) else []),
            ],
            url,
        )
        workers.setdefault(role, []).append({"url": url, "name": f"{role}-{i}", "kv_events_endpoint": f"tcp://*:{events}"})
    return workers


def role_urls(workers: dict[str, list[dict[str, Any]]], role: str) -> list[str]:
    """The URLs of the workers of one role (mixed, prefill or decode); none if the cluster has no such role."""
    return [w["url"] for w in workers.get(role, [])]


def _kv_sources(workers: dict[str, list[dict[str, Any]]]) -> list[str]:
    """vllm-router kv_aware's static KV event sources: where the mixed (or, P/D, the prefill)
    workers publish, as URL=ENDPOINT (it discovers nothing from the emulators: no /server_info)."""
    if role_urls(workers, "mixed"):
        flag, role, extra = "--kv-event-source", "mixed", ["--kv-event-model", MODEL, "--kv-event-block-size", "16"]
    else:
        flag, role, extra = "--pd-kv-events", "prefill", []
    sources = [x for w in workers[role] for x in (flag, f"{w['url']}={w['kv_events_endpoint'].replace('*', '127.0.0.1')}")]
    return [*sources, *extra]


def vllm_router_argv(
    spec: RouterSpec, workers: dict[str, list[dict[str, Any]]], args: argparse.Namespace, port: int, prom: int
) -> list[str]:
    # vllm-router's P/D mode drives NIXL as vLLM's toy proxy does: prefill with
    # kv_transfer_params {do_remote_decode}, then decode with what the prefill returned
    urls = role_urls(workers, "mixed")
    where = (
        ["--worker-urls", *urls]
        if urls
        else [
            "--vllm-pd-disaggregation",
            *(x for u in role_urls(workers, "prefill") for x in ("--prefill", u)),
            *(x for u in role_urls(workers, "decode") for x in ("--decode", u)),
        ]
    )
    kv = _kv_sources(workers) if spec.policy == "kv_aware" else []
    return [
        args.vllm_router,
        "--port",
        str(port),
        "--prometheus-port",
        str(prom),
        "--policy",
        spec.policy,
        "--log-level",
        "warning",
        *where,
        *kv,
    ]


def start_router(
    group: ChildGroup, spec: RouterSpec, workers: dict[str, list[dict[str, Any]]], args: argparse.Namespace, log_dir: Path
) -> tuple[str, str]:
    """Start the router; (its base URL, the path that answers 200 once it is ready)."""
    port, prom = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    urls = role_urls(workers, "mixed")
    if spec.kind == "vllm":
        # no Hugging Face hub here: kv_aware then tokenizes text through the workers' /tokenize
        group.start("router", vllm_router_argv(spec, workers, args, port, prom), env={"HF_HUB_OFFLINE": "1"})
        return url, "/health"
    if spec.kind == "sglang":
        group.start(
            "router",
            [
                args.sglang_router,
                "-m",
                "sglang_router.launch_router",
                "--port",
                str(port),
                "--prometheus-port",
                str(prom),
                "--policy",
                spec.policy,
                "--log-level",
                "warn",
                "--worker-urls",
                *urls,
            ],
        )
        return url, "/health"
    options: dict[str, Any] = {}
    if spec.policy in ("kvcache_aware", "judged"):  # judged: kvcache_aware's judge takes these options
        options["admission"] = spec.admission
        options.update(spec.options)
        if args.time_scale != 1.0:  # the bundled fit scaled like the workers (their own timing only without --worker-profile)
            options["predictor_params"] = scaled_params(args.time_scale, log_dir)
    settings = {
        "host": "127.0.0.1",
        "port": port,
        "logs": {"level": "warning"},
        "policy": spec.policy,
        "policy_options": options,
        "models": [MODEL],
        **workers,
        "pd": {"protocol": "nixl"},
        "health": {"interval_s": 1.0},
        "block_size": 16,
        "slo": {"ttft_s": args.slo_ttft, "tbt_s": args.slo_tbt},
        "kv": {"enabled": True, "tokenizer": "builtin"},
    }
    config = log_dir / "gateway.yaml"
    config.write_text(json.dumps(settings), encoding="utf-8")  # JSON is YAML
    group.start("router", [sys.executable, "-m", "conductor", "serve", "--config", str(config)])
    return url, "/ready"


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_up(group: ChildGroup, checks: Sequence[str], timeout_s: float = 90.0) -> None:
    """Until every URL in `checks` answers 200; an error if a child exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    for check in checks:
        while not _ok(check):
            dead = group.dead()
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{check} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)


def start_cluster(
    group: ChildGroup, spec: RouterSpec, args: argparse.Namespace, log_dir: Path
) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Fresh workers (`start_workers`) and the router in front of them, all answering; (the workers by
    role, the router's base URL)."""
    workers = start_workers(group, args.workers, args)
    url, ready = start_router(group, spec, workers, args, log_dir)
    wait_up(group, [*(f"{w['url']}/health" for ws in workers.values() for w in ws), url + ready])
    if spec.kind == "conductor":  # /ready is up before KV events flow; give the subscribers a moment
        time.sleep(1.0)
    return workers, url


def find_peers(args: argparse.Namespace) -> dict[str, str]:
    """Router name -> why it cannot run here (those that can are left out)."""
    missing: dict[str, str] = {}
    if not (args.vllm_router and Path(args.vllm_router).exists()):
        missing.update({s.name: "vllm-router not installed" for s in ROUTERS if s.kind == "vllm"})
    else:
        smallest_pool = args.workers // 2 if args.shape == "pd" else args.workers  # P/D: prefill gets the smaller half
        if smallest_pool < 2:
            missing["vllm-router p2"] = "power_of_two needs two workers in each pool"
    sglang_ok = (
        Path(args.sglang_router).exists()
        and subprocess.run([args.sglang_router, "-c", "import sglang_router"], capture_output=True).returncode == 0
    )
    if not sglang_ok or args.shape == "pd":
        why = "P/D needs SGLang-protocol workers" if sglang_ok else "sglang-router not installed"
        missing.update({s.name: why for s in ROUTERS if s.kind == "sglang"})
    return missing


def versions(args: argparse.Namespace) -> str:
    """The peers as pip reports them in their virtualenvs, and this checkout's commit."""
    parts = []
    for dist, python in (("vllm-router", Path(args.vllm_router).parent / "python"), ("sglang-router", Path(args.sglang_router))):
        found = None
        if python.exists():
            shown = subprocess.run([str(python), "-m", "pip", "show", dist], capture_output=True, text=True, timeout=120)
            found = re.search(r"^Version: (\S+)", shown.stdout, re.M)
        parts.append(f"{dist} {found.group(1) if found else 'not installed'} ({python.parent.parent})")
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    return ", ".join([*parts, f"conductor {commit or '?'}{' + uncommitted changes' if dirty else ''}"])


def profiles(args: argparse.Namespace) -> str:
    """Which timing each side starts from: the workers run theirs, Conductor's predictors learn it."""
    workers = args.worker_profile or "the emulator's bundled Qwen3-8B/H800 profile"
    scaled = f", scaled x{args.time_scale:g} like the workers" if args.time_scale != 1.0 else ""
    own = "" if args.worker_profile else " (the workers' own timing)"
    return (
        f"workers: {workers} x{args.time_scale:g}; Conductor kvcache_aware's predictors (rr+adm's judge's too) start "
        f"from the bundled H800 fit{scaled}{own} and learn online; round_robin and the peers predict nothing"
    )


def idle_ceiling(requests: Sequence[TraceRequest], synth: PromptSynthesizer, args: argparse.Namespace) -> float:
    """The share of the slice an idle worker prefills within the TTFT SLO, cold (the workers' profile
    times the time scale): attainment cannot go above it but by prefix hits, at any rate."""
    from adapters.emulator.profile import load_profile

    profile = load_profile(args.worker_profile)
    fits = [profile.prefill_s(len(synth.synthesize(r).prompt)) * args.time_scale <= args.slo_ttft for r in requests]
    return sum(fits) / len(fits) if fits else 0.0


_SAMPLE = r"^{}_total\{{[^}}]*\}}\s+([0-9.eE+-]+)"


def worker_prefix_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the workers' vLLM-style /metrics."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as resp:
            text = resp.read().decode()
        for name, add in (("vllm:prefix_cache_hits", True), ("vllm:prefix_cache_queries", False)):
            value = sum(float(m) for m in re.findall(_SAMPLE.format(re.escape(name)), text, re.M))
            if add:
                hits += value
            else:
                queries += value
    return hits, queries


def gateway_kv_figures(url: str) -> str:
    """What Conductor's KV index says of itself: hash agreement, predicted vs reported cached tokens."""
    from traces.live_client import sample_value

    with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    names = (
        "conductor_kv_hash_agreement",
        "conductor_kv_predicted_cached_tokens_total",
        "conductor_kv_reported_cached_tokens_total",
    )
    return " ".join(f"{n.removeprefix('conductor_kv_')}={sample_value(text, n)}" for n in names)


def vllm_kv_figures(group: ChildGroup) -> str:
    """vllm-router kv_aware's own counts: prompts it prepared (tokenized) and KV index lookups by result."""
    argv = group.children[-1].proc.args
    assert isinstance(argv, list)
    with urllib.request.urlopen(f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    found = re.findall(r"^vllm_router_kv_(routing_inputs|placement_lookups)_total\{([^}]*)\}\s+(\S+)", text, re.M)
    return " ".join(f"{name}{{{labels}}}={value}" for name, labels, value in found) or "no kv_aware counters"
