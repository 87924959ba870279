"""Live trace replay: send a trace through a running gateway over HTTP and measure at the client.

    conductor replay conversation-head400 --live http://127.0.0.1:8000 --limit 200 --speedup 2 \
        --length-scale 0.125 --slo-ttft 2 --slo-tbt 0.05 --json out.json

Each trace request becomes a streamed `/v1/completions` call with a token-id prompt (traces.synth:
shared hash ids -> shared token prefixes), `max_tokens` = the (scaled) output length,
`ignore_eos`, and `stream_options.include_usage`, sent at its arrival time divided by the speed-up.
Measured at the client, from the moment the request is sent: TTFT (first content chunk), TBT (mean
gap between content chunks of a request), cached tokens from the final usage chunk, HTTP 429s by the
reason code in their OpenAI error body, other errors by kind. Goodput is the number of requests that
met both SLOs per second of (scaled) trace time, as in the simulator. The SLOs are `--slo-ttft` and
`--slo-tbt`, by default `conductor demo`'s (0.5 s, 40 ms): the gateway does not publish its own.

Prefix hit rate: in P/D serving the decode worker's usage counts the KV it received from prefill as
cached (vLLM does), so the usage the client sees says little about prefix reuse. When the target is
a Conductor gateway, the share is read from its `conductor_prompt_tokens_total` counter (cached vs
computed, as the prefill workers reported them), before and after the replay; otherwise from the
client's usage chunks. `extra` in the JSON has both, and which one the table shows.

The result is a `traces.sim.results.RunResult` (mode "live"), printed with the simulator's table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

from traces.formats import TraceRequest, load_trace, resolve_trace
from traces.live_client import (
    cached_counts,
    fetch_json,
    prediction_errors,
    sample_value,
    scrape_metrics,
    session_headers,
    stream_completion,
)
from traces.live_results import LiveOutcome, LiveResult, print_live, summarize
from traces.sim.options import LIVE_SLO_TBT_S, LIVE_SLO_TTFT_S
from traces.synth import PromptSynthesizer, SynthRequest


@dataclass(frozen=True, slots=True)
class LiveProgress:
    """Counts so far, for a progress display."""

    total: int
    sent: int
    done: int
    ok: int
    rejected: int
    errors: int
    elapsed_s: float


ProgressSink = Callable[[LiveProgress], None]


class TextProgress:
    """One updating line on a terminal (stderr): `[#####.....] 120/200 ok 110 429 4 err 0 ...`.

    When the stream is not a terminal (a log file, a pipe) it writes a plain line every
    `pipe_interval_s` instead, so logs do not fill with carriage returns."""

    def __init__(
        self, stream: IO[str] | None = None, width: int = 30, interval_s: float = 0.1, pipe_interval_s: float = 5.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self.interval_s = interval_s if self.tty else pipe_interval_s
        self._last = -float("inf")
        self._shown: LiveProgress | None = None

    def __call__(self, p: LiveProgress) -> None:
        now = time.monotonic()
        final = p.done >= p.total
        if not final and now - self._last < self.interval_s:
            return  # redrawing on every chunk would cost more than the replay
        if final and self._shown is not None and self._shown.done >= p.total:
            return
        self._last = now
        self._shown = p
        filled = self.width * p.done // max(1, p.total)
        bar = "#" * filled + "." * (self.width - filled)
        text = (
            f"[{bar}] {p.done}/{p.total} ok {p.ok} 429 {p.rejected} err {p.errors} in flight {p.sent - p.done} {p.elapsed_s:.1f}s"
        )
        self.stream.write(f"\r{text} " if self.tty else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._shown is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()


# token id b -> printable ASCII 32 + b % 95: one character per token, and equal blocks stay equal
_TO_TEXT = bytes(32 + b % 95 for b in range(256))


def text_prompt(prompt: Sequence[int]) -> str:
    """A synthesized prompt (token ids below 256) as text of the same length and the same sharing:
    for routers whose cache-aware policies match prompts as text (vllm-router, sglang-router), and
    workers whose tokenizer is byte-level (the emulator)."""
    return bytes(prompt).translate(_TO_TEXT).decode("ascii")


async def replay_live(
    url: str,
    requests: Sequence[TraceRequest] | Sequence[SynthRequest],
    *,
    time_scale: float = 1.0,
    concurrency_limit: int = 256,
    slo_ttft_s: float | None = None,
    slo_tbt_s: float | None = None,
    progress: ProgressSink | None = None,
    synthesizer: PromptSynthesizer | None = None,
    model: str | None = None,
    api_key: str | None = None,
    label: str = "live",
    request_timeout_s: float = 600.0,
    text_prompts: bool = False,
) -> LiveResult:
    """Replay `requests` against the gateway at `url`; arrivals are divided by `time_scale` (a
    speed-up: 10 replays ten times faster). TraceRequests are synthesized with `synthesizer`
    (default: full length); SynthRequests are sent as they are. `concurrency_limit` caps requests
    in flight (and connections); one waiting for a slot counts as late (`lag_s`), not slow.
    `text_prompts`: send each prompt as text (`text_prompt`) instead of token ids."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
    synth = synthesizer or PromptSynthesizer()
    # prompts are synthesized when sent: a whole trace's would not fit in memory
    items: list[TraceRequest | SynthRequest] = list(requests)
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=concurrency_limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10.0)
    async with aiohttp.ClientSession(base_url=base, connector=connector, timeout=timeout, headers=headers) as session:
        model = model or await _first_model(session)
        ready = await fetch_json(session, "/ready")
        healthy = ready.get("healthy", {}) if isinstance(ready, Mapping) else {}
        metrics_before = await scrape_metrics(session)
        before = cached_counts(metrics_before)
        outcomes = await _run_schedule(session, items, synth, model, time_scale, concurrency_limit, progress, text_prompts)
        metrics_after = await scrape_metrics(session)
    after = cached_counts(metrics_after)
    wall = max((o.scheduled_s + o.lag_s + o.http.elapsed_s for o in outcomes), default=0.0)
    delta = None
    if before is not None and after is not None:
        delta = (after[0] - before[0], after[1] - before[1])
    return summarize(
        outcomes,
        label=label,
        n_prefill=int(healthy.get("prefill", 0) or healthy.get("mixed", 0)),
        n_decode=int(healthy.get("decode", 0)),
        slo_ttft_s=slo_ttft_s,
        slo_tbt_s=slo_tbt_s,
        wall_s=wall,
        gateway_cached=delta if delta and sum(delta) > 0 else None,
        predictions=prediction_errors(metrics_after),
        kv_index=_kv_index_figures(metrics_before, metrics_after),
    )


