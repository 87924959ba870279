"""The tool-agent workload: block ids that mean what Mooncake's mean, the structure the docstring
promises (shared system prompts, growing sessions, bursts), and a bundled file that is exactly what
the generator writes."""

from __future__ import annotations

import gzip
import io
from collections import defaultdict
from pathlib import Path

from traces.agent_trace import AgentRecord, AgentWorkload, BlockIds, generate, mooncake_lines, write
from traces.formats import bundled_trace, load_trace

SMALL = AgentWorkload(sessions=60, duration_s=120.0)


def test_a_block_id_names_content_and_a_partial_block_changes_when_the_prompt_grows() -> None:
    ids = BlockIds(block_tokens=4)
    a = ids.of([(1, 6)])  # one full block of segment 1, then 2 of its tokens
    b = ids.of([(1, 6), (2, 3)])  # the same prompt grown: its partial block now holds more
    assert len(a) == 2 and len(b) == 3
    assert a[0] == b[0]  # the full block is the same content
    assert a[1] != b[1]  # the partial one is not
    c = ids.of([(1, 4), (3, 4)])
    assert c[0] == a[0] and c[1] not in (a[1], b[1], b[2])
    assert ids.of([(1, 6), (2, 3)]) == b  # asked again, the same ids


def by_session(records: list[AgentRecord]) -> dict[int, list[AgentRecord]]:
    sessions: dict[int, list[AgentRecord]] = defaultdict(list)
    for r in records:
        sessions[r.session].append(r)
    return sessions


def test_each_step_holds_every_full_block_of_the_step_before() -> None:
    grew = 0
    for records in by_session(generate(SMALL)).values():
        steps: dict[int, list[AgentRecord]] = defaultdict(list)
        for r in records:
            steps[r.step].append(r)
        for k in range(1, len(steps)):
            before, after = steps[k - 1], steps[k][0]
            # a burst's calls share the session's prompt and add their own suffix, which the next
            # step does not carry: what must be kept is the full blocks all of them share
            full = min(r.input_length for r in before) // 512 if len(before) == 1 else common_blocks(before) - 1
            assert full > 0 and after.hash_ids[:full] == before[0].hash_ids[:full]
            assert len(after.hash_ids) == -(-after.input_length // 512) and after.input_length > before[0].input_length
            grew += 1
    assert grew > 100


def common_blocks(calls: list[AgentRecord]) -> int:
    n = 0
    while all(len(c.hash_ids) > n and c.hash_ids[n] == calls[0].hash_ids[n] for c in calls):
        n += 1
    return n


def test_sessions_of_one_application_share_its_system_prompt_blocks() -> None:
    records = generate(SMALL)
    openers = [steps[0] for steps in by_session(records).values()]
    shared: dict[tuple[int, ...], int] = defaultdict(int)
    for r in openers:
        shared[r.hash_ids[:6]] += 1  # 3,000+ system tokens: at least 5 full blocks are the app's
    popular = max(shared.values())
    assert popular >= 10 and len(shared) <= SMALL.apps


def test_bursts_share_the_prompt_and_arrive_together() -> None:
    bursts: dict[tuple[int, int], list[AgentRecord]] = defaultdict(list)
    for r in generate(SMALL):
        bursts[r.session, r.step].append(r)
    fanned = [calls for calls in bursts.values() if len(calls) > 1]
    assert fanned and all(2 <= len(calls) <= 4 for calls in fanned)
    for calls in fanned:
        assert max(c.timestamp_ms for c in calls) - min(c.timestamp_ms for c in calls) <= 200
        assert len({c.hash_ids for c in calls}) == len(calls)  # each has its own suffix
        assert common_blocks(calls) >= 5  # and they share the system prompt and session so far


def test_arrivals_are_ordered_and_the_trace_reader_takes_every_line(tmp_path: Path) -> None:
    records = generate(SMALL)
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(mooncake_lines(records)))
    loaded = load_trace(path)
    assert not loaded.errors and len(loaded.requests) == len(records)
    assert [r.hash_ids for r in loaded.requests] == [r.hash_ids for r in records]


def test_the_bundled_file_is_what_the_generator_writes(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl.gz"
    write(out, generate())
    assert out.read_bytes() == bundled_trace("tool-agent").read_bytes()
    with gzip.open(io.BytesIO(out.read_bytes()), "rt") as f:
        assert sum(1 for _ in f) == len(load_trace(bundled_trace("tool-agent")).requests)
