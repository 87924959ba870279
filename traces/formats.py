"""Trace formats: Mooncake's released traces and the gateway's own recorded traces.

Two JSON-lines formats are read, detected line by line so a file may even mix them:

* Mooncake (FAST'25 release): ``{"timestamp": ms, "input_length": n, "output_length": n,
  "hash_ids": [...]}`` where each hash id names one 512-token prompt block (equal ids, equal block).
* Recorded (written by :class:`TraceRecorder` at the gateway): ``{"arrival_s": s, "input_length": n,
  "output_length": n, "block_size": 16, "block_keys": [...], "status": "ok", "ttft_s": s,
  "tbt_s": s, "rejected_reason": null}``. Never prompt text: only sizes, block keys and the outcome.

Files may be plain or gzip-compressed (detected by magic bytes, not by name). A malformed line is
reported as ``"line N: what is wrong"`` and skipped; a bad line never stops the load.
"""

from __future__ import annotations

import gzip
import io
import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

MOONCAKE_BLOCK_TOKENS = 512
RECORDED_FORMAT = "conductor-trace/1"
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_ERRORS_KEPT = 1000  # a garbage file must not fill memory with error strings



class TraceLineError(ValueError):
    """One line of a trace is malformed; the message says what is wrong (no line number)."""


_BUNDLED = {
    "conversation": "conversation_trace.jsonl.gz",
    "synthetic": "synthetic_trace.jsonl.gz",
    "conversation-head400": "conversation_trace.head400.jsonl",
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, in whichever format it was read from."""

    arrival_s: float  # seconds from trace start (Mooncake timestamp is ms)
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # ids of 512-token prompt blocks (Mooncake); block keys for recorded traces
    line: int  # 1-based line number in the file
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per entry of hash_ids


@dataclass(frozen=True, slots=True)
class TraceLoadResult:
    """Requests in file order and the lines that were skipped, each as ``"line N: ..."``."""

    requests: tuple[TraceRequest, ...]
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RecordedOutcome:
    """How the gateway answered one recorded request."""

    status: str  # "ok", "rejected" or "error"
    ttft_s: float | None = None  # arrival to first token at the gateway
    tbt_s: float | None = None  # mean gap between streamed tokens
    rejected_reason: str | None = None  # Rejection.reason when status == "rejected"


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One line of a recorded trace: the request as a TraceRequest plus its outcome."""

    request: TraceRequest
    outcome: RecordedOutcome


def bundled_trace(name: str) -> Path:
    """Path of a trace shipped in ``traces/data/``: "conversation", "synthetic", "conversation-head400"."""
    try:
        filename = _BUNDLED[name]
    except KeyError:
        raise ValueError(f"unknown bundled trace {name!r} (known: {', '.join(sorted(_BUNDLED))})") from None
    return Path(__file__).resolve().parent / "data" / filename


def resolve_trace(name_or_path: str | Path) -> Path:
    """A bundled trace name or a file path; CLI arguments accept either."""
    if isinstance(name_or_path, str) and name_or_path in _BUNDLED:
        return bundled_trace(name_or_path)
    return Path(name_or_path)


def _open_text(path: Path) -> IO[str]:
    raw = path.open("rb")  # a BufferedReader: peek() looks without consuming
    if raw.peek(2)[:2] == _GZIP_MAGIC:
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


def _int_field(obj: Mapping[str, Any], key: str, minimum: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TraceLineError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceLineError(f"{key} must be >= {minimum}, got {value}")
    return value


def _number_field(obj: Mapping[str, Any], key: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceLineError(f"{key} must be a number, got {value!r}")
    if not value >= 0 or value == float("inf"):  # also catches NaN
        raise TraceLineError(f"{key} must be a finite number >= 0, got {value}")
    return float(value)


def _optional_number(obj: Mapping[str, Any], key: str) -> float | None:
    return None if obj.get(key) is None else _number_field(obj, key)


def _ids_field(obj: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = obj.get(key, [])
    if not isinstance(value, list):
        raise TraceLineError(f"{key} must be a list of integers")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TraceLineError(f"{key} must hold integers only, got {item!r}")
    return tuple(value)


def parse_line(obj: object, line: int) -> RecordedRequest:
    """Parse one decoded JSON line of either format; raises TraceLineError saying what is wrong."""
    if not isinstance(obj, dict):
        raise TraceLineError("not a JSON object")
    inp = _int_field(obj, "input_length", 1)
    out = _int_field(obj, "output_length", 0)
    if "timestamp" in obj:  # Mooncake
        req = TraceRequest(_number_field(obj, "timestamp") / 1000.0, inp, out, _ids_field(obj, "hash_ids"), line)
        return RecordedRequest(req, RecordedOutcome(status="unknown"))
    if "arrival_s" in obj:  # recorded by the gateway
        block = _int_field(obj, "block_size", 1) if "block_size" in obj else MOONCAKE_BLOCK_TOKENS
        req = TraceRequest(_number_field(obj, "arrival_s"), inp, out, _ids_field(obj, "block_keys"), line, block)
        status = obj.get("status", "ok")
        reason = obj.get("rejected_reason")
        if not isinstance(status, str) or not (reason is None or isinstance(reason, str)):
            raise TraceLineError("status and rejected_reason must be strings")
        outcome = RecordedOutcome(status, _optional_number(obj, "ttft_s"), _optional_number(obj, "tbt_s"), reason)
        return RecordedRequest(req, outcome)
    raise TraceLineError("neither 'timestamp' (Mooncake) nor 'arrival_s' (recorded) present")


def iter_trace(path: str | Path, errors: list[str]) -> Iterator[RecordedRequest]:
    """Yield every well-formed line of a trace; malformed ones are appended to `errors` (bounded)."""
    with _open_text(Path(path)) as fh:
        lineno = 0
        while True:
            try:
                text = fh.readline()
            except (OSError, EOFError) as exc:  # truncated gzip: keep what was read
                errors.append(f"line {lineno + 1}: unreadable ({exc})")
                return
            if not text:
                return
            lineno += 1
            if not text.strip():
                continue
            try:
                yield parse_line(json.loads(text), lineno)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                if len(errors) < _MAX_ERRORS_KEPT:
                    errors.append(f"line {lineno}: {exc}")


def load_trace(path: str | Path, *, limit: int | None = None) -> TraceLoadResult:
    """Load a Mooncake or recorded trace (.jsonl or .jsonl.gz); at most `limit` requests."""
    errors: list[str] = []
    requests: list[TraceRequest] = []
    for rec in iter_trace(path, errors):
        if limit is not None and len(requests) >= limit:
            break
        requests.append(rec.request)
    return TraceLoadResult(tuple(requests), tuple(errors))


def load_recorded(path: str | Path, *, limit: int | None = None) -> tuple[tuple[RecordedRequest, ...], tuple[str, ...]]:
    """Like load_trace, but keeps each line's recorded outcome (status "unknown" for Mooncake lines)."""
    errors: list[str] = []
    out: list[RecordedRequest] = []
    for rec in iter_trace(path, errors):
        if limit is not None and len(out) >= limit:
            break
        out.append(rec)
    return tuple(out), tuple(errors)


def recorded_line(rec: RecordedRequest) -> str:
    """One recorded-format JSON line (no newline) for `rec`."""
    r, o = rec.request, rec.outcome
    obj = {
        "format": RECORDED_FORMAT,
        "arrival_s": round(r.arrival_s, 6),
        "input_length": r.input_length,
        "output_length": r.output_length,
        "block_size": r.block_tokens,
        "block_keys": list(r.hash_ids),
        "status": o.status,
        "ttft_s": o.ttft_s,
        "tbt_s": o.tbt_s,
        "rejected_reason": o.rejected_reason,
    }
    return json.dumps(obj, separators=(",", ":"))


class TraceRecorder:
    """Appends recorded-format lines to a file; safe to call from several threads.

    Arrival times are written relative to `start_s` (a monotonic clock reading the caller owns), so
    a recorded trace replays like a Mooncake one.
    """

    def __init__(self, path: str | Path, *, start_s: float = 0.0) -> None:
        self.path = Path(path)
        self.start_s = start_s
        self._lock = threading.Lock()
        self._fh: IO[str] | None = self.path.open("a", encoding="utf-8")
        self.written = 0

    def record(
        self,
        *,
        arrival_s: float,
        input_length: int,
        output_length: int,
        block_keys: tuple[int, ...] | list[int],
        block_size: int,
        outcome: RecordedOutcome,
    ) -> None:
        """Append one request; `arrival_s` is on the same clock as `start_s`."""
        req = TraceRequest(max(0.0, arrival_s - self.start_s), input_length, output_length,
                           tuple(block_keys), self.written + 1, block_size)
        self.write(RecordedRequest(req, outcome))

    def write(self, rec: RecordedRequest) -> None:
        line = recorded_line(rec) + "\n"
        with self._lock:
            if self._fh is None:
                raise ValueError(f"trace recorder for {self.path} is closed")
            self._fh.write(line)
            self._fh.flush()  # a crash loses at most the line being written
            self.written += 1

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