_KV_PREDICTED = "conductor_kv_predicted_cached_tokens_total"
_KV_REPORTED = "conductor_kv_reported_cached_tokens_total"


def _kv_index_figures(before: str | None, after: str | None) -> dict[str, float]:
    """What a gateway with KV awareness says of its index: hash agreement now, and the cached tokens
    it predicted on the chosen instances vs those the workers reported, over the replay."""
    out: dict[str, float] = {}
    agreement = sample_value(after, "conductor_kv_hash_agreement")
    if agreement is None:
        return out
    out["gateway_kv_hash_agreement"] = agreement
    for key, name in (("gateway_kv_predicted_cached_tokens", _KV_PREDICTED), ("gateway_kv_reported_cached_tokens", _KV_REPORTED)):
        out[key] = (sample_value(after, name) or 0.0) - (sample_value(before, name) or 0.0)
    return out


async def _first_model(session: aiohttp.ClientSession) -> str:
    doc = await fetch_json(session, "/v1/models")
    data = doc.get("data") if isinstance(doc, Mapping) else None
    if isinstance(data, list) and data and isinstance(data[0], Mapping) and data[0].get("id"):
        return str(data[0]["id"])
    raise ValueError("the gateway lists no model on /v1/models; pass --model")


async def _run_schedule(
    session: aiohttp.ClientSession,
    items: Sequence[TraceRequest | SynthRequest],
    synth: PromptSynthesizer,
    model: str,
    time_scale: float,
    limit: int,
    progress: ProgressSink | None,
    text_prompts: bool = False,
) -> list[LiveOutcome]:
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(limit)
    counts = {"sent": 0, "done": 0, "ok": 0, "rejected": 0, "error": 0}
    start = loop.time()
    first = min((i.arrival_s for i in items), default=0.0)

    def report() -> None:
        if progress is not None:
            progress(
                LiveProgress(
                    len(items),
                    counts["sent"],
                    counts["done"],
                    counts["ok"],
                    counts["rejected"],
                    counts["error"],
                    loop.time() - start,
                )
            )

    async def one(source: TraceRequest | SynthRequest, due: float) -> LiveOutcome:
        async with gate:  # at most `limit` prompts exist at once
            item = source if isinstance(source, SynthRequest) else synth.synthesize(source)
            sent = loop.time()
            counts["sent"] += 1
            prompt = text_prompt(item.prompt) if text_prompts else list(item.prompt)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": item.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "temperature": 0.0,
            }
            tagged = None if isinstance(source, SynthRequest) else session_headers(source.session)
            http = await stream_completion(session, body, headers=tagged)
        counts["done"] += 1
        counts[http.status if http.status in counts else "error"] += 1
        report()
        return LiveOutcome(item.line, due - start, sent - due, len(item.prompt), item.max_tokens, http)

    tasks: list[asyncio.Task[LiveOutcome]] = []
    try:
        for item in sorted(items, key=lambda i: i.arrival_s):
            due = start + (item.arrival_s - first) / time_scale
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item, due)))
            report()
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # on cancellation (Ctrl-C) nothing is left running
            task.cancel()


