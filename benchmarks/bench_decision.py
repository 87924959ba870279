"""Decision time of every built-in policy on a 16P + 16D cluster and an 8K-token prompt.

One command: `python benchmarks/bench_decision.py [--n 5000] [--seed 0]`. Prints wall and thread-CPU
p50/p99 per policy in microseconds, and each policy's CPU p50 as a ratio to round robin's. Conductor's goal for
`kvcache_aware` is p99 <= 1 ms. `--grid` instead prints, for every policy, the thread-CPU p50/p99 of a
decision as the gateway takes it (`decide` and `on_decided`, where a policy remembers) at 4 to 1,024
instances (half prefill, half decode) and 1K to 128K-token prompts. `--mixed`: kvcache_aware on 16 and
256 mixed workers (32K-token prompt), with its mixed placement rules on and off. `--models [--rounds 3]`: the
gateway's whole decision path (the pool look-up, the snapshot built by a real InstanceRegistry with the
instances outside the request's pool excluded, kvcache_aware's `decide` and `on_decided`) at 256 instances
(128 P + 128 D, and 256 mixed) serving 8 models and 32 LoRA adapters, against the same instances serving
one model; both sides interleaved decision by decision, per-round p50/p99 shown as median [min-max].

The workload: 8192 prompt tokens with their 512 block keys; the cache index reports prefixes of
several lengths on 6 prefill instances (device and host tiers) and in the store; every prefill
instance has 0-8 prefills queued (512-16K tokens, some with cached prefixes), every decode instance
32-128 streams with 1K-32K tokens of context. A fresh snapshot and request per decision, built
before timing starts, so only `decide` is measured.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from adapters.upstream import Timeouts, UpstreamPool
from conductor.config.settings import Settings
from conductor.core.types import (
    ActiveDecode,
    CachedPrefix,
    ClusterSnapshot,
    Decision,
    InstanceView,
    Policy,
    QueuedPrefill,
    RequestView,
    Role,
    Slo,
    Tier,
)
from conductor.fleet.instances import InstanceRegistry
from conductor.fleet.model_pools import take_listing
from conductor.fleet.state import InstanceState
from policies.registry import load_policy

PROMPT = 8192
BLOCK = 16


def prefill_view(rng: random.Random, p: int) -> InstanceView:
    """Prefill instance p with 0-8 prefills queued (512-16K tokens, some with cached prefixes)."""
    queue = tuple(
        QueuedPrefill(rng.randint(512, 16384), rng.choice((0, 0, rng.randint(0, 8192))), rng.uniform(0, 0.3))
        for _ in range(rng.randint(0, 8))
    )
    return InstanceView(f"prefill-{p}", Role.PREFILL, prefill_queue=queue, kv_usage=rng.random())


def decode_view(rng: random.Random, d: int) -> InstanceView:
    """Decode instance d with 32-128 streams of 1K-32K tokens of context."""
    decodes = tuple(ActiveDecode(rng.randint(1024, 32768), rng.randint(1, 1024)) for _ in range(rng.randint(32, 128)))
    return InstanceView(f"decode-{d}", Role.DECODE, decodes=decodes, kv_capacity_tokens=4_000_000, kv_usage=None)


def request(
    rng: random.Random, i: int, n_prefill: int, prompt: int, model: str = "m", holders_from: Sequence[str] | None = None
) -> RequestView:
    """A `prompt`-token request whose prefixes of several lengths sit on 6 prefill instances (device
    and host tiers; of `holders_from` when given, else prefill-0 .. n_prefill-1) and in the store."""
    names = holders_from if holders_from is not None else [f"prefill-{p}" for p in range(n_prefill)]
    holders = rng.sample(names, min(6, len(names)))  # the same draws as from a range of that length
    cached = {h: CachedPrefix(BLOCK * rng.randint(1, prompt // BLOCK), rng.choice((Tier.DEVICE, Tier.HOST))) for h in holders}
    keys = tuple(rng.getrandbits(64) for _ in range(prompt // BLOCK))
    return RequestView(
        request_id=f"r{i}",
        seq=i,
        model=model,
        prompt_tokens=prompt,
        max_tokens=256,
        block_size=BLOCK,
        block_keys=keys,
        cached=cached,
        store_cached_tokens=BLOCK * rng.randint(0, prompt // BLOCK),
        slo=Slo(ttft_s=30.0, tbt_s=1.0),  # loose: measure the full path, not early exits
    )


def make_case(rng: random.Random, i: int) -> tuple[RequestView, ClusterSnapshot]:
    instances = [prefill_view(rng, p) for p in range(16)] + [decode_view(rng, d) for d in range(16)]
    return request(rng, i, 16, PROMPT), ClusterSnapshot(now=1000.0 + i, instances=tuple(instances))


def scaled_cases(n_instances: int, n: int, seed: int = 3, prompt: int = 32768) -> list[tuple[RequestView, ClusterSnapshot]]:
    """The same load on n_instances/2 prefill + n_instances/2 decode (benchmarks/bench_scale.py).
    A few snapshots are shared by the requests: building 80 streams on each of 512 decode
    instances per decision would cost more than deciding."""
    rng = random.Random(seed)
    n_p = max(1, n_instances // 2)
    n_d = max(1, n_instances - n_p)
    snapshots = [
        ClusterSnapshot(
            now=1000.0 + k,
            instances=tuple([prefill_view(rng, p) for p in range(n_p)] + [decode_view(rng, d) for d in range(n_d)]),
        )
        for k in range(8)
    ]
    return [(request(rng, i, n_p, prompt), snapshots[i % len(snapshots)]) for i in range(n)]


def measure(
    name: str, options: dict[str, object], cases: list[tuple[RequestView, ClusterSnapshot]]
) -> tuple[list[float], list[float]]:
    """Wall and thread-CPU microseconds per decision. On a shared 2-core box the wall p99 mostly
    measures preemption by other processes (a ~4 ms scheduler slice); CPU time does not."""
    policy = load_policy(name, options)
    for req, snap in cases[:200]:  # warm up
        policy.decide(req, snap)
    gc.collect()
    wall, cpu = [], []
    for req, snap in cases:
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        policy.decide(req, snap)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        wall.append((t1 - t0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
    return sorted(wall), sorted(cpu)


GRID_INSTANCES = (4, 16, 64, 256, 1024)
GRID_PROMPTS = (1024, 8192, 32768, 131072)
GRID_POLICIES = ("round_robin", "random", "least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd", "kvcache_aware")


def decision_cpu(name: str, cases: list[tuple[RequestView, ClusterSnapshot]]) -> list[float]:
    """Thread-CPU microseconds of decide + on_decided per case, sorted (after 20 warm-up cases)."""
    policy = load_policy(name, {"online": False} if name == "kvcache_aware" else {})
    for req, snap in cases[:20]:
        policy.on_decided(req, snap, policy.decide(req, snap))
    gc.collect()
    cpu = []
    for req, snap in cases[20:]:
        c0 = time.thread_time_ns()
        policy.on_decided(req, snap, policy.decide(req, snap))
        cpu.append((time.thread_time_ns() - c0) / 1e3)
    return sorted(cpu)


def grid(n: int) -> None:
    print(
        f"decision (decide + on_decided) thread-CPU p50 / p99 in us, {n} decisions per cell; instances half prefill, half decode"
    )
    cells = {(i, p): scaled_cases(i, n + 20, seed=i + p, prompt=p) for i in GRID_INSTANCES for p in GRID_PROMPTS}
    head = f"{'instances':>10}" + "".join(f"{f'{p // 1024}K-token prompt':>20}" for p in GRID_PROMPTS)
    for name in GRID_POLICIES:
        print(f"\n{name}\n{head}")
        for i in GRID_INSTANCES:
            row = []
            for p in GRID_PROMPTS:
                cpu = decision_cpu(name, cells[i, p])
                row.append(f"{statistics.median(cpu):.0f} / {pct(cpu, 0.99):.0f}")
            print(f"{i:>10}" + "".join(f"{r:>20}" for r in row))


def mixed_cases(
    n_instances: int, n: int, slo: Slo, seed: int = 5, prompt: int = 32768
) -> list[tuple[RequestView, ClusterSnapshot]]:
    """n_instances mixed workers, each with a prefill queue as prefill_view's and streams as
    decode_view's (32-128), a few shared snapshots (see scaled_cases)."""
    rng = random.Random(seed)
    snapshots = [
        ClusterSnapshot(
            now=1000.0 + k,
            instances=tuple(
                InstanceView(
                    f"prefill-{w}",
                    Role.MIXED,
                    prefill_queue=prefill_view(rng, w).prefill_queue,
                    decodes=decode_view(rng, w).decodes,
                )
                for w in range(n_instances)
            ),
        )
        for k in range(4)
    ]
    return [(replace(request(rng, i, n_instances, prompt), slo=slo), snapshots[i % len(snapshots)]) for i in range(n)]


