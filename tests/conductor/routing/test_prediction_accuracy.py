"""Issue 5: the KVCache-aware policy's TTFT predictions learn the cluster they run on.

What a test can check on any machine, however busy:

1. The gateway's online refit moves its prefill predictions the right way. The emulated workers run
   twice as slow as the bundled profile the predictors start from (time scale 2), so the refit must
   raise them. A loaded CPU only makes the observed times longer still, so it cannot flip the
   direction this checks.
2. The predictors reach the accuracy goal (MAPE <= 10%) on the times the emulators *modelled*
   (GET /emulator/requests), which CPU contention does not stretch: fed the modelled prefill times
   of noisy emulators running twice as fast as the profile, they predict held-out ones within 10%.

The end-to-end goal on wall-clock times through the gateway (TTFT MAPE <= 10%, p90 coverage
0.90 +- 0.05 under Poisson load) depends on an idle machine: benchmarks/bench_prediction_accuracy.py.
"""

from __future__ import annotations

import asyncio
import random
from contextlib import ExitStack
from typing import Any

import aiohttp
import httpx

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from predictors.online import Predictors
from tests.support.emulator import start_emulator
from tests.support.servers import serve_gateway


async def _drive(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[int]:
    """POST every body (streams read to the end), at most `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> int:
        async with gate, session.post(url, json=body) as r:
            async for _ in r.content.iter_any():
                pass
            return r.status

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, b) for b in bodies)))


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(1, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]  # unique: nothing cached


def test_online_refit_learns_a_cluster_slower_than_its_profile() -> None:
    with ExitStack() as stack:

        def emu(role: str, seed: int) -> str:
            return stack.enter_context(
                start_emulator(role, model="tiny", noise=0.05, seed=seed, time_scale=2.0, log_level="warning")
            ).url

        settings = load_settings(
            environ={},
            overrides={
                "prefill": [{"url": emu("prefill", 1)}, {"url": emu("prefill", 2)}],
                "decode": [{"url": emu("decode", 3)}, {"url": emu("decode", 4)}],
                "policy": "kvcache_aware",
                "logs": {"level": "warning"},
            },
        )
        gateway = Gateway(settings)
        predictors: Predictors = gateway.policy.predictors  # type: ignore[attr-defined]
        before = predictors.prefill_s(2048)
        url = stack.enter_context(serve_gateway(gateway)).url
        bodies = [
            {"model": "tiny", "prompt": p, "max_tokens": 2, "stream": True, "ignore_eos": True}
            for p in _prompts(random.Random(7), 48, 512, 2048)
        ]
        statuses = asyncio.run(_drive(url + "/v1/completions", bodies, concurrency=4))
        after = predictors.prefill_s(2048)
        refits = predictors.refits
    assert statuses.count(200) == len(bodies)
    assert refits >= 1
    # the workers take 2x the profile (more on a busy machine): the learned model must have risen
    print(f"\nprefill of 2048 tokens predicted: {before * 1000:.0f} ms before, {after * 1000:.0f} ms after learning")
    assert after >= 1.3 * before, (before, after)


def _modelled_prefills(url: str) -> list[tuple[int, float]]:
    """(prompt tokens, modelled prefill seconds) of every uncached prefill the emulator served."""
    out = []
    for record in httpx.get(url + "/emulator/requests").json():
        for times in record["modelled"] or ():
            if times is not None and times["cached_tokens"] == 0 and times["prefill_s"] is not None:
                out.append((int(times["prompt_tokens"]), float(times["prefill_s"])))
    return out


def test_predictors_learn_the_modelled_prefill_times_to_the_accuracy_goal() -> None:
    with ExitStack() as stack:
        urls = [
            stack.enter_context(
                start_emulator("mixed", model="tiny", noise=0.08, seed=s, time_scale=0.5, log_level="warning")
            ).url
            for s in (11, 12)
        ]
        rng = random.Random(5)
        prompts = _prompts(rng, 120, 1024, 6144)

        async def both() -> list[int]:
            runs = [
                _drive(url + "/v1/completions", [{"prompt": p, "max_tokens": 1} for p in prompts[i::2]], 4)
                for i, url in enumerate(urls)
            ]
            return [status for statuses in await asyncio.gather(*runs) for status in statuses]

        assert asyncio.run(both()).count(200) == len(prompts)
        samples = [s for url in urls for s in _modelled_prefills(url)]
    assert len(samples) == len(prompts)
    rng.shuffle(samples)
    train, held_out = samples[:80], samples[80:]
    predictors = Predictors.from_bundled_profile()  # twice too slow for these workers
    start = sum(abs(predictors.prefill_s(n) - t) / t for n, t in held_out) / len(held_out)
    for n, t in train:
        predictors.observe_prefill(n, 0, t, "emulated")
    mape = sum(abs(predictors.prefill_s(n) - t) / t for n, t in held_out) / len(held_out)
    print(f"\nprefill MAPE against modelled times: bundled profile {start:.1%}, after learning {mape:.1%}")
    assert start > 0.5  # the profile alone is far off: the figure below is learned
    assert mape <= 0.10
