"""Trace loading: both formats, gzip, malformed lines, the recorder round trip."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from traces.formats import (
    MOONCAKE_BLOCK_TOKENS,
    RecordedOutcome,
    TraceRecorder,
    TraceRequest,
    bundled_trace,
    load_recorded,
    load_trace,
    resolve_trace,
    reusable_prefix_share,
)


def test_bundled_conversation_loads_whole() -> None:
    result = load_trace(bundled_trace("conversation"))
    assert len(result.requests) == 12031
    assert result.errors == ()
    first, last = result.requests[0], result.requests[-1]
    assert first.line == 1 and first.arrival_s == 0.0 and first.input_length == 6758
    assert first.hash_ids[:3] == (0, 1, 2) and first.block_tokens == MOONCAKE_BLOCK_TOKENS
    assert last.arrival_s == pytest.approx(3536.999)  # Mooncake timestamps are milliseconds


def test_bundled_names_and_limit() -> None:
    assert len(load_trace(bundled_trace("synthetic")).requests) == 3993
    assert len(load_trace(resolve_trace("conversation-head400"), limit=7).requests) == 7
    with pytest.raises(ValueError, match="unknown bundled trace"):
        bundled_trace("nope")


def test_malformed_lines_reported_and_skipped(tmp_path: Path) -> None:
    lines = [
        '{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
        "not json",
        '{"timestamp": 2000, "input_length": -3, "output_length": 5, "hash_ids": []}',
        "",
        '{"timestamp": 3000, "input_length": 10, "output_length": 5, "hash_ids": ["x"]}',
        "[1, 2]",
        '{"input_length": 10, "output_length": 1}',
        '{"arrival_s": 4.5, "input_length": 32, "output_length": 2, "block_size": 16, "block_keys": [7, 8]}',
    ]
    path = tmp_path / "t.jsonl.gz"  # gzip detected by content
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines) + "\n")
    result = load_trace(path)
    assert [r.line for r in result.requests] == [1, 8]
    assert result.requests[0].arrival_s == 1.0
    assert result.requests[1].hash_ids == (7, 8) and result.requests[1].block_tokens == 16
    assert [e.split(":")[0] for e in result.errors] == ["line 2", "line 3", "line 5", "line 6", "line 7"]
    assert "input_length" in result.errors[1]


def test_truncated_gzip_keeps_what_was_read(tmp_path: Path) -> None:
    body = "".join(
        json.dumps({"timestamp": i, "input_length": 5, "output_length": 1, "hash_ids": [i]}) + "\n" for i in range(2000)
    )
    data = gzip.compress(body.encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    result = load_trace(path)
    assert 0 < len(result.requests) < 2000
    assert result.errors and "unreadable" in result.errors[-1]


def test_recorder_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    with TraceRecorder(path, start_s=100.0) as rec:
        rec.record(
            arrival_s=100.5,
            input_length=40,
            output_length=3,
            block_keys=[11, 12],
            block_size=16,
            outcome=RecordedOutcome("ok", ttft_s=0.2, tbt_s=0.03),
        )
        rec.record(
            arrival_s=101.0,
            input_length=9,
            output_length=0,
            block_keys=(),
            block_size=16,
            outcome=RecordedOutcome("rejected", rejected_reason="ttft_slo"),
        )
    text = path.read_text()
    assert "prompt" not in text and "messages" not in text
    recs, errors = load_recorded(path)
    assert errors == ()
    assert [r.request.arrival_s for r in recs] == [0.5, 1.0]
    assert recs[0].request.hash_ids == (11, 12) and recs[0].outcome.ttft_s == 0.2
    assert recs[1].outcome.status == "rejected" and recs[1].outcome.rejected_reason == "ttft_slo"
    with pytest.raises(ValueError, match="closed"):
        rec.record(arrival_s=1, input_length=1, output_length=1, block_keys=(), block_size=16, outcome=RecordedOutcome("ok"))


def test_reusable_prefix_share_counts_prefixes_seen_earlier_only() -> None:
    def r(t: float, n: int, ids: tuple[int, ...]) -> TraceRequest:
        return TraceRequest(arrival_s=t, input_length=n, output_length=1, hash_ids=ids, line=1)

    trace = [
        r(2.0, 1500, (1, 2, 9)),  # blocks 1, 2 seen before (by arrival), then a miss: 1024 reused
        r(0.0, 1024, (1, 2)),  # first: nothing reused
        r(3.0, 1200, (7, 1, 2)),  # block 7 is new, so its prefix is: 0 reused (1, 2 are not a prefix)
        r(4.0, 300, (1,)),  # a prompt shorter than its one block: its 300 tokens
    ]
    assert reusable_prefix_share(trace) == pytest.approx((1024 + 300) / (1024 + 1500 + 1200 + 300))
    assert reusable_prefix_share([]) == 0.0
