"""NVIDIA's aiperf as the load generator of benchmarks/bench_live_vs_peers.py (`--load aiperf`).

A load generator none of the compared routers wrote: aiperf replays the same trace slice as a
Mooncake-format JSONL (`--custom-dataset-type mooncake_trace --fixed-schedule`), synthesizing the
prompt text from the `hash_ids` itself, and its per-request export is folded into the same summary
(traces.live_results.summarize) the project's own client produces, so the table is the same either way.

aiperf lives in its own virtualenv (its dependencies are heavy: transformers, pandas, textual ...):

    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf   # 0.13.0 here

What aiperf is given, and why (verified against aiperf 0.13.0):

* The tokenizer (`--tokenizer conductor-bench/ascii-char`): `tokenizer.json` +
  `tokenizer_config.json` written here (`write_tokenizer`, with the `tokenizers` library), placed as
  an entry of a private Hugging Face hub cache (`cache_tokenizer`), aiperf run with HF_HOME there
  and HF_HUB_OFFLINE=1: loaded by transformers' AutoTokenizer, never a download. (A plain directory
  path fails in aiperf 0.13 once it decodes prompts in worker processes: see `cache_tokenizer`.)
  aiperf builds a hash id's block as `block_size` TOKEN ids sampled from its Shakespeare corpus and
  decodes the prompt to text, so its tokenizer decides how long the text is at the worker. The
  emulated workers count one token per UTF-8 byte (adapters/tokenizers.py, the built-in byte
  tokenizer), so this one has one token per ASCII character (the corpus is ASCII), concatenates on
  decode (no spaces put between tokens, no clean-up of spaces) and has no BOS/EOS: aiperf would
  start every block with one (`block_separation_token_id`), several bytes of text per "token".
* The block size (`--prompt-input-tokens-block-size`): the synthesizer's scaled block (512 tokens
  times `--length-scale`, e.g. 64), with `input_length` / `output_length` scaled as
  traces.synth.PromptSynthesizer scales them, so both load generators send prompts of the same
  lengths with the same block sharing (the text itself differs: Shakespeare here, random printable
  characters in the client).
* The rows' `timestamp` (ms) is the arrival already divided by the speed-up: aiperf's
  `--replay-speedup` only applies to its baseten_trace loader.
* `--endpoint-type completions --streaming` (a bare-string prompt, `max_tokens`, and
  `stream_options.include_usage`), `--extra-inputs` for `ignore_eos` and `temperature` as the client
  sends them, `--use-server-token-count` (output lengths from the usage chunk: the emulator's words
  are not one token each under this tokenizer).

Read back from `profile_export.jsonl` (one record per request, `--export-level records`): TTFT =
`time_to_first_token`; TBT = the mean of `inter_chunk_latency` (the gaps between content chunks,
the client's definition); an `error` with code 429 is a rejection, any other error is an error.
aiperf's own `--goodput` is not used: ours counts a 429 or an error as a miss and divides by the
replayed trace time, as the client path does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.formats import TraceRequest
from traces.live_client import HttpOutcome, cached_counts, prediction_errors
from traces.live_results import LiveOutcome, LiveResult, summarize
from traces.synth import PromptSynthesizer

DEFAULT_AIPERF = "/tmp/aiperf-venv/bin/aiperf"
# one token per character: ASCII covers aiperf's corpus (printable ASCII joined by spaces) and is
# one byte per character, as the emulators' byte tokenizer counts
VOCAB_CHARS = 128
UNK = "<unk>"  # never produced from the corpus; present so unexpected text cannot vanish silently
TOKENIZER_ID = "conductor-bench/ascii-char"  # the name aiperf is given (`cache_tokenizer`)
_SESSION = "line-{}"  # the row's session_id; aiperf reports it back as metadata.conversation_id


def write_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer directory with one token per ASCII character; returns `directory`."""
    from tokenizers import Tokenizer, decoders, models  # a project dependency (adapters/tokenizers.py)

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {chr(i): i for i in range(VOCAB_CHARS)}
    vocab[UNK] = VOCAB_CHARS
    # BPE without merges: every character its own token, whitespace included (no pre-tokenizer)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens([UNK])
    tok.decoder = decoders.Fuse()  # decode concatenates: the default decoder joins with spaces
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # would turn " ." into "." and change the length
        "model_max_length": 1 << 30,
        "unk_token": UNK,  # no bos/eos on purpose: see the module docstring
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return directory


