"""Wall-clock fidelity of the emulator's timing, straight and through the gateway.

    python benchmarks/bench_emulator_timing.py [--runs 5] [--tolerance 0.05]

The tests check the times the emulator *models* (exact, whatever the machine's load). This measures
how close the wall clock comes to them: an 8K-token prefill at time scale 1 should take the profile's
212 ms (published mean TTFT at 8,192 tokens), sent to the emulator directly and streamed through an
in-process gateway. It prints the median of `--runs` fresh prompts against the modelled figure and
exits 1 when a median is off by more than `--tolerance` (5%: what an idle machine achieves). On a
loaded machine expect it to fail: that is what this is here to show, and why no test asserts it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.emulator.profile import load_profile
from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from conductor.server.app import create_app
from tests.support.emulator import start_emulator
from tests.support.servers import serve

TOKENS = 8192


def _prompt(k: int) -> list[int]:
    # a new prompt for each k < 250 (31 is prime to 250): nothing cached
    return [(k * 31 + j) % 250 + 1 for j in range(TOKENS)]


def _first_byte_s(client: httpx.Client, url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    with client.stream(
        "POST", url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True}
    ) as r:
        r.raise_for_status()
        chunks = r.iter_raw()
        next(chunks)  # the first token's event
        elapsed = time.perf_counter() - t0
        for _ in chunks:
            pass
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5, help="prompts per path (at most 100)")
    p.add_argument("--tolerance", type=float, default=0.05, help="relative error of the median allowed")
    args = p.parse_args()
    expected = load_profile().prefill_s(TOKENS)
    failed = False
    print(
        f"8K-token prefill at time scale 1: modelled {expected * 1000:.1f} ms; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    with ExitStack() as stack:
        emu = stack.enter_context(start_emulator("mixed", time_scale=1.0, noise=0.0, model="tiny"))
        gateway = Gateway(load_settings(environ={}, overrides={"mixed": [emu.url], "logs": {"level": "warning"}}))
        server = stack.enter_context(serve(create_app(gateway)))
        with httpx.Client(timeout=60) as client:
            client.get(emu.url + "/health")
            for label, url, base in (("emulator", emu.url, 0), ("gateway ", server.url, 100)):
                runs = [_first_byte_s(client, url, _prompt(base + k)) for k in range(args.runs)]
                median = statistics.median(runs)
                error = median / expected - 1
                ok = abs(error) <= args.tolerance
                failed |= not ok
                print(
                    f"  {label} median {median * 1000:7.1f} ms  ({error:+.1%})  runs "
                    f"{', '.join(f'{r * 1000:.0f}' for r in runs)}  {'ok' if ok else 'OFF'}"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
