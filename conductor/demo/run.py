"""`conductor demo`: an emulated P/D cluster behind the gateway, and a slice of a real trace through it.

    conductor demo                          # 2 prefill + 2 decode emulators, kvcache_aware, about a minute
    conductor demo --requests 100 --pd-protocol mooncake --policy round_robin --json out.json
    conductor demo --compare round_robin    # the same slice through kvcache_aware, then round_robin
    conductor demo --base-port 9000         # the gateway on 9000, the workers on 9001, 9002, ...

On loopback it starts the emulated vLLM workers (`python -m adapters.emulator`, the bundled
Qwen3-8B/H800 profile, 5% timing noise, vLLM KV events on) and the gateway (`python -m conductor
serve` with a generated config: the chosen policy, the SLOs, and KV-cache awareness -- prompts keyed
into 16-token blocks, an in-memory index fed by the gateway's dispatches and the workers' KV events,
unless `--no-kv-index`), waits for /ready, replays the first N requests of Mooncake's conversation
trace (bundled `conversation-head400`) through the gateway as streamed completions with synthesized
token-id prompts (traces.synth), and prints the replay's summary table. Children run in their own
process groups and are stopped on exit, on error, on Ctrl-C and on SIGTERM.

Scaling, so a 2-core laptop can run it (see traces.synth):
* `--length-scale` (default 1/8; 1/4 for a `--compare`, of 60 requests) shrinks prompts and
  outputs, and the 512-token trace block with them (to 64 tokens), keeping which requests share
  which prefix; the first 200 requests then send about 350k prompt tokens and ask for about 9k
  output tokens;
* `--speedup` (default 1.5) replays arrivals that many times faster: 200 requests span 72 s of
  trace, so the replay takes about 50 s; the trace's bursts (10 to 16 requests within a second)
  queue up at the prefill instances and, with the default SLOs (TTFT 0.5 s, TBT 40 ms), a few get
  HTTP 429 from kvcache_aware's admission;
* `--time-scale` (default 1) multiplies every duration the emulators model. With a value other
  than 1 the kvcache_aware policy is given predictor params scaled by the same factor, so its
  predictions stay true to the emulators.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from conductor.core.cli_help import DefaultsHelpFormatter
from conductor.demo.cluster import ChildGroup, ClusterSpec, PortTaken, ports_from, ports_needed, start_cluster, wait_ready

if TYPE_CHECKING:
    from traces.formats import TraceRequest
    from traces.live_results import LiveResult
    from traces.sim.runner import PolicySpec

T = TypeVar("T")
DEFAULT_TRACE = "conversation-head400"
DEFAULT_MODEL = "Qwen/Qwen3-8B"


def build_parser() -> argparse.ArgumentParser:
    from traces.sim.options import LIVE_SLO_TBT_S, LIVE_SLO_TTFT_S

    p = argparse.ArgumentParser(
        prog="conductor demo", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument(
        "--requests", type=int, default=None, help="replay the first N requests of the trace (default 200; 60 with --compare)"
    )
    p.add_argument("--trace", default=DEFAULT_TRACE, help="bundled trace name or path")
    p.add_argument("--prefill", type=int, default=2, help="prefill emulators")
    p.add_argument("--decode", type=int, default=2, help="decode emulators")
    p.add_argument(
        "--policy",
        default="kvcache_aware",
        help="scheduling policy: a registered name, options after colons (kvcache_aware:ttft_slack=null:inflight_prefixes=false)",
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="POLICY[,POLICY]",
        help="then replay the same requests through these policies too, each on a fresh cluster "
        "of the same shape, and print the runs side by side",
    )
    p.add_argument("--pd-protocol", default="nixl", choices=["nixl", "mooncake", "sglang"], help="P/D handshake")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the emulators' modelled durations")
    p.add_argument("--speedup", type=float, default=1.5, help="replay trace arrivals this many times faster")
    p.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help="scale prompt/output lengths (and the 512-token block) by this factor, 0 < f <= 1 "
        "(default 0.125; 0.25 with --compare)",
    )
    # the same defaults as `conductor replay --live`: its table then reads like the demo's
    p.add_argument("--slo-ttft", type=float, default=LIVE_SLO_TTFT_S, help="TTFT SLO in seconds (admission and goodput)")
    p.add_argument("--slo-tbt", type=float, default=LIVE_SLO_TBT_S, help="TBT SLO in seconds (admission and goodput)")
    p.add_argument("--noise", type=float, default=0.05, help="emulators' timing noise (lognormal sigma)")
    p.add_argument("--concurrency", type=int, default=256, help="most requests in flight at the client")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name the emulators report")
    p.add_argument("--seed", type=int, default=0, help="prompt synthesis seed")
    p.add_argument(
        "--base-port",
        type=int,
        default=None,
        metavar="N",
        help="listen on ports N, N+1, ...: the gateway on N, the workers after it (each checked free first); "
        "default: any free ports",
    )
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the results as JSON")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="write the children's logs here and keep them")
    p.add_argument(
        "--no-kv-index", action="store_true", help="route without the gateway's KV-cache index (no tokenizing, no KV events)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


class _Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwind like Ctrl-C does, through every finally.

    A KeyboardInterrupt so that asyncio lets it out of the task that raises it (see _until_sigterm)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


async def _interruptible(work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; Ctrl-C or SIGTERM cancel it and raise KeyboardInterrupt / _Terminated.

    Both signals go through the event loop (add_signal_handler) while it runs: asyncio.run's own
    SIGINT handler and a Python-level SIGTERM handler act only when the loop happens to run Python
    code, and CI saw an interrupted demo replay on to the end and exit 0."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await work
    except asyncio.CancelledError:
        if not received:
            raise
        if received[0] == signal.SIGTERM:
            raise _Terminated() from None
        raise KeyboardInterrupt() from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # which leaves the defaults: the demo's own handlers again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _on_sigterm)


def _scaled_params(time_scale: float, log_dir: Path) -> str:
    """Predictor params fitted from the bundled profile, every time multiplied by `time_scale`."""
    from predictors.params import PredictorParams
    from predictors.profile import bundled_profile, fit_profiles

    params: PredictorParams = fit_profiles([bundled_profile()]).scaled(time_scale, time_scale, time_scale)
    path = log_dir / "predictor-params.json"
    params.save(path)
    return str(path)


# a --compare's load unless told otherwise: at twice the demo's lengths the prefills queue and
# placement shows; at the demo's own the policies met the SLOs alike (README.md has the runs)
SINGLE_LOAD = {"requests": 200, "length_scale": 0.125}
COMPARE_LOAD = {"requests": 60, "length_scale": 0.25}


def _fill_defaults(args: argparse.Namespace) -> None:
    """The load options not given: the single run's, or the comparison's."""
    load = COMPARE_LOAD if args.compare else SINGLE_LOAD
    for key, value in load.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _check(args: argparse.Namespace) -> str | None:
    if args.requests < 1:
        return "--requests must be at least 1"
    if args.prefill < 1 or args.decode < 1:
        return "--prefill and --decode must be at least 1"
    if args.time_scale <= 0 or args.speedup <= 0:
        return "--time-scale and --speedup must be > 0"
    if not 0 < args.length_scale <= 1:
        return "--length-scale must be in (0, 1]"
    if args.base_port is not None:
        try:  # every port checked before anything starts; each cluster of a --compare reuses them
            ports_from(args.base_port, ports_needed(args.prefill, args.decode, args.pd_protocol))
        except (PortTaken, ValueError) as exc:
            return f"--base-port {args.base_port}: {exc}"
    return None


def demo_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _fill_defaults(args)
    problem = _check(args)
    if problem:
        print(f"conductor demo: {problem}", file=sys.stderr)
        return 2
    from traces.formats import load_trace, resolve_trace

    path = resolve_trace(args.trace)
    if not path.exists():
        print(f"conductor demo: trace {args.trace} not found", file=sys.stderr)
        return 2
    requests = load_trace(path, limit=args.requests).requests
    if not requests:
        print(f"conductor demo: trace {args.trace} has no usable requests", file=sys.stderr)
        return 2
    from traces.sim.runner import PolicySpec

    try:  # "name" or "name:option=value:...", as the replay CLI takes them; refused before anything starts
        policies = [PolicySpec.parse(p) for p in (args.policy, *(args.compare or "").split(",")) if p.strip()]
    except ValueError as exc:
        print(f"conductor demo: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(args.keep_logs) if args.keep_logs else Path(tempfile.mkdtemp(prefix="conductor-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    groups: list[ChildGroup] = []
    results: list[LiveResult] = []
    clusters: list[dict[str, Any]] = []  # when each cluster started and was ready, for the JSON
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    ok = False
    started = time.monotonic()
    try:
        for policy in policies:
            # each policy on a cluster of its own, started cold: no run inherits another's caches
            run_dir = log_dir if len(policies) == 1 else log_dir / re.sub(r"[^\w.-]+", "_", policy.label)
            run_dir.mkdir(parents=True, exist_ok=True)
            group = ChildGroup(run_dir)
            groups.append(group)
            try:
                results.append(_run(args, policy, requests, group, run_dir, (started, clusters)))
            finally:
                group.stop()
        ok = _report(args, results, groups, clusters)
    except (KeyboardInterrupt, _Terminated):
        print("\nconductor demo: interrupted, stopping the cluster", file=sys.stderr)
    except (RuntimeError, OSError, ValueError, aiohttp.ClientError) as exc:
        print(f"\nconductor demo: {exc}", file=sys.stderr)
    finally:
        # a second Ctrl-C must not cut the shutdown short and orphan workers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for group in groups:
            group.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)
    children = [c for g in groups for c in g.children]
    pids = " ".join(str(c.pid) for c in children)
    print(f"demo: stopped {len(children)} processes ({pids}) after {time.monotonic() - started:.1f}s", file=sys.stderr)
    if ok and not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not ok:
        print(f"demo: logs of every process are in {log_dir}", file=sys.stderr)
    return 0 if ok else 1


def _run(
    args: argparse.Namespace,
    chosen: PolicySpec,
    requests: Sequence[TraceRequest],
    group: ChildGroup,
    log_dir: Path,
    timings: tuple[float, list[dict[str, Any]]],
) -> LiveResult:
    """Start a cluster routed by `chosen`, replay the requests through it, return what happened.
    `timings`: the demo's start, and the list this cluster's start and ready times go to."""
    from traces.live import TextProgress, replay_live
    from traces.synth import PromptSynthesizer

    policy = chosen.label  # the spec as given: the run's name in the output
    options: dict[str, object] = dict(chosen.options)
    if chosen.name == "kvcache_aware" and args.time_scale != 1.0 and "predictor_params" not in options:
        options["predictor_params"] = _scaled_params(args.time_scale, log_dir)
    spec = ClusterSpec(
        n_prefill=args.prefill,
        n_decode=args.decode,
        pd_protocol=args.pd_protocol,
        policy=chosen.name,
        model=args.model,
        time_scale=args.time_scale,
        noise=args.noise,
        slo_ttft_s=args.slo_ttft,
        slo_tbt_s=args.slo_tbt,
        policy_options=options,
        kv_index=not args.no_kv_index,
        base_port=args.base_port,
    )
    demo_started, clusters = timings
    cluster_started = time.monotonic()
    cluster = start_cluster(spec, group)
    for child in group.children:
        print(f"demo: {child.name} pid {child.pid} on {child.url}", file=sys.stderr)
    wait_ready(cluster, group)
    ready = time.monotonic()
    # from this cluster's own start: a --compare's second cluster does not count the first's replay
    clusters.append(
        {
            "policy": policy,
            "started_s": round(cluster_started - demo_started, 3),
            "ready_s": round(ready - demo_started, 3),
            "ready_after_s": round(ready - cluster_started, 3),
        }
    )
    print(
        f"demo: {args.prefill}P{args.decode}D ({args.pd_protocol}) ready after "
        f"{ready - cluster_started:.1f}s; replaying {len(requests)} requests of {args.trace} "
        f"(lengths x{args.length_scale:g}, {args.speedup:g}x faster) through {policy} at "
        f"{cluster.gateway_url}",
        file=sys.stderr,
    )
    bar = None if args.no_progress else TextProgress()
    try:
        result = asyncio.run(
            _interruptible(
                replay_live(
                    cluster.gateway_url,
                    requests,
                    time_scale=args.speedup,
                    concurrency_limit=args.concurrency,
                    slo_ttft_s=args.slo_ttft,
                    slo_tbt_s=args.slo_tbt,
                    progress=bar,
                    # the same seed for every policy: the same prompts, token for token
                    synthesizer=PromptSynthesizer(args.length_scale, seed=args.seed),
                    model=args.model,
                    label=policy,
                )
            )
        )
    finally:
        if bar is not None:
            bar.close()
    dead = group.dead()
    if dead:
        raise RuntimeError(f"{dead[0].name} died during the replay:\n{dead[0].log_tail()}")
    return result


def _first_failures(result: LiveResult) -> dict[str, str]:
    """The first failed request's message of each failure kind (not 429s), for the error report."""
    first: dict[str, str] = {}
    for outcome in result.outcomes:
        http = outcome.http
        if http.status == "error" and http.reason is not None and http.reason not in first:
            first[http.reason] = f"line {outcome.line}, after {http.elapsed_s:.3f}s: {http.message or '-'}"
    return first