def cache_tokenizer(hf_home: Path, repo_id: str = TOKENIZER_ID) -> str:
    """`write_tokenizer` into a Hugging Face hub cache under `hf_home` as `repo_id`; returns `repo_id`.

    Why not a plain directory: aiperf 0.13 decodes prompts in worker processes (10 or more at once)
    that force HF_HUB_OFFLINE=1, and offline it looks every tokenizer name up as a hub cache entry
    (`snapshot_download(name, local_files_only=True)`), which refuses a filesystem path. A cache
    entry works offline in every aiperf process; run aiperf with HF_HOME=hf_home and offline."""
    model_dir = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    staged = write_tokenizer(hf_home / "staging")
    digest = hashlib.sha1((staged / "tokenizer.json").read_bytes()).hexdigest()  # any 40-hex "commit"
    snapshot = model_dir / "snapshots" / digest
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    if not snapshot.exists():
        staged.rename(snapshot)
    (model_dir / "refs").mkdir(exist_ok=True)
    (model_dir / "refs" / "main").write_text(digest, encoding="utf-8")
    return repo_id


def block_size(requests: Sequence[TraceRequest], synth: PromptSynthesizer) -> int:
    """The one scaled block size of the slice (aiperf takes a single `--prompt-input-tokens-block-size`)."""
    sizes = {synth.block_tokens(r) for r in requests}
    if len(sizes) != 1:
        raise ValueError(f"aiperf needs one block size per run; this slice has {sorted(sizes)}")
    return sizes.pop()


def trace_rows(requests: Sequence[TraceRequest], synth: PromptSynthesizer, speedup: float) -> list[dict[str, Any]]:
    """aiperf mooncake_trace rows for the slice, in arrival order, time-compressed by `speedup`.

    Lengths are the synthesizer's scaled ones. Hash ids past the prompt's length are dropped (aiperf
    rejects a final block of size <= 0). aiperf materializes a hash id at ONE size and refuses it at
    another (the client cuts a shared block wherever a prompt ends), so a hash id that would be a
    partial last block here and a different size elsewhere gets a fresh id for that use (one per
    id and size): only the sharing inside that last partial block is lost. `remapped_hash_ids` on
    the first row counts the fresh ids (none in the bundled conversation trace's first 400 rows)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    size = block_size(ordered, synth) if ordered else 1
    first = ordered[0].arrival_s if ordered else 0.0
    shaped: list[tuple[TraceRequest, int, list[int], int]] = []
    sizes: dict[int, list[int]] = {}  # hash id -> its sizes, first seen first
    for r in ordered:
        length = synth.input_length(r)
        ids = list(r.hash_ids[: math.ceil(length / size)])
        last = min(size, length - (len(ids) - 1) * size) if ids else 0
        for i, h in enumerate(ids):
            sizes.setdefault(h, []).append(size if i < len(ids) - 1 else last)
        shaped.append((r, length, ids, last))
    # a hash id keeps its name at full size if it is ever used whole, else at its first size
    keep = {h: size if size in seen else seen[0] for h, seen in sizes.items()}
    fresh = max(sizes, default=0) + 1
    renamed: dict[tuple[int, int], int] = {}
    rows = []
    for r, length, ids, last in shaped:
        if ids and last != keep[ids[-1]]:
            key = (ids[-1], last)
            if key not in renamed:
                renamed[key], fresh = fresh, fresh + 1
            ids[-1] = renamed[key]
        rows.append(
            {
                "session_id": _SESSION.format(r.line),
                "timestamp": round((r.arrival_s - first) / speedup * 1000, 3),
                "input_length": length,
                "output_length": synth.output_length(r),
                "hash_ids": ids,
            }
        )
    if rows:
        rows[0]["remapped_hash_ids"] = len(renamed)  # bookkeeping: write_trace leaves it out
    return rows


def write_trace(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """The rows as JSONL, without our bookkeeping key."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if k != "remapped_hash_ids"}) + "\n")
    return path