def mixed(n: int) -> None:
    """kvcache_aware's decision on mixed workers, its placement rules on and off: the least-stall
    placement (mixed_ttft_slack) and the stream check (mixed_protect_streams) walk streams the
    lowest-TTFT rule did not."""
    variants = (
        ("lowest TTFT", {"mixed_ttft_slack": None, "mixed_protect_streams": False}),
        ("least stall", {"mixed_protect_streams": False}),
        ("least stall + streams protected (default)", {}),
    )
    print(f"kvcache_aware on mixed workers, decide thread-CPU p50 / p99 in us, {n} decisions, 32K-token prompt")
    for workers in (16, 256):
        for slo in (Slo(ttft_s=30.0, tbt_s=1.0), Slo(ttft_s=5.0, tbt_s=0.1)):
            cases = mixed_cases(workers, n, slo)
            for label, options in variants:
                _, cpu = measure("kvcache_aware", {"online": False, **options}, cases)
                print(
                    f"{workers:>5} workers, SLO TTFT {slo.ttft_s:g}s TBT {slo.tbt_s:g}s  {label:<42}"
                    f"{statistics.median(cpu):>7.0f} / {pct(cpu, 0.99):.0f}"
                )


# ---- --models: the decision path of a fleet serving several models ----------------------------

FLEET_INSTANCES = 256
FLEET_MODELS = 8  # 32 instances each
ADAPTERS_PER_MODEL = 4  # 32 adapters in all
ADAPTER_HOLDERS = 4  # of its model's instances list each adapter (P/D: 2 prefill + 2 decode)
FLEET_PROMPT = 32768


