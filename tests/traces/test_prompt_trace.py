"""traces/prompt_trace.py and the trace format's class and tenant fields (issue 37)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.tenants_load import Request
from traces.formats import load_trace
from traces.prompt_trace import prompt_trace


def test_block_ids_are_shared_exactly_as_far_as_prompts_share_a_prefix() -> None:
    system = "S" * 40  # two and a half 16-token blocks
    reqs = [
        Request(0.0, "A", "interactive", system + "x" * 20, 7),
        Request(0.5, "A", "batch", system + "y" * 20, 9),
        Request(1.0, "B", "batch", "T" * 40 + "x" * 20, 9),
    ]
    a1, a2, b = prompt_trace(reqs)
    assert (a1.input_length, a1.output_length, a1.block_tokens, a1.arrival_s) == (60, 7, 16, 0.0)
    assert len(a1.hash_ids) == 3  # 60 // 16 full blocks; the rest is not a block
    assert a1.hash_ids[:2] == a2.hash_ids[:2] and a1.hash_ids[2] != a2.hash_ids[2]  # the third mixes S and x / y
    assert not set(b.hash_ids) & set(a1.hash_ids)
    assert [(r.priority, r.tenant) for r in (a1, a2, b)] == [("interactive", "A"), ("batch", "A"), ("batch", "B")]
    assert prompt_trace(reqs) == (a1, a2, b)  # the same ids every time (no salted hashing)


def test_a_mooncake_line_may_name_its_class_and_tenant(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1], "priority": "batch", "tenant": "A"},
        {"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1]},
        {"timestamp": 9, "input_length": 10, "output_length": 2, "hash_ids": [1], "priority": 3},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    result = load_trace(path)
    assert [(r.priority, r.tenant) for r in result.requests] == [("batch", "A"), (None, None)]
    assert len(result.errors) == 1 and "priority must be a non-empty string" in result.errors[0]