@dataclass(frozen=True, slots=True)
class AiperfRun:
    """Where one aiperf run reads and writes."""

    aiperf: str  # the aiperf executable
    url: str  # the router's base URL (aiperf appends /v1/completions)
    model: str
    trace: Path
    hf_home: Path  # holds the tokenizer as a hub cache entry (`cache_tokenizer`)
    artifacts: Path
    block_size: int
    request_timeout_s: float = 300.0
    seed: int = 0

    def command(self) -> list[str]:
        return [
            self.aiperf,
            "profile",
            "--model",
            self.model,
            "--url",
            self.url,
            "--endpoint-type",
            "completions",
            "--streaming",
            "--input-file",
            str(self.trace),
            "--custom-dataset-type",
            "mooncake_trace",
            "--fixed-schedule",
            "--prompt-input-tokens-block-size",
            str(self.block_size),
            "--tokenizer",
            TOKENIZER_ID,
            "--use-server-token-count",
            "--extra-inputs",
            json.dumps({"ignore_eos": True, "temperature": 0.0}),
            "--request-timeout-seconds",
            repr(self.request_timeout_s),
            "--random-seed",
            str(self.seed),
            "--artifact-dir",
            str(self.artifacts),
            "--export-level",
            "records",
            # on a shared 2-core box: no dashboard, no scraping of the router or of GPUs
            "--ui-type",
            "none",
            "--no-server-metrics",
            "--no-gpu-telemetry",
        ]

    def run(self, timeout_s: float) -> Path:
        """Run aiperf; the path of its per-request export. Raises RuntimeError with its log's tail."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # the tokenizer from our cache entry, and no hub requests from any aiperf process
        env.update(HF_HOME=str(self.hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
        log = self.artifacts.parent / "aiperf.log"
        with log.open("w", encoding="utf-8") as out:
            proc = subprocess.run(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.artifacts.parent,
                timeout=timeout_s,
                check=False,
            )
        export = self.artifacts / "profile_export.jsonl"
        if proc.returncode != 0 or not export.exists():
            tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
            raise RuntimeError(f"aiperf exited with {proc.returncode} (log {log}):\n{tail}")
        return export


_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def _seconds(metrics: Mapping[str, Any], tag: str) -> float | list[float] | None:
    """A time metric of one record in seconds (a list stays a list); None when absent."""
    entry = metrics.get(tag)
    if not isinstance(entry, Mapping) or entry.get("value") is None:
        return None
    factor = _SECONDS[str(entry.get("unit", "ms"))]
    value = entry["value"]
    return [float(v) * factor for v in value] if isinstance(value, list) else float(value) * factor


def _count(metrics: Mapping[str, Any], tag: str) -> int | None:
    entry = metrics.get(tag)
    return int(entry["value"]) if isinstance(entry, Mapping) and entry.get("value") is not None else None


def _rejection_code(message: str) -> str:
    """The OpenAI error body's code (Conductor's reason, e.g. "ttft_slo"), as the client reads it."""
    try:
        body = json.loads(message)
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
    except (ValueError, AttributeError):
        code = None
    return str(code) if code not in (None, "") else "429"


def http_outcome(record: Mapping[str, Any]) -> HttpOutcome:
    """One aiperf record as the client's HttpOutcome."""
    metrics = record.get("metrics") or {}
    meta = record.get("metadata") or {}
    start, end = meta.get("request_start_ns"), meta.get("request_end_ns")
    elapsed = _seconds(metrics, "request_latency")
    if not isinstance(elapsed, float):
        elapsed = (end - start) * 1e-9 if isinstance(start, int) and isinstance(end, int) else 0.0
    error = record.get("error")
    if meta.get("was_cancelled") and not error:
        error = {"type": "cancelled", "message": "cancelled by aiperf"}
    if error:
        code = error.get("code")
        message = str(error.get("message") or "")[:300]
        if code == 429:
            return HttpOutcome("rejected", 429, _rejection_code(message), None, None, 0, None, None, elapsed, message)
        reason = f"http_{code}" if isinstance(code, int) else str(error.get("type") or "error")
        return HttpOutcome("error", code if isinstance(code, int) else None, reason, None, None, 0, None, None, elapsed, message)
    ttft = _seconds(metrics, "time_to_first_token")
    gaps = _seconds(metrics, "inter_chunk_latency")
    gaps = gaps if isinstance(gaps, list) else []
    chunks = len(gaps) + 1 if gaps else (1 if ttft is not None else 0)
    tbt = sum(gaps) / len(gaps) if gaps else None
    return HttpOutcome(
        "ok",
        200,
        None,
        ttft if isinstance(ttft, float) else None,
        tbt,
        chunks,
        _count(metrics, "usage_prompt_tokens"),
        _count(metrics, "usage_prompt_cache_read_tokens"),
        elapsed,
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """The profiling-phase records of a `profile_export.jsonl` (warm-up records left out)."""
    records = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if (record.get("metadata") or {}).get("benchmark_phase", "profiling") == "profiling":
                    records.append(record)
    return records


def outcomes(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]) -> list[LiveOutcome]:
    """LiveOutcomes in row order: records matched to rows by session id (aiperf's conversation_id).

    A row aiperf left without a record counts as an error ("no_record"). Lag is measured against
    aiperf's own schedule: its start is taken as the earliest (credit issued - scheduled time)."""
    by_session = {str((r.get("metadata") or {}).get("conversation_id")): r for r in records}
    starts = []  # integer ns throughout: epoch nanoseconds do not fit a float's 53 bits
    for row in rows:
        meta = (by_session.get(str(row["session_id"])) or {}).get("metadata") or {}
        issued = meta.get("credit_issued_ns") or meta.get("request_start_ns")
        if isinstance(issued, int):
            starts.append(issued - round(row["timestamp"] * 1_000_000))
    zero = min(starts, default=0)
    out = []
    for row in rows:
        record = by_session.get(str(row["session_id"]))
        scheduled = row["timestamp"] / 1000
        if record is None:
            http = HttpOutcome("error", None, "no_record", None, None, 0, None, None, 0.0, "aiperf exported no record")
            lag = 0.0
        else:
            http = http_outcome(record)
            sent = (record.get("metadata") or {}).get("request_start_ns")
            lag = max(0.0, (sent - zero) * 1e-9 - scheduled) if isinstance(sent, int) and starts else 0.0
        line = int(str(row["session_id"]).removeprefix("line-"))
        out.append(LiveOutcome(line, scheduled, lag, int(row["input_length"]), int(row["output_length"]), http))
    return out


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            return str(resp.read().decode()) if resp.status == 200 else None
    except (OSError, UnicodeDecodeError):
        return None


