"""bench_prediction_accuracy.py --engines vllm: the same figures on real vLLM CPU engines.

The engines are tests/e2e_vllm's (the tiny random Llama model made on the spot, one engine per
core, started by `tests.e2e_vllm.engines`), the gateway is tests/e2e_vllm's in-process one. The
tiny model's timing is nothing like the bundled profile's (an 8B model on an H800): a prefill is
a fixed ~25 ms of HTTP, scheduling and sampling plus microseconds a token, a decode step about a
millisecond. The gateway starts from the bundled profile and learns online.

Scenarios: `mixed` (2 mixed engines, KV events, prefix caching) and `pd` (1 prefill + 1 decode over
NIXL, as tests/e2e_vllm/test_pd.py). Workloads, each warmed up, the error windows restarted, then
measured: `unique` prompts (nothing cached) and `shared` prompts (one of a few long prefixes plus a
suffix of their own: prefix hits the index predicts). Streams, so that TBT is measured too.

Besides the gateway's exported figures, each request's prediction and outcome are read where the
policy learns (`OutcomeLearner.learn`), to tell where the misses come from.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from conductor.core.types import Observation
from policies.kvcache_aware import KvCacheAwarePolicy
from tests.e2e_vllm.engines import (
    BLOCK_SIZE,
    MODEL_NAME,
    Engine,
    find_vllm_python,
    make_tiny_model,
    pd_connector,
    start_all,
    stop_all,
)
from tests.e2e_vllm.gateway import GatewayUnderTest, run_gateway
from tests.support.waiting import wait_for

PROMPT = (64, 1536)  # tokens of a unique prompt (the engines' max-model-len is 2048)
OUTPUT = (8, 48)
PREFIXES, PREFIX = 4, (512, 1024)  # shared workload: a few long prefixes ...
SUFFIX = (16, 256)  # ... and a suffix of each request's own
VOCAB = 480  # the tiny tokenizer's words w0..w479 (tests/e2e_vllm/make_tiny_model.py)
# req/s. Mixed: at 6 the two engines, the gateway and the client saturated the 2-core box (load
# average 12). P/D: NIXL engines poll while idle (two threads each near a full core, measured with
# top), so on 2 cores even 1.5 req/s stalled the decode engine for seconds at a time
RATES = {"mixed": 4.0, "pd": 1.0}
WARMUP, MEASURED = 80, 200


@dataclass(frozen=True)
class Sample:
    """One request's predictions (at decision time) and what happened."""

    prompt_tokens: int
    cached: int
    predicted_cached: int
    ttft_pred: float
    ttft_bound: float
    ttft: float
    leg_pred: float
    leg: float | None
    tbt_pred: float | None
    tbt_bound: float
    tbt: float | None
    queue_pred: float
    decode_batch: int  # other streams on the decoding instance when it joined
    generation: tuple[int, int]  # Predictors.generation at decision time: bumped by each clear of the ratio windows


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(n))