def _report(
    args: argparse.Namespace, results: Sequence[LiveResult], groups: Sequence[ChildGroup], clusters: list[dict[str, Any]]
) -> bool:
    """Print the runs (side by side when several), write the JSON; False when requests failed."""
    from traces.live_results import print_comparison, print_live

    if len(results) == 1:
        print_live(results[0])
    else:
        print_comparison(results)
    if args.json_out:
        doc = {
            "trace": args.trace,
            "results": [r.run.as_dict() for r in results],
            "live": results[0].as_dict() if len(results) == 1 else [r.as_dict() for r in results],
            "processes": {
                (f"{r.run.policy}/" if len(results) > 1 else "") + c.name: c.pid
                for r, g in zip(results, groups, strict=False)
                for c in g.children
            },
            "clusters": clusters,
            "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    ok = True
    for result in results:
        failed = sum(result.errors.values())
        if failed:  # emulators do not fail requests: something is broken, and the logs say what
            print(
                f"conductor demo: {result.run.policy}: {failed} of {result.run.requests} requests failed "
                f"({', '.join(f'{k}={v}' for k, v in sorted(result.errors.items()))})",
                file=sys.stderr,
            )
            for reason, message in _first_failures(result).items():
                print(f"conductor demo:   first {reason}: {message}", file=sys.stderr)
            ok = False
    return ok
