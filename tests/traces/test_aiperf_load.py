"""benchmarks/aiperf_load.py without aiperf installed: the tokenizer it hands aiperf counts as the
emulators do, the mooncake_trace rows it writes have aiperf's fields and the compressed schedule,
and aiperf's per-request records (the shape of aiperf 0.13's profile_export.jsonl) become the same
summary as the project's client."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks.aiperf_load import TOKENIZER_ID, cache_tokenizer, outcomes, trace_rows, write_tokenizer, write_trace
from conductor.core.tokenization import ByteTokenizer
from traces.formats import TraceRequest
from traces.live import text_prompt
from traces.live_results import summarize
from traces.synth import PromptSynthesizer

# fields aiperf's MooncakeTrace model reads for a synthesized prompt (timestamp in ms)
MOONCAKE_FIELDS = {"session_id", "timestamp", "input_length", "output_length", "hash_ids"}


def _req(line: int, arrival_s: float, input_length: int, ids: tuple[int, ...], output_length: int = 40) -> TraceRequest:
    return TraceRequest(arrival_s, input_length, output_length, ids, line)


def test_the_tokenizer_counts_one_token_per_byte_and_decodes_back(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(write_tokenizer(tmp_path / "tok") / "tokenizer.json"))
    synth = PromptSynthesizer(0.125, seed=0)
    texts = [
        text_prompt(synth.prompt(_req(1, 0.0, 3000, (0, 1, 2, 3, 4, 5)))),  # what the client sends
        "From fairest creatures we desire increase,  That thereby beauty's rose might never die. ",  # aiperf's corpus
    ]
    for text in texts:
        ids = tok.encode(text).ids
        assert len(ids) == len(ByteTokenizer().encode(text)) == len(text)
        assert tok.decode(ids) == text  # concatenated: no spaces added, none cleaned up
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["clean_up_tokenization_spaces"] is False
    assert not {"bos_token", "eos_token"} & config.keys()  # aiperf would open every block with one


def test_the_tokenizer_is_a_hub_cache_entry(tmp_path: Path) -> None:
    assert cache_tokenizer(tmp_path) == TOKENIZER_ID
    model = tmp_path / "hub" / ("models--" + TOKENIZER_ID.replace("/", "--"))
    snapshot = model / "snapshots" / (model / "refs" / "main").read_text()
    assert {p.name for p in snapshot.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}


def test_rows_are_mooncake_trace_rows_on_the_compressed_schedule(tmp_path: Path) -> None:
    synth = PromptSynthesizer(0.125, seed=0)  # 512-token blocks become 64
    requests = [
        _req(3, 12.5, 1100, (0, 1, 2)),
        _req(1, 10.0, 1500, (0, 1, 2)),  # rows come out in arrival order
        _req(2, 11.0, 400, (0, 7, 8)),  # 50 scaled tokens: one block, the later ids dropped
    ]
    rows = trace_rows(requests, synth, speedup=4.0)
    assert [r["session_id"] for r in rows] == ["line-1", "line-2", "line-3"]
    assert [r["timestamp"] for r in rows] == [0.0, 250.0, 625.0]  # ms after the first, divided by 4
    assert [r["input_length"] for r in rows] == [synth.input_length(r) for r in sorted(requests, key=lambda r: r.line)]
    assert [r["input_length"] for r in rows] == [188, 50, 138]
    assert [r["output_length"] for r in rows] == [5, 5, 5]
    # aiperf takes a hash id at one size only: id 0 is whole elsewhere but 50 tokens in line 2, id 2
    # ends line 1 at 60 tokens and line 3 at 10; the odd uses get fresh ids
    assert [r["hash_ids"] for r in rows] == [[0, 1, 2], [3], [0, 1, 4]]
    assert rows[0]["remapped_hash_ids"] == 2
    for r in rows:  # aiperf's layout rule: the last block holds 1..block_size tokens
        assert 0 < r["input_length"] - (len(r["hash_ids"]) - 1) * 64 <= 64
    written = [json.loads(line) for line in write_trace(tmp_path / "t.jsonl", rows).read_text().splitlines()]
    assert all(set(w) == MOONCAKE_FIELDS for w in written)


def test_a_block_used_at_two_sizes_is_renamed_where_it_is_partial() -> None:
    # aiperf materializes a hash id at one size only; the client cuts block 1 short in line 2
    rows = trace_rows([_req(1, 0.0, 1024, (0, 1)), _req(2, 1.0, 600, (0, 1))], PromptSynthesizer(0.125), 1.0)
    assert rows[0]["hash_ids"] == [0, 1] and rows[1]["hash_ids"] == [0, 2]
    assert rows[0]["remapped_hash_ids"] == 1


def _record(session: str, issued_ns: int, **error: object) -> dict[str, object]:
    """An aiperf 0.13 profile_export.jsonl record, cut to the fields read."""
    meta = {
        "conversation_id": session,
        "benchmark_phase": "profiling",
        "credit_issued_ns": issued_ns,
        "request_start_ns": issued_ns + 1_000_000,
        "request_end_ns": issued_ns + 900_000_000,
        "was_cancelled": False,
    }
    if error:
        return {"metadata": meta, "metrics": {}, "error": error}
    metrics = {
        "time_to_first_token": {"value": 400.0, "unit": "ms"},
        "inter_chunk_latency": {"value": [50.0, 70.0, 60.0], "unit": "ms"},
        "request_latency": {"value": 590.0, "unit": "ms"},
        "usage_prompt_tokens": {"value": 188, "unit": "tokens"},
        "usage_prompt_cache_read_tokens": {"value": 64, "unit": "tokens"},
    }
    return {"metadata": meta, "metrics": metrics, "error": None}


def test_records_become_the_clients_summary() -> None:
    rows = trace_rows([_req(i, i * 1.0, 1100, (0, i)) for i in range(1, 5)], PromptSynthesizer(0.125), 2.0)
    t0 = 10**18
    records = [
        _record("line-1", t0),
        _record("line-2", t0 + 500_000_000),
        _record(
            "line-3",
            t0 + 1_000_000_000,
            code=429,
            type="Too Many Requests",
            message=json.dumps({"error": {"code": "ttft_slo", "message": "over"}}),
        ),
        # line-4 has no record: an error, not a silent drop
    ]
    done = outcomes(rows, records)
    assert [o.line for o in done] == [1, 2, 3, 4]
    assert done[0].http.ttft_s == 0.4 and abs((done[0].http.tbt_s or 0) - 0.06) < 1e-12 and done[0].http.chunks == 4
    assert done[0].http.cached_tokens == 64 and done[0].prompt_tokens == 138
    assert done[2].http.status == "rejected" and done[2].http.reason == "ttft_slo"
    assert done[3].http.status == "error" and done[3].http.reason == "no_record"
    assert abs(done[1].lag_s - 0.001) < 1e-9  # sent 1 ms after its credit was issued on schedule
    run = summarize(done, label="x", n_prefill=1, n_decode=0, slo_ttft_s=1.0, slo_tbt_s=0.065, wall_s=2.0).run
    assert (run.slo_met, run.rejected, run.extra["errors"]) == (2, 1, 1.0)
    assert run.goodput_rps == 2 / 1.5  # over the replayed trace time: 3 s of arrivals at 2x
