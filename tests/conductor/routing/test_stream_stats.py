"""StreamStats: what the relay learns from an SSE stream, read chunk by chunk on a clock the test
gives. A chunk that holds several token events spreads its gap over them; events that arrive in
the first chunk together have no gap the gateway could measure, so none is invented."""

from __future__ import annotations

import pytest

from conductor.routing.streams import StreamStats


def event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"' + text.encode() + b'"}]}\n\n'


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_one_event_per_chunk_gives_one_interval_per_gap() -> None:
    stats = StreamStats()
    stats.first_token = 1.0
    stats.last = 1.0
    stats.tokens = 1
    assert stats.see(event("b"), 1.02) == 1
    assert stats.see(event("c"), 1.05) == 1
    assert stats.intervals == pytest.approx([0.02, 0.03])
    assert stats.tokens == 3


def test_coalesced_events_share_the_gap() -> None:
    stats = StreamStats()
    stats.first_token = 2.0
    stats.last = 2.0
    assert stats.see(event("b") + event("c") + event("d") + event("e"), 2.08) == 4
    assert stats.intervals == pytest.approx([0.02])  # one sample: the mean gap over the four


def test_usage_and_done_are_not_tokens() -> None:
    stats = StreamStats()
    stats.first_token = 0.0
    assert stats.see(event("x") + USAGE + DONE, 0.5) == 1
    assert stats.done
    assert (stats.usage_prompt_tokens, stats.usage_completion_tokens, stats.usage_cached_tokens) == (7, 3, 4)
    assert stats.see(b": keep-alive\n\n", 0.6) == 0


def test_first_chunk_gives_no_interval() -> None:
    """A stream whose events all came in its first read has no measured spacing: an empty list,
    not zeros that would drag the TBT fit down."""
    stats = StreamStats()
    assert stats.see(event("a") + event("b") + event("c"), 3.0) == 3
    assert stats.intervals == []