@dataclass(frozen=True)
class FleetSide:
    """One side of the comparison: its registry (the same load on both sides to begin with) and the
    names a request may carry, each with the prefill-capable instances that may hold its prefix."""

    label: str
    registry: InstanceRegistry
    names: list[tuple[str, list[str]]]


def fleet_settings(layout: str) -> Settings:
    """FLEET_INSTANCES workers: half prefill and half decode ("pd"), or all mixed."""

    def specs(role: str, n: int, base: int) -> list[dict[str, str]]:
        return [{"url": f"http://127.0.0.1:{base + i}", "role": role} for i in range(n)]

    if layout == "pd":
        half = FLEET_INSTANCES // 2
        return Settings.model_validate({"prefill": specs("prefill", half, 20000), "decode": specs("decode", half, 30000)})
    return Settings.model_validate({"mixed": specs("mixed", FLEET_INSTANCES, 20000)})


def fleet_listings(states: list[InstanceState], models: int) -> dict[str, list[dict[str, object]]]:
    """Each worker's /v1/models `data`: `models` base models over the workers of each role in blocks
    (model-0 on the first 1/models of the prefills, of the decodes...), and with several models
    ADAPTERS_PER_MODEL adapters each, every one listed by ADAPTER_HOLDERS of its model's workers."""
    out: dict[str, list[dict[str, object]]] = {}
    by_role: dict[Role, list[InstanceState]] = {}
    for state in states:
        by_role.setdefault(state.spec.role, []).append(state)
    per_role = ADAPTER_HOLDERS // len(by_role)
    for members in by_role.values():
        size = len(members) // models
        for i, state in enumerate(members):
            model = f"model-{i // size}" if models > 1 else "m"
            cards: list[dict[str, object]] = [{"id": model, "root": model, "parent": None, "max_model_len": 131072}]
            slot = (i % size) // per_role  # which of its model's adapters this worker lists
            if models > 1 and slot < ADAPTERS_PER_MODEL:
                cards.append({"id": f"{model}-lora-{slot}", "root": f"/adapters/{model}-{slot}", "parent": model})
            out[state.name] = cards
    return out