class Workload:
    """Prompts of one kind: `unique` (random words) or `shared` (a prefix of a few, then random words)."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.rng = random.Random(seed)
        fixed = random.Random(4242)  # the same prefixes in warm-up and measurement
        self.prefixes = [_words(fixed, fixed.randint(*PREFIX)) for _ in range(PREFIXES)]

    def body(self) -> dict[str, Any]:
        rng = self.rng
        if self.kind == "unique":
            prompt = _words(rng, rng.randint(*PROMPT))
        else:
            prompt = rng.choice(self.prefixes) + " " + _words(rng, rng.randint(*SUFFIX))
        out = rng.randint(*OUTPUT)
        # the usage chunk tells the gateway the cached tokens the engine reports (prefix hits)
        return {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": out,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url, json=body) as r:
        async for _ in r.content.iter_any():
            pass
        return r.status


async def _drive(url: str, workload: Workload, n: int, rate: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200), timeout=timeout) as session:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(_one(session, url, workload.body())))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks, return_exceptions=False))


@contextmanager
def captured(gw: GatewayUnderTest) -> Iterator[list[Sample]]:
    """Every learned outcome beside its prediction, read from the policy's pending entry just
    before the router hands the observation to the policy (which consumes the entry); the
    learning itself runs unchanged."""
    router = gw.gateway.router
    learner = gw.gateway.policy.learner  # type: ignore[attr-defined]
    before: Callable[[Any, Observation], None] = router.observe
    samples: list[Sample] = []

    def observe(routed: Any, obs: Observation) -> None:
        p = learner.pending.get(obs.request_id)
        if p is not None and obs.ok and obs.ttft_s:
            gaps = obs.token_intervals_s
            samples.append(
                Sample(
                    prompt_tokens=obs.prompt_tokens,
                    cached=obs.cached_tokens or 0,
                    predicted_cached=obs.predicted_cached_tokens,
                    ttft_pred=p.ttft_s,
                    ttft_bound=p.bounds[0],
                    ttft=obs.ttft_s,
                    leg_pred=p.queue_s + p.transfer_s + p.prefill_s,
                    leg=obs.queue_and_prefill_s,
                    tbt_pred=p.tbt_s,
                    tbt_bound=p.bounds[2],
                    tbt=sum(gaps) / len(gaps) if gaps else None,
                    queue_pred=p.queue_s,
                    decode_batch=obs.decode_batch,
                    generation=p.generation,
                )
            )
        before(routed, obs)

    router.observe = observe  # type: ignore[method-assign,assignment]
    try:
        yield samples
    finally:
        router.observe = before  # type: ignore[method-assign,assignment]


@contextmanager
def engines_and_gateway(scenario: str, workdir: Path, learning: dict[str, Any]) -> Iterator[GatewayUnderTest]:
    """The scenario's engines (started side by side) and the gateway in front of them."""
    found = find_vllm_python()
    if found.path is None:
        raise SystemExit(found.reason)
    model = make_tiny_model(found.path, workdir / "tiny-llama")
    if scenario == "mixed":
        engines = [Engine(f"mixed-{i}", found.path, model, workdir / "mixed", core=i, kv_events=True) for i in range(2)]
        pools: dict[str, Any] = {"mixed": [{"url": e.url, "kv_events_endpoint": e.events_endpoint} for e in engines]}
    else:
        engines = []
        for core, (kind, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
            config, env = pd_connector("nixl", role)
            engines.append(
                Engine(
                    f"pd-{kind}",
                    found.path,
                    model,
                    workdir / "pd",
                    core=core,
                    kv_events=kind == "prefill",
                    kv_transfer_config=config,
                    extra_env=env,
                )
            )
        p, d = engines
        pools = {"pd": {"protocol": "nixl"}, "prefill": [{"url": p.url, "kv_events_endpoint": p.events_endpoint}]}
        pools["decode"] = [d.url]
    start_all(engines)
    try:
        kv = {"enabled": True, "key_mode": "vllm", "tokenizer": str(model), "vllm_hash_algo": "sha256"}
        policy_options = {"online": learning.get("online", True)}
        with run_gateway(
            "kvcache_aware", block_size=BLOCK_SIZE, kv=kv, policy_options=policy_options, logs={"level": "warning"}, **pools
        ) as gw:
            if scenario == "pd":
                _warm_nixl(gw)
            yield gw
    finally:
        stop_all(engines)


def _warm_nixl(gw: GatewayUnderTest) -> None:
    """The first NIXL transfer handshakes (vLLM waits 5 s for it): up to three short tries."""
    for _ in range(3):
        body = {"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 1}
        if httpx.post(gw.url + "/v1/completions", json=body, timeout=120).status_code == 200:
            return
    raise SystemExit("no NIXL transfer succeeded in three tries (see the decode engine's log)")


def _mape(pairs: list[tuple[float, float]]) -> float:
    return sum(abs(p - a) / a for p, a in pairs) / len(pairs) if pairs else float("nan")


def summarize(samples: list[Sample]) -> dict[str, float]:
    """Figures from the captured per-request predictions (the exported ones are the gateway's own)."""
    out: dict[str, float] = {"n": len(samples)}
    if not samples:
        return out
    out["ttft_mape"] = _mape([(s.ttft_pred, s.ttft) for s in samples])
    bounded = [s for s in samples if s.ttft_bound > 0]
    out["ttft_cover"] = sum(s.ttft <= s.ttft_bound for s in bounded) / len(bounded) if bounded else float("nan")
    out["ttft_bias"] = statistics.median(s.ttft / s.ttft_pred for s in samples)
    out["ttft_ms_median"] = 1000 * statistics.median(s.ttft for s in samples)
    out["ttft_pred_ms_median"] = 1000 * statistics.median(s.ttft_pred for s in samples)
    out["leg_mape"] = _mape([(s.leg_pred, s.leg) for s in samples if s.leg])
    tbts = [(s.tbt_pred, s.tbt, s.tbt_bound) for s in samples if s.tbt and s.tbt_pred]
    out["tbt_mape"] = _mape([(p, a) for p, a, _ in tbts])
    out["tbt_cover"] = sum(a <= hi for _, a, hi in tbts) / len(tbts) if tbts else float("nan")
    out["hits"] = sum(s.cached > 0 for s in samples) / len(samples)
    out["ratio_resets"] = sum(b - a for a, b in zip(samples[0].generation, samples[-1].generation, strict=True))
    out["cached_exact"] = sum(s.cached == s.predicted_cached for s in samples) / len(samples)
    return out


def measure(
    gw: GatewayUnderTest, kind: str, rate: float, warmup: int, measured: int, seed: int
) -> tuple[list[int], list[Sample]]:
    """Warm up on the workload, restart the gateway's error windows, measure; (statuses, samples).
    Each phase ends once the gateway observed its every request (it observes after the last byte)."""
    url = gw.url + "/v1/completions"
    seen = len(gw.observations)
    statuses = asyncio.run(_drive(url, Workload(kind, seed), warmup, rate, seed + 1))
    wait_for(lambda: len(gw.observations) >= seen + warmup, 30.0)
    policy = gw.gateway.policy
    assert isinstance(policy, KvCacheAwarePolicy)

    async def restart_error_windows() -> None:  # on the gateway's loop: the predictors are not thread-safe
        policy.predictors.reset_errors()

    gw.on_loop(restart_error_windows)
    with captured(gw) as samples:
        statuses += asyncio.run(_drive(url, Workload(kind, seed + 100), measured, rate, seed + 2))
        wait_for(lambda: len(gw.observations) >= seen + warmup + measured, 30.0)
    return statuses, samples


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _print_summary(label: str, exported: dict[str, tuple[int, float, float]], mine: dict[str, float]) -> None:
    print(f"  {label}: exported (gateway /metrics, pooled over instances)")
    for component, (n, mape, cover) in exported.items():
        print(f"    {component:18s} n={n:4d}  MAPE {mape:6.1%}  p90 coverage {cover:.3f}")
    if mine.get("n"):
        print(
            f"    per request: n={mine['n']:.0f} TTFT median {mine['ttft_ms_median']:.1f} ms (predicted "
            f"{mine['ttft_pred_ms_median']:.1f}), bias {mine['ttft_bias']:.2f}, MAPE {mine['ttft_mape']:.1%}, "
            f"cover {mine['ttft_cover']:.3f}; TBT MAPE {mine['tbt_mape']:.1%} cover {mine['tbt_cover']:.3f}; "
            f"prefix hits {mine['hits']:.0%}, cached tokens predicted exactly {mine['cached_exact']:.0%}; "
            f"ratio windows cleared {mine['ratio_resets']:.0f} times"
        )


Exported = Callable[[str], dict[str, tuple[int, float, float]]]


def run_vllm(
    scenario: str, kinds: tuple[str, ...], rate: float | None, counts: tuple[int, int], online: bool, exported: Exported
) -> dict[str, dict[str, tuple[int, float, float]]]:
    """One scenario on real engines, each workload warmed up and measured; the exported figures by workload.
    `exported(url)`: the gateway's pooled (samples, MAPE, p90 coverage) per component, read from /metrics."""
    rate = rate or RATES[scenario]
    results: dict[str, dict[str, tuple[int, float, float]]] = {}
    workdir = Path(os.environ.get("PREDICTION_VLLM_DIR", "/tmp/conductor-prediction-vllm"))
    with engines_and_gateway(scenario, workdir, {"online": online}) as gw:
        print(f"{scenario} on real vLLM CPU engines, {rate:g} req/s, learning {'on' if online else 'OFF'}")
        for i, kind in enumerate(kinds):
            statuses, samples = measure(gw, kind, rate, counts[0], counts[1], 1000 * (i + 1))
            results[kind] = exported(gw.url)
            ok = statuses.count(200)
            print(f"  {kind} prompts: {ok} of {len(statuses)} ok, load average {load_average()}")
            _print_summary(kind, results[kind], summarize(samples))
            if os.environ.get("PREDICTION_VLLM_DUMP"):
                dump = Path(os.environ["PREDICTION_VLLM_DUMP"]) / f"{scenario}-{kind}.tsv"
                dump.parent.mkdir(parents=True, exist_ok=True)
                with dump.open("w") as f:
                    f.write("\t".join(Sample.__dataclass_fields__) + "\n")
                    for s in samples:
                        f.write("\t".join(str(getattr(s, k)) for k in Sample.__dataclass_fields__) + "\n")
    return results
