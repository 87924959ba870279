"""kvcache_aware's TTFT and TBT predictions on two real vLLM engines, as the gateway itself reports them.

The gateway starts from the bundled profile made 10x slower (PROFILE_SCALE) and must learn the
engines online. The tiny model on a CPU is already far from the bundled profile itself (an 8B model
on an H800: 45-75 ms predicted for a TTFT of 15-40 ms here), but not far enough for a test on a
busy machine: a gateway that did not learn read a TTFT MAPE of 1.1 in one run, just above a cap a
learning one must stay under on a loaded box. From 10x off, not learning reads 26 (learning 0.4-0.5).
After a warm-up the gateway's error windows are restarted and the next requests are measured: the
exported `conductor_prediction_{mape,p90_coverage,samples}` (pooled over the two instances) must
show predictions that learned the engines and bounds that are calibrated.

The bounds tolerate a busy CPU: the noise of a shared 2-core machine on a ~20 ms TTFT is tens of
milliseconds at the tail, so the MAPE cap is generous and the coverage of the p90 bound is checked
within a wide band (0.85-0.95 is what benchmarks/bench_prediction_accuracy.py --engines vllm aims
at). The load is a closed loop of a few clients: a slow machine slows the requests down, it does
not pile them up.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from policies.kvcache_aware import KvCacheAwarePolicy
from predictors.profile import bundled_profile, fit_profiles
from tests.e2e_vllm.engines import BLOCK_SIZE, HASH_SEED, MODEL_NAME, MixedEngines
from tests.e2e_vllm.gateway import GatewayUnderTest, run_gateway
from tests.support.waiting import wait_for

# the package's engines may start inside this module's setup: far beyond the suite's 120 s default
pytestmark = pytest.mark.timeout(900)

WARMUP, MEASURED, CLIENTS = 60, 100, 3
VOCAB = 480  # the tiny tokenizer's words w0..w479 (make_tiny_model.py)
# TTFT, learning: 0.38-2.08 in 11 runs of this module on a quiet 2-core box (median 0.7; a
# handful of 10x outliers, a request caught behind an engine stall, move a 100-sample MAPE by
# 1.0 or more: CI failed at 1.66 under a cap of 1.0, and a clean-clone run of the whole suite, the
# other units busy on the second core, read 3.16 with its coverage at 0.88); not learning (from 10x
# off): 26. The cap keeps a 4x margin below that
MAPE_CAP = 6.0
COVERAGE = (0.6, 1.0)  # TTFT; TBT's is checked within (0.5, 1.0): its samples are fewer and noisier
POLICY_OPTIONS: dict[str, Any] = {}  # kvcache_aware's defaults: online learning on
# the gateway starts from the bundled profile made this much slower: far enough from the engines
# that a gateway that does not learn misses by a MAPE of several, whatever the load of the box
PROFILE_SCALE = 10.0
_METRIC = re.compile(r'^conductor_prediction_(mape|p90_coverage|samples)\{component="([^"]+)",instance="([^"]+)"\} (\S+)$')


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(n))


def bodies(seed: int, n: int) -> list[dict[str, Any]]:
    """Streams of unique prompts and of prompts that start with one of three long prefixes (prefix
    hits the index predicts), alternately; the usage chunk reports the cached tokens."""
    rng = random.Random(seed)
    prefixes = [_words(random.Random(7000 + i), 600) for i in range(3)]
    out = []
    for i in range(n):
        shared = rng.choice(prefixes) + " " if i % 2 else ""
        prompt = shared + _words(rng, rng.randint(16, 200) if shared else rng.randint(64, 1400))
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": rng.randint(8, 32), "ignore_eos": True}
        out.append({**body, "stream": True, "stream_options": {"include_usage": True}})
    return out


def drive(gw: GatewayUnderTest, work: list[dict[str, Any]]) -> list[int]:
    """Send every request through the gateway from CLIENTS clients, each one request at a time, and
    wait until the gateway has observed them all (it observes once the last byte is sent). The
    clients are tasks on one event loop, not threads: the gateway shares this process, and client
    threads contending with it for the interpreter lock made it read streams in bursts."""
    seen = len(gw.observations)
    todo = iter(work)

    async def client(session: aiohttp.ClientSession) -> list[int]:
        statuses = []
        for body in todo:  # shared: each task takes the next request when its last one is done
            async with session.post(gw.url + "/v1/completions", json=body) as r:
                async for _ in r.content.iter_any():
                    pass
                statuses.append(r.status)
        return statuses

    async def clients() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            done = await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
        return [status for statuses in done for status in statuses]

    statuses = asyncio.run(clients())
    assert wait_for(lambda: len(gw.observations) >= seen + len(work), 30.0), "the gateway did not observe every request"
    return statuses


def exported(gw: GatewayUnderTest) -> dict[str, tuple[int, float, float]]:
    """The gateway's /metrics figures per component, pooled over instances: (samples, MAPE, p90 coverage)."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for line in httpx.get(gw.url + "/metrics", timeout=30).text.splitlines():
        m = _METRIC.match(line)
        if m:
            rows.setdefault((m.group(2), m.group(3)), {})[m.group(1)] = float(m.group(4))
    pooled = {}
    for component in {c for c, _ in rows}:
        parts = [v for (c, _), v in rows.items() if c == component and v.get("samples")]
        n = sum(int(v["samples"]) for v in parts)
        if n:
            mape = sum(v["mape"] * v["samples"] for v in parts) / n
            pooled[component] = (n, mape, sum(v["p90_coverage"] * v["samples"] for v in parts) / n)
    return pooled