def load_registry(registry: InstanceRegistry, rng: random.Random) -> None:
    """bench_decision's load through the registry's own accounting: 0-8 prefills queued on each
    prefill or mixed worker, 32-128 streams on each decode or mixed one."""
    n = 0
    for name, state in registry.states.items():
        if state.spec.role is not Role.DECODE:
            for _ in range(rng.randint(0, 8)):
                registry.add_prefill(name, f"q{n}", rng.randint(512, 16384), rng.choice((0, 0, rng.randint(0, 8192))))
                state.started[f"q{n}"] -= rng.uniform(0, 0.3)
                n += 1
        if state.spec.role is not Role.PREFILL:
            for _ in range(rng.randint(32, 128)):
                registry.add_decode(name, f"d{n}", rng.randint(1024, 32768), rng.randint(1, 1024))
                registry.mark_decoding(name, f"d{n}")
                n += 1


def fleet_side(layout: str, models: int) -> FleetSide:
    """The registry (the real InstanceRegistry, InstanceState, take_listing and build_pools; no I/O:
    the workers' listings are handed in and every probe recorded as answered), loaded."""
    registry = InstanceRegistry(fleet_settings(layout), UpstreamPool(Timeouts()))
    listings = fleet_listings(list(registry.states.values()), models)
    for state in registry.states.values():
        take_listing(state, listings[state.name])
        registry.record_probe(state, True)
    registry.models_changed()
    load_registry(registry, random.Random(0))
    states, pools = registry.states.values(), registry.pools
    names = [
        (name, [s.name for s in states if s.spec.role is not Role.DECODE and s.name not in pools.excluded(name)])
        for name in pools.names
    ]
    label = f"{models} models, {ADAPTERS_PER_MODEL * models} adapters" if models > 1 else "1 model"
    return FleetSide(label, registry, names)


def fleet_requests(side: FleetSide, rng: random.Random, first: int, n: int) -> list[RequestView]:
    """Requests spread over the side's names: half name a base model, half an adapter (uniformly
    among each); a prefix of each cached on prefill-capable workers of its pool."""
    bases = [x for x in side.names if "-lora-" not in x[0]]
    adapters = [x for x in side.names if "-lora-" in x[0]] or bases
    out = []
    for i in range(first, first + n):
        name, holders = rng.choice(bases if rng.random() < 0.5 else adapters)
        out.append(request(rng, i, 0, FLEET_PROMPT, model=name, holders_from=holders))
    return out