def add_live_args(parser: argparse.ArgumentParser) -> None:
    """Options of `conductor replay --live` (added to traces.replay_cli's parser)."""
    g = parser.add_argument_group("live replay (--live URL)")
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="scale prompt and output lengths (and the 512-token block) by this factor, 0 < f <= 1",
    )
    g.add_argument("--concurrency", type=int, default=256, help="most requests in flight (and connections)")
    g.add_argument("--model", default=None, help="model name to send (default: the gateway's first)")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--label", default="live", help="column heading in the table")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run_live(args: argparse.Namespace) -> int:
    """`conductor replay TRACE --live URL ...`: replay, print the table, write --json."""
    path = resolve_trace(args.trace)
    if not path.exists():
        print(f"error: trace {args.trace} not found", file=sys.stderr)
        return 2
    loaded = load_trace(path, limit=args.limit)
    if not loaded.requests:
        print(f"error: trace {args.trace} has no usable requests", file=sys.stderr)
        return 2
    bar = None if getattr(args, "no_progress", False) else TextProgress()
    try:
        synth = PromptSynthesizer(getattr(args, "length_scale", 1.0), seed=getattr(args, "seed", 0) or 0)
        result = asyncio.run(
            replay_live(
                args.live,
                loaded.requests,
                time_scale=args.speedup,
                concurrency_limit=getattr(args, "concurrency", 256),
                # unless given, the demo's SLOs (traces/sim/options.py says why), not the simulator's
                slo_ttft_s=LIVE_SLO_TTFT_S if args.slo_ttft is None else args.slo_ttft,
                slo_tbt_s=LIVE_SLO_TBT_S if args.slo_tbt is None else args.slo_tbt,
                progress=bar,
                synthesizer=synth,
                model=getattr(args, "model", None),
                api_key=getattr(args, "api_key", None),
                label=getattr(args, "label", "live"),
                request_timeout_s=getattr(args, "request_timeout", 600.0),
            )
        )
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        print(f"\nerror: live replay against {args.live} failed: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the replay's tasks are cancelled by now: their connections closed
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    print_live(result)
    if args.json_out:
        doc = {"trace": args.trace, "results": [result.run.as_dict()], "live": result.as_dict()}
        Path(args.json_out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    return 0
