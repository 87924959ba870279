"""The live replay's HTTP client side: one streamed completion, measured; a few small GETs.

Kept apart from traces/live.py (scheduling and summary) so the parsing of OpenAI SSE streams can be
read on its own. aiohttp, as the rest of the project's load generators.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

_decode = msgspec.json.Decoder().decode
_CACHED_RE = re.compile(r'^conductor_prompt_tokens_total\{source="(cached|computed)"\}\s+([0-9.eE+-]+)', re.M)
_LABELS = r'\{component="([^"]*)",instance="([^"]*)"\}\s+([0-9.eE+-]+|NaN)'
_MAPE_RE = re.compile(r"^conductor_prediction_mape" + _LABELS, re.M)
_SAMPLES_RE = re.compile(r"^conductor_prediction_samples" + _LABELS, re.M)
_MAX_ERROR_TEXT = 300  # keep error messages short: thousands may fail at once


@dataclass(frozen=True, slots=True)
class HttpOutcome:
    """One request as the client saw it."""

    status: str  # "ok", "rejected" (HTTP 429) or "error"
    http_status: int | None  # None when no response came (connection refused, timeout)
    reason: str | None  # 429: the error body's code (e.g. "ttft_slo"); error: a kind such as "http_502"
    ttft_s: float | None  # send to first content chunk
    tbt_s: float | None  # mean gap between content chunks (None with fewer than two)
    chunks: int  # content chunks received
    prompt_tokens: int | None  # from the usage chunk
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    elapsed_s: float  # send to end of response
    message: str | None = None  # error text, truncated


def _content_of(choice: Any) -> bool:
    """True when a stream choice carries generated text (completions `text`, chat `delta.content`)."""
    if not isinstance(choice, dict):
        return False
    text = choice.get("text")
    if text:
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content"))


def _error_reason(body: bytes, status: int) -> tuple[str, str]:
    try:
        err = _decode(body).get("error", {})
        code = err.get("code")
        return (str(code) if code not in (None, "") else str(status)), str(err.get("message", ""))[:_MAX_ERROR_TEXT]
    except (msgspec.DecodeError, AttributeError):
        return str(status), body[:_MAX_ERROR_TEXT].decode("utf-8", "replace")


@dataclass
class _StreamRead:
    """What a streamed answer showed so far: content chunks, their times, the usage chunk."""

    sent: float
    first: float | None = None
    last: float = 0.0
    chunks: int = 0
    prompt_tokens: int | None = None
    cached: int | None = None

    def take(self, event: dict[str, Any], now: float) -> None:
        if any(_content_of(c) for c in event.get("choices") or ()):
            self.chunks += 1
            if self.first is None:
                self.first = now
            self.last = now
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.cached = details.get("cached_tokens") if isinstance(details, dict) else None

    def failed(self, reason: str, message: str, http_status: int | None = 200, usage: bool = True) -> HttpOutcome:
        prompt, cached = (self.prompt_tokens, self.cached) if usage else (None, None)
        elapsed = time.perf_counter() - self.sent
        return HttpOutcome("error", http_status, reason, None, None, self.chunks, prompt, cached, elapsed, message)

    def outcome(self) -> HttpOutcome:
        end = time.perf_counter()
        if self.first is None:
            return self.failed("truncated_stream", "stream ended without [DONE] or without content")
        tbt = (self.last - self.first) / (self.chunks - 1) if self.chunks > 1 else None
        ttft = self.first - self.sent
        return HttpOutcome("ok", 200, None, ttft, tbt, self.chunks, self.prompt_tokens, self.cached, end - self.sent)


async def _refused(resp: aiohttp.ClientResponse, sent: float) -> HttpOutcome:
    """A non-200 answer: a 429 is a rejection by its error code, anything else an error."""
    reason, message = _error_reason(await resp.read(), resp.status)
    rejected = resp.status == 429
    status, why = ("rejected", reason) if rejected else ("error", f"http_{resp.status}")
    return HttpOutcome(status, resp.status, why, None, None, 0, None, None, time.perf_counter() - sent, message)


async def _read_stream(resp: aiohttp.ClientResponse, read: _StreamRead) -> HttpOutcome:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return read.outcome()
        now = time.perf_counter()
        event = _decode(data)
        if "error" in event:
            _, message = _error_reason(data, 200)
            return read.failed("stream_error", message, usage=False)
        read.take(event, now)
    return read.failed("truncated_stream", "stream ended without [DONE] or without content")


SESSION_HEADER = "x-session-id"  # the gateway's default `sessions.header` (conductor/config/sessions.py)


def session_headers(trace_session: int | None) -> dict[str, str] | None:
    """The session header for a trace request's session (TraceRequest.session), None without one."""
    return None if trace_session is None else {SESSION_HEADER: f"trace-session-{trace_session}"}


