"""Timing from the profile at time scale 1, queueing, and client disconnects (abort + record)."""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from adapters.emulator.profile import load_profile
from tests.support.emulator import Emulator, start_emulator


@pytest.fixture(scope="module")
def real_time() -> Iterator[Emulator]:
    with start_emulator("mixed", time_scale=1.0, noise=0.0) as emu:
        yield emu


def distinct_prompt(k: int, n: int) -> list[int]:
    return [(k * 101 + i * 7 + i // 250) % 250 for i in range(n)]


def timed_prefill(client: httpx.Client, emu: Emulator, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    r = client.post(emu.url + "/v1/completions", json={"prompt": tokens, "max_tokens": 1})
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return elapsed


def test_8k_prefill_takes_the_profile_time(real_time: Emulator) -> None:
    expected = load_profile().prefill_s(8192)
    assert expected == pytest.approx(0.212, abs=0.002)  # the published TTFT at 8,192 tokens
    with httpx.Client(timeout=30) as client:
        client.get(real_time.url + "/health")  # warm connection
        runs = [timed_prefill(client, real_time, distinct_prompt(k, 8192)) for k in range(3)]
    assert statistics.median(runs) == pytest.approx(expected, rel=0.05), runs


def test_prefills_queue_fcfs(real_time: Emulator) -> None:
    single = load_profile().prefill_s(4096)
    with concurrent.futures.ThreadPoolExecutor(3) as pool, httpx.Client(timeout=30) as warm:
        warm.get(real_time.url + "/health")

        def one(k: int) -> float:
            with httpx.Client(timeout=30) as c:
                return timed_prefill(c, real_time, distinct_prompt(100 + k, 4096))

        times = sorted(pool.map(one, range(3)))
    # One prefill at a time: the third waits for two others (generous bounds for a noisy box).
    assert times[0] >= single * 0.95
    assert times[2] >= single * 2.5, times


def _cancelled(emu: Emulator) -> list[str]:
    return list(httpx.get(emu.url + "/emulator/cancelled").json()["request_ids"])


def _wait_for(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_stream_disconnect_aborts_and_is_recorded(real_time: Emulator) -> None:
    body = {"prompt": "disconnect me", "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", real_time.url + "/v1/completions", json=body,
                          headers={"X-Request-ID": "gone-1"}) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        state = httpx.get(real_time.url + "/emulator/state").json()
        assert state["running"] == 1
    # leaving the block closed the connection mid-stream
    assert _wait_for(lambda: "gone-1" in _cancelled(real_time))
    assert _wait_for(lambda: httpx.get(real_time.url + "/emulator/state").json()["running"] == 0)


def test_non_streamed_disconnect_is_recorded(real_time: Emulator) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real_time.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 2000},
                   headers={"X-Request-ID": "gone-2"}, timeout=0.3)
    assert _wait_for(lambda: "gone-2" in _cancelled(real_time))
    assert _wait_for(lambda: httpx.get(real_time.url + "/emulator/state").json()["running"] == 0)