def replay_aiperf(
    url: str,
    requests: Sequence[TraceRequest],
    *,
    time_scale: float,
    synthesizer: PromptSynthesizer,
    model: str,
    slo_ttft_s: float | None,
    slo_tbt_s: float | None,
    work_dir: Path,
    aiperf: str = DEFAULT_AIPERF,
    label: str = "aiperf",
    request_timeout_s: float = 300.0,
) -> LiveResult:
    """traces.live.replay_live's counterpart with aiperf sending: the same LiveResult."""
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = trace_rows(requests, synthesizer, time_scale)
    cache_tokenizer(work_dir / "hf")
    run = AiperfRun(
        aiperf,
        url,
        model,
        write_trace(work_dir / "trace.jsonl", rows),
        work_dir / "hf",
        work_dir / "artifacts",
        block_size(requests, synthesizer),
        request_timeout_s,
    )
    base = url.rstrip("/")
    ready = json.loads(_get(f"{base}/ready") or "null")
    healthy = ready.get("healthy", {}) if isinstance(ready, dict) else {}
    before = cached_counts(_get(f"{base}/metrics"))
    # the schedule, then the slowest request, plus aiperf's own start-up (~15 s) and shutdown
    span = (rows[-1]["timestamp"] / 1000 if rows else 0.0) + request_timeout_s + 180.0
    records = read_records(run.run(span))
    metrics_after = _get(f"{base}/metrics")
    after = cached_counts(metrics_after)
    delta = (after[0] - before[0], after[1] - before[1]) if before is not None and after is not None else None
    done = outcomes(rows, records)
    wall = max((o.scheduled_s + o.lag_s + o.http.elapsed_s for o in done), default=0.0)
    return summarize(
        done,
        label=label,
        n_prefill=int(healthy.get("prefill", 0) or healthy.get("mixed", 0)),
        n_decode=int(healthy.get("decode", 0)),
        slo_ttft_s=slo_ttft_s,
        slo_tbt_s=slo_tbt_s,
        wall_s=wall,
        gateway_cached=delta if delta and sum(delta) > 0 else None,
        predictions=prediction_errors(metrics_after),
        # `kv_index` lands in `extra`: say how many blocks lost their sharing (trace_rows)
        kv_index={"aiperf_remapped_hash_ids": float(rows[0]["remapped_hash_ids"] if rows else 0)},
    )
