"""Prompt synthesis (pure) and live replay through a real gateway in front of emulated workers
(real subprocesses, real sockets): completion, client-side TTFT/TBT, cached tokens, 429s by
reason, errors, and the `conductor replay --live` command."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, redirect_stdout
from pathlib import Path

import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.emulator import Emulator, free_port, start_emulator
from tests.support.servers import READY_TIMEOUT_S, ServerThread, serve_gateway
from traces.formats import TraceRequest
from traces.live import TextProgress, replay_live, text_prompt
from traces.live_results import LiveResult
from traces.replay_cli import replay_main
from traces.synth import PromptSynthesizer, common_prefix, scaled_block_tokens

MODEL = "tiny"


def _req(ids: tuple[int, ...], input_length: int, output_length: int = 8, line: int = 1, arrival_s: float = 0.0) -> TraceRequest:
    return TraceRequest(arrival_s, input_length, output_length, ids, line)


# ---- synthesis ------------------------------------------------------------------------------


def test_shared_hash_ids_share_exactly_their_blocks() -> None:
    synth = PromptSynthesizer()
    a = synth.prompt(_req((0, 1, 2), 3 * 512, line=1))
    b = synth.prompt(_req((0, 1, 5), 3 * 512, line=2))
    c = synth.prompt(_req((9, 1, 2), 3 * 512, line=3))
    assert common_prefix(a, b) == 2 * 512  # equal through block 1, different from block 2's first token
    assert common_prefix(a, c) == 0
    assert a[512:] == c[512:]  # same id, same block, wherever it sits
    assert all(0 <= t < 256 for t in a)


def test_lengths_are_exact_and_deterministic() -> None:
    req = _req((3, 4, 5), 1300, output_length=500)
    prompt = PromptSynthesizer().prompt(req)
    assert len(prompt) == 1300
    assert PromptSynthesizer().prompt(req) == prompt  # a fresh synthesizer, the same tokens
    other_seed = PromptSynthesizer(seed=7).prompt(req)
    assert other_seed[:4] == prompt[:4] and other_seed != prompt  # header bytes fixed, body reseeded
    synth = PromptSynthesizer().synthesize(req)
    assert synth.max_tokens == 500 and synth.blocks == 3


def test_length_scale_keeps_block_structure() -> None:
    synth = PromptSynthesizer(0.125)
    assert scaled_block_tokens(512, 0.125) == 64
    a = synth.synthesize(_req((0, 1, 2), 1300, output_length=500))
    b = synth.synthesize(_req((0, 1, 7), 1500, output_length=3, line=2))
    assert len(a.prompt) == 163  # ceil(1300 * 64 / 512): three blocks, the last partly filled
    assert len(b.prompt) == 188
    assert a.max_tokens == 62 and b.max_tokens == 1  # scaled, at least one token
    assert common_prefix(a.prompt, b.prompt) == 128
    with pytest.raises(ValueError):
        PromptSynthesizer(0.0)
    with pytest.raises(ValueError):
        PromptSynthesizer(1.5)


def test_padding_beyond_the_blocks_is_not_shared() -> None:
    synth = PromptSynthesizer()
    a = synth.synthesize(_req((7,), 600, line=1))
    b = synth.synthesize(_req((7,), 600, line=2))
    assert len(a.prompt) == 600 and a.blocks == 2
    assert 512 <= common_prefix(a.prompt, b.prompt) < 516


def test_block_memo_is_bounded() -> None:
    synth = PromptSynthesizer(cache_blocks=2)
    for i in range(5):
        synth.prompt(_req((i, i + 100), 1024))
    assert synth.cached_blocks == 2


def test_progress_line_on_a_pipe_is_plain_lines() -> None:
    from traces.live import LiveProgress

    out = io.StringIO()
    bar = TextProgress(out, pipe_interval_s=3600)
    bar(LiveProgress(4, 1, 0, 0, 0, 0, 0.1))
    bar(LiveProgress(4, 2, 1, 1, 0, 0, 0.2))  # within the interval: not shown
    bar(LiveProgress(4, 4, 4, 3, 1, 0, 0.5))  # the last one always is
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[-1].startswith("[" + "#" * 30 + "] 4/4 ok 3 429 1 err 0")


# ---- live replay ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_workers() -> Iterator[tuple[Emulator, Emulator]]:
    with ExitStack() as stack:
        p = stack.enter_context(start_emulator("prefill", "nixl", time_scale=0.05, model=MODEL))
        d = stack.enter_context(start_emulator("decode", "nixl", time_scale=0.05, model=MODEL))
        yield p, d


def _gateway(stack: ExitStack, ready_timeout_s: float | None = READY_TIMEOUT_S, **overrides: object) -> ServerThread:
    """`ready_timeout_s`: as serve_gateway's (None where the workers are dead on purpose)."""
    settings = load_settings(environ={}, overrides=merge_settings({"health": {"interval_s": 1.0}}, overrides))
    return stack.enter_context(serve_gateway(Gateway(settings), ready_timeout_s=ready_timeout_s))