def timed_decision(registry: InstanceRegistry, policy: Policy, req: RequestView) -> tuple[float, float, float]:
    """One decision as Router.propose and decide take it: the members outside the request's pool,
    the snapshot without them, `decide` and `on_decided`. Wall us of it all, thread-CPU us of
    the look-up + snapshot, thread-CPU us of decide + on_decided. Then, untimed, `churn`."""
    t0 = time.perf_counter_ns()
    c0 = time.thread_time_ns()
    outside = registry.pools.excluded(req.model)
    snapshot = registry.snapshot(outside, outside)
    c1 = time.thread_time_ns()
    decision = policy.decide(req, snapshot)
    policy.on_decided(req, snapshot, decision)
    c2 = time.thread_time_ns()
    t1 = time.perf_counter_ns()
    churn(registry, req, decision)
    return (t1 - t0) / 1e3, (c1 - c0) / 1e3, (c2 - c1) / 1e3


def churn(registry: InstanceRegistry, req: RequestView, decision: Decision) -> None:
    """The registry's accounting moves on between decisions as a gateway's does, its load as large:
    the request queued where it prefills and listed where it decodes, the oldest prefill queued
    and the oldest stream there ended."""
    if decision.prefill is None:
        return
    cached = req.cached.get(decision.prefill)
    new_tokens = req.prompt_tokens - (cached.tokens if cached else 0)
    registry.add_prefill(decision.prefill, req.request_id, new_tokens, req.prompt_tokens - new_tokens)
    registry.end_prefill(decision.prefill, next(iter(registry.states[decision.prefill].prefills)))
    decode = decision.decode or decision.prefill
    registry.add_decode(decode, req.request_id, req.prompt_tokens, req.max_tokens)
    registry.end_decode(decode, next(iter(registry.states[decode].decodes)))


# what one round measured of one side, us per decision, each list sorted
FLEET_METRICS = ("path cpu", "path wall", "look-up + snapshot cpu", "decide + on_decided cpu")


def fleet_round(sides: list[FleetSide], policies: list[Policy], seed: int, first: int, n: int) -> list[list[list[float]]]:
    """n decisions per side, interleaved one for one (the side going first alternates with `seed`),
    so both see the same moments of a shared box: per side, FLEET_METRICS' samples, sorted."""
    reqs = [fleet_requests(side, random.Random(seed), first, n) for side in sides]
    order = list(range(len(sides)))[:: -1 if seed % 2 else 1]
    samples: list[list[list[float]]] = [[[] for _ in FLEET_METRICS] for _ in sides]
    gc.collect()
    for i in range(n):
        for k in order:
            wall, snap, decide = timed_decision(sides[k].registry, policies[k], reqs[k][i])
            for series, value in zip(samples[k], (snap + decide, wall, snap, decide), strict=True):
                series.append(value)
    return [[sorted(series) for series in side] for side in samples]


def spread(values: list[float], spec: str = ".0f") -> str:
    """The median of per-round figures and their range."""
    return f"{format(statistics.median(values), spec)} [{format(min(values), spec)}-{format(max(values), spec)}]"


def fleet_layout(layout: str, n: int, rounds: int) -> dict[str, float]:
    """One layout, one model against FLEET_MODELS: prints the table; returns the several-model
    side's p99s (ms, the median of rounds) by metric."""
    sides = [fleet_side(layout, 1), fleet_side(layout, FLEET_MODELS)]
    policies = [load_policy("kvcache_aware") for _ in sides]
    for k, side in enumerate(sides):  # warm up
        for req in fleet_requests(side, random.Random(99), 10**7, 200):
            timed_decision(side.registry, policies[k], req)
    gc.collect()
    gc.freeze()  # the registries and policies built so far: the gateway's GcFreezer does as much
    per_round = [fleet_round(sides, policies, r, r * n, n) for r in range(rounds)]
    shape = "128 prefill + 128 decode" if layout == "pd" else f"{FLEET_INSTANCES} mixed"
    print(f"\n{shape}, {FLEET_PROMPT // 1024}K-token prompt: us per decision, median of {rounds} rounds [min-max]")
    print(f"{'':<30}{sides[0].label:>20}{sides[1].label:>26}{'ratio (per round)':>24}")
    p99s = {}
    for m, metric in enumerate(FLEET_METRICS):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            one, many = ([pct(r[k][m], q) for r in per_round] for k in (0, 1))
            ratio = [b / a for a, b in zip(one, many, strict=True)]
            print(f"{metric + ' ' + name:<30}{spread(one):>20}{spread(many):>26}{spread(ratio, '.2f') + 'x':>24}")
        p99s[metric] = statistics.median([pct(r[1][m], 0.99) for r in per_round]) / 1e3
    gc.unfreeze()
    return p99s


