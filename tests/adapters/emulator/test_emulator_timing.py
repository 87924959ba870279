"""Timing from the profile at time scale 1, queueing, and client disconnects (abort + record).

The timing checks read the times the emulator *modelled* (GET /emulator/requests, `modelled`), which
a busy machine cannot stretch; how close wall-clock time comes to them is a benchmark
(benchmarks/bench_emulator_timing.py), not a test.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adapters.emulator.profile import load_profile
from tests.support.emulator import Emulator, modelled, start_emulator
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def real_time() -> Iterator[Emulator]:
    with start_emulator("mixed", time_scale=1.0, noise=0.0) as emu:
        yield emu


def distinct_prompt(k: int, n: int) -> list[int]:
    return [(k * 101 + i * 7 + i // 250) % 250 for i in range(n)]


def prefill(client: httpx.Client, emu: Emulator, tokens: list[int], request_id: str) -> dict[str, Any]:
    """One uncached prefill; the times the emulator modelled for it."""
    r = client.post(emu.url + "/v1/completions", json={"prompt": tokens, "max_tokens": 1}, headers={"X-Request-ID": request_id})
    r.raise_for_status()
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return modelled(emu, request_id)


def test_8k_prefill_takes_the_profile_time(real_time: Emulator) -> None:
    expected = load_profile().prefill_s(8192)
    assert expected == pytest.approx(0.212, abs=0.002)  # the published TTFT at 8,192 tokens
    with httpx.Client(timeout=30) as client:
        for k in range(2):
            times = prefill(client, real_time, distinct_prompt(k, 8192), f"8k-{k}")
            # exact: time scale 1 and no noise model the profile's own figure; a loaded CPU
            # stretches the wall clock, not this
            assert times["prefill_s"] == pytest.approx(expected, rel=1e-9)
            assert times["queue_s"] == 0.0 and times["ttft_s"] == times["prefill_s"]
            assert (times["prompt_tokens"], times["cached_tokens"]) == (8192, 0)


def test_prefills_queue_fcfs(real_time: Emulator) -> None:
    single = load_profile().prefill_s(4096)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:

        def one(k: int) -> dict[str, Any]:
            with httpx.Client(timeout=30) as c:
                return prefill(c, real_time, distinct_prompt(100 + k, 4096), f"fcfs-{k}")

        runs = sorted(pool.map(one, range(3)), key=lambda t: t["arrival_index"])
    # one prefill per engine step, in arrival order, each taking the profile's time
    steps = [t["prefill_step"] for t in runs]
    assert steps == sorted(steps) and len(set(steps)) == 3
    for t in runs:
        assert t["prefill_s"] == pytest.approx(single, rel=1e-9)
        assert t["ttft_s"] == pytest.approx(t["queue_s"] + t["prefill_s"])
    # a request waits for at most the prefills ahead of it (how many were still ahead depends on
    # when each arrived, which the test does not control)
    for ahead, t in enumerate(runs):
        assert 0.0 <= t["queue_s"] <= ahead * single * (1 + 1e-9)


def _cancelled(emu: Emulator) -> list[str]:
    return list(httpx.get(emu.url + "/emulator/cancelled").json()["request_ids"])


def test_stream_disconnect_aborts_and_is_recorded(real_time: Emulator) -> None:
    body = {"prompt": "disconnect me", "max_tokens": 2000, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", real_time.url + "/v1/completions", json=body, headers={"X-Request-ID": "gone-1"}) as resp,
    ):
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        state = httpx.get(real_time.url + "/emulator/state").json()
        assert state["running"] == 1
    # leaving the block closed the connection mid-stream
    assert wait_for(lambda: "gone-1" in _cancelled(real_time))
    assert wait_for(lambda: httpx.get(real_time.url + "/emulator/state").json()["running"] == 0)


def test_non_streamed_disconnect_is_recorded(real_time: Emulator) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            real_time.url + "/v1/completions",
            json={"prompt": "slow", "max_tokens": 2000},
            headers={"X-Request-ID": "gone-2"},
            timeout=0.3,
        )
    assert wait_for(lambda: "gone-2" in _cancelled(real_time))
    assert wait_for(lambda: httpx.get(real_time.url + "/emulator/state").json()["running"] == 0)