def _conversation(n: int) -> list[TraceRequest]:
    """`n` requests over 2 s: a shared 2-block system prefix, then each turn's own blocks."""
    return [
        _req((1000, 1001, 2000 + 2 * i, 2001 + 2 * i), 4 * 512 - 100, output_length=6 + i % 5, line=i + 1, arrival_s=i * 0.1)
        for i in range(n)
    ]


def _replay(url: str, requests: list[TraceRequest], **kw: object) -> LiveResult:
    opts: dict[str, object] = {"time_scale": 10.0, "synthesizer": PromptSynthesizer(0.25), "model": MODEL}
    opts.update(kw)
    return asyncio.run(replay_live(url, requests, **opts))  # type: ignore[arg-type]


def test_replay_through_pd_gateway_measures_every_request(pd_workers: tuple[Emulator, Emulator]) -> None:
    p, d = pd_workers
    with ExitStack() as stack:
        gw = _gateway(stack, prefill=[{"url": p.url}], decode=[d.url], pd={"protocol": "nixl"})
        result = _replay(gw.url, _conversation(20), slo_ttft_s=5.0, slo_tbt_s=1.0, label="rr")
    run = result.run
    assert (run.mode, run.policy, run.n_prefill, run.n_decode) == ("live", "rr", 1, 1)
    assert run.requests == run.completed == 20 and run.rejected == 0 and not result.errors
    # the distributions are of what the client measured, whatever this box's speed
    ttfts = [o.http.ttft_s for o in result.outcomes if o.http.ttft_s is not None]
    tbts = [o.http.tbt_s for o in result.outcomes if o.http.tbt_s is not None]
    assert run.ttft.count == len(ttfts) == 20 and 0 < min(ttfts) <= run.ttft.p50 <= max(ttfts)
    assert run.tbt.count == len(tbts) == 20 and 0 < min(tbts) <= run.tbt.p50 <= max(tbts)
    # the SLOs are judged on those measurements; goodput is the requests that met them over the
    # arrivals' span (1.9 s of trace / 10)
    met = len([o for o in result.outcomes if (o.http.ttft_s or 0) <= 5.0 and (o.http.tbt_s or 0) <= 1.0])
    assert run.slo_met == met and run.goodput_rps == pytest.approx(met / 0.19, rel=0.01)
    # arrivals honoured: request i is due at i * 0.1 s / 10, and none was sent early
    for o in result.outcomes:
        assert o.scheduled_s == pytest.approx((o.line - 1) * 0.01, abs=1e-9)
        assert o.lag_s > -0.005  # a lower bound (asyncio's timers may fire a clock tick early): no slowness fails it
    assert run.makespan_s >= 0.19  # the last request is not even sent before 0.19 s
    for o in result.outcomes:
        assert o.http.chunks == o.max_tokens  # every token arrived as its own content chunk
        assert o.http.prompt_tokens == o.prompt_tokens == 4 * 128 - 25
    # the shared 2-block prefix is computed once, then reported cached by the prefill worker
    assert run.extra["hit_rate_from_gateway"] == 1.0
    share = run.prefix_hit_local
    assert share == run.extra["gateway_cached_share"]
    assert 0.3 < share < 256 / (4 * 128 - 25)


def test_repeated_prefix_shows_cached_tokens_in_client_usage() -> None:
    with ExitStack() as stack:
        m = stack.enter_context(start_emulator("mixed", time_scale=0.05, model=MODEL))
        gw = _gateway(stack, mixed=[m.url])
        result = _replay(gw.url, _conversation(3), time_scale=1.0)
    cached = [o.http.cached_tokens for o in sorted(result.outcomes, key=lambda o: o.line)]
    assert cached[0] == 0
    assert cached[1] == cached[2] == 256  # the two shared 128-token blocks, 16 KV blocks of 16
    assert result.run.extra["client_cached_share"] > 0