def several_models(n: int, rounds: int) -> None:
    """--models: the gateway's decision path on a fleet of FLEET_MODELS models, against one model on
    the same instances and load, for P/D and mixed workers."""
    print(
        f"decision path (pool look-up + snapshot + kvcache_aware decide + on_decided) at {FLEET_INSTANCES} instances: "
        f"1 model against {FLEET_MODELS} models ({FLEET_INSTANCES // FLEET_MODELS} instances each) and "
        f"{FLEET_MODELS * ADAPTERS_PER_MODEL} adapters ({ADAPTER_HOLDERS} workers list each); "
        f"{n} decisions per side per round, interleaved"
    )
    results = {layout: fleet_layout(layout, n, rounds) for layout in ("pd", "mixed")}
    goal = f"goal: decision p99 <= 2 ms at {FLEET_INSTANCES} instances with {FLEET_MODELS} models"
    print()
    for metric in ("decide + on_decided cpu", "path cpu"):
        worst = max(r[metric] for r in results.values())
        figures = ", ".join(f"{layout} {r[metric]:.2f}" for layout, r in results.items())
        print(f"{goal}, {metric} p99: {figures} ms: {'met' if worst <= 2.0 else 'MISSED'}")


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="decisions per policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", action="store_true", help="decision CPU by instances and prompt length, every policy")
    ap.add_argument("--mixed", action="store_true", help="kvcache_aware on 16 and 256 mixed workers, its mixed rules on and off")
    ap.add_argument("--models", action="store_true", help="the decision path with 8 models and 32 adapters against one model")
    ap.add_argument("--rounds", type=int, default=3, help="--models: rounds, each side interleaved (median and range shown)")
    args = ap.parse_args()
    if args.models:
        several_models(min(args.n, 1500), args.rounds)
        return
    if args.mixed:
        mixed(min(args.n, 400))
        return
    if args.grid:
        grid(min(args.n, 300))
        return
    rng = random.Random(args.seed)
    cases = [make_case(rng, i) for i in range(args.n)]
    runs: list[tuple[str, str, dict[str, object]]] = [
        ("round_robin", "round_robin", {}),
        ("random", "random", {}),
        ("least_loaded", "least_loaded", {}),
        ("sglang_cache_aware", "sglang_cache_aware", {}),
        ("dynamo_kv", "dynamo_kv", {}),
        ("llmd", "llmd", {}),
        ("kvcache_aware[none]", "kvcache_aware", {"admission": "none", "online": False}),
        ("kvcache_aware[early]", "kvcache_aware", {"admission": "early", "online": False}),
        ("kvcache_aware[predicted]", "kvcache_aware", {"admission": "predicted", "online": False}),
    ]
    print(f"{args.n} decisions each; 16 prefill + 16 decode instances; {PROMPT}-token prompt")
    print(f"{'policy':<26}{'wall p50':>10}{'wall p99':>10}{'cpu p50':>10}{'cpu p99':>10}  cpu p50 vs round_robin")
    base = None
    for label, name, options in runs:
        wall, cpu = measure(name, options, cases)
        base = base or statistics.median(cpu)
        print(
            f"{label:<26}{statistics.median(wall):>10.1f}{pct(wall, 0.99):>10.1f}"
            f"{statistics.median(cpu):>10.1f}{pct(cpu, 0.99):>10.1f}  {statistics.median(cpu) / base:>8.1f}x"
        )


if __name__ == "__main__":
    main()
