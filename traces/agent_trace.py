"""A tool-agent workload in Mooncake's trace format, generated from a seed.

Mooncake's two released traces are a chat conversation log and a synthetic document mix. Agent
traffic looks different, and it is where a KV-aware scheduler should earn its keep:

* **long shared system prompts**: a few applications, each with a system prompt and tool schemas of
  3K-12K tokens, chosen with a Zipf popularity (a handful of them carry most sessions);
* **multi-turn reuse**: a session is a loop of steps; each step's prompt is the previous prompt plus
  the model's tool call and the tool's result, so step k+1 shares all of step k's full blocks;
* **tool-call bursts**: some steps fan out into 2-4 parallel calls (sub-agents or parallel tools)
  that share the session's whole prompt and differ only in a short suffix, arriving together.

Each line also carries its `session_id` (not a Mooncake field; readers that do not know it skip it):
the simulator passes it to the policy as the request's session and the live replay sends it as the
session header, unless told not to (`--no-session-tags`), to measure what session affinity buys.

Block ids follow the release's rule: one id per 512-token block, equal ids for equal block content.
A block's content is named by the segments it covers (a system prompt is one segment shared by its
application's sessions; everything else belongs to one session), so a block that is still partial
gets a new id once the prompt grows past it, exactly as hashing the real tokens would.

    python -m traces.agent_trace --out traces/data/tool_agent_trace.jsonl.gz

writes the bundled file (`--trace tool-agent`); the same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.formats import MOONCAKE_BLOCK_TOKENS

Segment = tuple[int, int]  # (content id, tokens): a run of tokens whose content is named by the id


@dataclass(frozen=True)
class AgentWorkload:
    """What the generated trace looks like; the defaults write the bundled file."""

    seed: int = 20261201
    duration_s: float = 1800.0  # session starts are spread over this much time (Poisson)
    sessions: int = 700
    apps: int = 12  # distinct system prompts
    app_zipf: float = 1.1  # popularity exponent of the apps
    system_tokens: tuple[int, int] = (3000, 12000)  # uniform range of a system prompt's length
    task_tokens: tuple[int, int] = (150, 1500)  # the user's request that opens a session
    mean_steps: float = 6.0  # tool-loop steps per session (geometric, at least 1)
    max_steps: int = 24
    call_tokens_median: float = 120.0  # a tool call the model writes (lognormal)
    answer_tokens: tuple[int, int] = (200, 1000)  # the final answer (uniform)
    result_tokens_median: float = 700.0  # a tool's result appended to the prompt (lognormal)
    tool_latency_mean_s: float = 2.5  # a tool runs this long on average (exponential)
    decode_s_per_token: float = 0.03  # the caller waits for the model's output before the tool runs
    fanout_probability: float = 0.2  # a step fans out into parallel calls...
    fanout: tuple[int, int] = (2, 4)  # ...this many of them
    fanout_suffix_tokens: tuple[int, int] = (40, 250)  # each parallel call's own instruction
    max_prompt_tokens: int = 120_000  # a session stops growing here (a model's context)


@dataclass(frozen=True)
class AgentRecord:
    """One request: Mooncake fields plus the session it belongs to (not written to the file)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int
    step: int  # position in the session's tool loop
    branch: int  # which of a burst's parallel calls (0 when the step made one call)


class BlockIds:
    """Ids for 512-token blocks by content: the tuple of (segment, start, end) runs a block covers."""

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[tuple[int, int, int], ...], int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def of(self, segments: list[Segment]) -> tuple[int, ...]:
        ids: list[int] = []
        runs: list[tuple[int, int, int]] = []
        filled = 0
        for content, length in segments:
            pos = 0
            while pos < length:
                take = min(length - pos, self.block_tokens - filled)
                runs.append((content, pos, pos + take))
                pos += take
                filled += take
                if filled == self.block_tokens:
                    ids.append(self._id(tuple(runs)))
                    runs, filled = [], 0
        if runs:
            ids.append(self._id(tuple(runs)))
        return tuple(ids)

    def _id(self, key: tuple[tuple[int, int, int], ...]) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(float(rng.lognormal(math.log(median), sigma))))))


def generate(workload: AgentWorkload = AgentWorkload()) -> list[AgentRecord]:
    """The workload's requests in arrival order (ties broken by session, then step)."""
    w = workload
    rng = np.random.default_rng(w.seed)
    weights = 1.0 / np.arange(1, w.apps + 1) ** w.app_zipf
    weights /= weights.sum()
    system = [int(rng.integers(w.system_tokens[0], w.system_tokens[1] + 1)) for _ in range(w.apps)]
    starts = np.sort(rng.uniform(0.0, w.duration_s, w.sessions))
    blocks = BlockIds()
    next_content = w.apps  # content ids 0..apps-1 are the system prompts
    records: list[AgentRecord] = []

    def fresh(tokens: int) -> Segment:
        nonlocal next_content
        next_content += 1
        return (next_content, tokens)

    for session, start in enumerate(starts):
        app = int(rng.choice(w.apps, p=weights))
        prompt: list[Segment] = [(app, system[app]), fresh(int(rng.integers(*w.task_tokens)))]
        steps = min(w.max_steps, int(rng.geometric(1.0 / w.mean_steps)))
        t = float(start)
        for step in range(steps):
            last = step == steps - 1
            out = int(rng.integers(*w.answer_tokens)) if last else _lognormal_int(rng, w.call_tokens_median, 0.6, 16, 1500)
            length = sum(n for _, n in prompt)
            if length + out > w.max_prompt_tokens:
                break
            calls = (
                [prompt]
                if last or rng.random() >= w.fanout_probability
                else [
                    [*prompt, fresh(int(rng.integers(*w.fanout_suffix_tokens)))]
                    for _ in range(int(rng.integers(w.fanout[0], w.fanout[1] + 1)))
                ]
            )
            for i, call in enumerate(calls):
                at = t + (0.0 if i == 0 else float(rng.uniform(0.0, 0.2)))
                records.append(AgentRecord(int(at * 1000), sum(n for _, n in call), out, blocks.of(call), session, step, i))
            # the next step sees the model's call(s) and the tool's result appended
            prompt = [*prompt, fresh(out * len(calls)), fresh(_lognormal_int(rng, w.result_tokens_median, 1.0, 20, 8000))]
            t += out * w.decode_s_per_token + float(rng.exponential(w.tool_latency_mean_s))
    records.sort(key=lambda r: r.timestamp_ms)  # stable: a session's steps keep their order
    return records


def mooncake_lines(records: list[AgentRecord]) -> Iterator[str]:
    for r in records:
        yield (
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                    "session_id": r.session,  # an extra field: Mooncake's readers take what they know
                }
            )
            + "\n"
        )


def write(path: Path, records: list[AgentRecord]) -> None:
    """Gzip with a fixed mtime, so one seed always gives the same bytes."""
    with path.open("wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        for line in mooncake_lines(records):
            gz.write(line.encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=AgentWorkload.seed)
    parser.add_argument("--sessions", type=int, default=AgentWorkload.sessions)
    args = parser.parse_args(argv)
    records = generate(AgentWorkload(seed=args.seed, sessions=args.sessions))
    write(args.out, records)
    sessions = len({r.session for r in records})
    print(f"{len(records)} requests from {sessions} sessions over {records[-1].timestamp_ms / 1000:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