def test_text_prompts_keep_lengths_and_sharing() -> None:
    # sent straight to a worker (not Conductor) as text: one character per token, so the worker's
    # byte tokenizer counts the same tokens and caches the same shared prefix
    with start_emulator("mixed", time_scale=0.05, model=MODEL) as m:
        result = _replay(m.url, _conversation(3), time_scale=1.0, text_prompts=True)
    outcomes = sorted(result.outcomes, key=lambda o: o.line)
    assert [o.http.prompt_tokens for o in outcomes] == [o.prompt_tokens for o in outcomes] == [4 * 128 - 25] * 3
    assert [o.http.cached_tokens for o in outcomes] == [0, 256, 256]
    assert text_prompt([0, 1, 94, 95, 255]) == " !~ " + chr(32 + 255 % 95)


def test_rejections_are_counted_by_reason(pd_workers: tuple[Emulator, Emulator]) -> None:
    p, d = pd_workers
    with ExitStack() as stack:
        gw = _gateway(
            stack,
            prefill=[{"url": p.url}],
            decode=[d.url],
            pd={"protocol": "nixl"},
            policy="kvcache_aware",
            slo={"ttft_s": 0.001},
        )  # no prefill is that fast
        result = _replay(gw.url, _conversation(6), slo_ttft_s=0.001)
    run = result.run
    assert run.rejected == 6 and dict(run.rejections) == {"ttft_slo": 6}
    assert run.completed == 0 and run.slo_met == 0 and run.goodput_rps == 0
    assert all(o.http.http_status == 429 for o in result.outcomes)


def test_errors_are_counted_by_kind() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with ExitStack() as stack:
        gw = _gateway(stack, ready_timeout_s=None, mixed=[dead], models=[MODEL])
        result = _replay(gw.url, _conversation(3))
    assert result.run.completed == 0 and result.run.rejected == 0
    assert sum(result.errors.values()) == 3 and all(k.startswith("http_5") for k in result.errors)
    assert result.run.extra["errors"] == 3


def test_replay_command_live(pd_workers: tuple[Emulator, Emulator], tmp_path: Path) -> None:
    p, d = pd_workers
    out = tmp_path / "live.json"
    with ExitStack() as stack:
        gw = _gateway(stack, prefill=[{"url": p.url}], decode=[d.url], pd={"protocol": "nixl"}, policy="kvcache_aware")
        printed = io.StringIO()
        with redirect_stdout(printed):
            rc = replay_main(
                [
                    "conversation-head400",
                    "--live",
                    gw.url,
                    "--limit",
                    "12",
                    "--speedup",
                    "20",
                    "--length-scale",
                    "0.0625",
                    "--label",
                    "gw",
                    "--no-progress",
                    "--json",
                    str(out),
                ]
            )
    assert rc == 0
    text = printed.getvalue()
    assert "gw (live)" in text and "errors" in text and "prefix hit source" in text
    assert "TTFT pred. MAPE (gateway, n)" in text  # the policy's own error window, read from /metrics
    doc = json.loads(out.read_text())
    result = doc["results"][0]
    assert result["mode"] == "live" and result["requests"] == 12
    # no --slo-ttft/--slo-tbt: judged by the demo's SLOs, not the simulator's loose 30 s / 0.1 s
    assert (result["slo_ttft_s"], result["slo_tbt_s"]) == (0.5, 0.04)
    assert re.search(r"^SLO \(TTFT, TBT\)\s+0\.5s, 0\.04s\s*$", text, re.M), text
    assert result["completed"] + result["rejected"] + result["extra"]["errors"] == 12
    assert result["completed"] >= 1 and result["ttft"]["count"] == result["completed"]
    records = doc["live"]["requests"]
    assert [r["line"] for r in records] == list(range(1, 13))
    assert sum(r["status"] == "ok" for r in records) == result["completed"]


def test_prediction_errors_fold_instances_by_samples() -> None:
    from prometheus_client import generate_latest

    from conductor.ops.metrics import GatewayMetrics
    from traces.live_client import cached_counts, prediction_errors

    m = GatewayMetrics()
    for instance, mape, n in (("prefill-0", 0.1, 10), ("prefill-1", 0.4, 30)):
        m.prediction_mape.labels("ttft", instance).set(mape)
        m.prediction_samples.labels("ttft", instance).set(n)
    m.cached_tokens.labels("cached").inc(25)
    m.cached_tokens.labels("computed").inc(75)
    text = generate_latest(m.registry).decode()
    n, mape = prediction_errors(text)["ttft"]
    assert n == 40 and mape == pytest.approx((0.1 * 10 + 0.4 * 30) / 40)
    assert cached_counts(text) == (25.0, 75.0)
    assert cached_counts(generate_latest(GatewayMetrics().registry).decode()) == (0.0, 0.0)
    assert cached_counts("up 1\n") is None