@pytest.fixture(scope="module")
def gw(mixed_engines: MixedEngines, e2e_dir: Path) -> Iterator[GatewayUnderTest]:
    engines = list(mixed_engines.engines.values())
    start = e2e_dir / f"profile-x{PROFILE_SCALE:g}.json"
    fit_profiles([bundled_profile()]).scaled(PROFILE_SCALE, PROFILE_SCALE, PROFILE_SCALE).save(start)
    kv = {
        "enabled": True,
        "key_mode": "vllm",
        "tokenizer": str(engines[0].model_dir),
        "vllm_hash_algo": mixed_engines.hash_algo,
        "vllm_hash_seed": HASH_SEED,
    }
    with run_gateway(
        "kvcache_aware",
        mixed=[{"url": e.url, "kv_events_endpoint": e.events_endpoint} for e in engines],
        block_size=BLOCK_SIZE,
        kv=kv,
        policy_options={"predictor_params": str(start), **POLICY_OPTIONS},
    ) as gw:
        yield gw


def test_predictions_learned_online_are_calibrated_after_a_warm_up(gw: GatewayUnderTest) -> None:
    policy = gw.gateway.policy
    assert isinstance(policy, KvCacheAwarePolicy)
    assert drive(gw, bodies(1, WARMUP)) == [200] * WARMUP

    async def restart_error_windows() -> None:  # on the gateway's loop: the predictors are not thread-safe
        policy.predictors.reset_errors()

    gw.on_loop(restart_error_windows)
    assert drive(gw, bodies(2, MEASURED)) == [200] * MEASURED
    figures = exported(gw)
    print(f"after {WARMUP} requests of warm-up, {MEASURED} measured: {figures}")  # seen with -s or on failure
    n, mape, cover = figures["ttft"]
    assert n >= 0.9 * MEASURED, figures
    assert mape <= MAPE_CAP, f"TTFT MAPE {mape:.2f}: the gateway did not learn the engines ({figures})"
    assert COVERAGE[0] <= cover <= COVERAGE[1], f"TTFT p90 coverage {cover:.2f} ({figures})"
    # TBT: a stream read in one piece (a busy box) has no token gaps and teaches nothing, so there are
    # fewer samples; and its MAPE is not capped: a stream paused for a prefill on its worker, or
    # read by the gateway in a burst after a stall, is a mean gap 10-80x or 0.1x the decode step's,
    # and a few of those make any MAPE (seen: 0.3-0.7, and 4 and 12 with bursty reads)
    n, mape, cover = figures["tbt_at_decision"]
    assert n >= 0.25 * MEASURED, figures
    assert 0.5 <= cover <= 1.0, f"TBT p90 coverage {cover:.2f} ({figures})"