async def stream_completion(
    session: aiohttp.ClientSession, body: dict[str, Any], path: str = "/v1/completions", headers: dict[str, str] | None = None
) -> HttpOutcome:
    """POST a streamed completion and measure it (with `headers` besides the session's own, e.g. the
    request's session header); never raises for HTTP or transport failures."""
    read = _StreamRead(sent=time.perf_counter())
    try:
        async with session.post(path, json=body, headers=headers) as resp:
            if resp.status != 200:
                return await _refused(resp, read.sent)
            return await _read_stream(resp, read)
    except TimeoutError:
        return read.failed("timeout", "request timed out", http_status=None, usage=False)
    except (aiohttp.ClientError, msgspec.DecodeError) as exc:
        kind = "bad_json" if isinstance(exc, msgspec.DecodeError) else "transport"
        return read.failed(kind, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT], http_status=None, usage=False)


async def fetch_json(session: aiohttp.ClientSession, path: str) -> Any:
    """GET a JSON document; None when it is missing or not JSON (the target may not be Conductor)."""
    try:
        async with session.get(path) as resp:
            return _decode(await resp.read())
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError):
        return None


async def scrape_metrics(session: aiohttp.ClientSession) -> str | None:
    """The target's Prometheus text, or None when it has no /metrics."""
    try:
        async with session.get("/metrics") as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def cached_counts(metrics: str | None) -> tuple[float, float] | None:
    """(cached, computed) prompt tokens from a Conductor gateway's metrics text; None if absent."""
    if metrics is None:
        return None
    found = {m.group(1): float(m.group(2)) for m in _CACHED_RE.finditer(metrics)}
    if not found and "conductor_prompt_tokens" not in metrics:
        return None  # not a Conductor gateway (a fresh one lists the counter with no samples yet)
    return found.get("cached", 0.0), found.get("computed", 0.0)


def prediction_errors(metrics: str | None) -> dict[str, tuple[float, float]]:
    """component -> (samples, sample-weighted MAPE) of the gateway's predictors over their recent
    windows (`conductor_prediction_mape` / `_samples`, per instance, folded together)."""
    if metrics is None:
        return {}
    mape = {(m.group(1), m.group(2)): float(m.group(3)) for m in _MAPE_RE.finditer(metrics)}
    out: dict[str, tuple[float, float]] = {}
    for m in _SAMPLES_RE.finditer(metrics):
        key, n = (m.group(1), m.group(2)), float(m.group(3))
        if key in mape and n > 0:
            total, weighted = out.get(key[0], (0.0, 0.0))
            out[key[0]] = (total + n, weighted + n * mape[key])
    return {c: (n, w / n) for c, (n, w) in out.items()}


def sample_value(metrics: str | None, name: str) -> float | None:
    """The value of an unlabelled sample (`name value`) in metrics text; None if absent."""
    if metrics is None:
        return None
    match = re.search(rf"^{re.escape(name)}\s+([0-9.eE+-]+|NaN)\s*$", metrics, re.M)
    return float(match.group(1)) if match else None
