"""Command-line options shared by `conductor replay --simulate` and `conductor tune-pd`."""

from __future__ import annotations

import argparse

from conductor.core.types import Slo
from traces.sim.config import DECODE_KV_MODES, DEFAULT_KV_LAYERS, KV_HANDOFF_MODES, PULL_MODES, SimConfig
from traces.sim.runner import PolicySpec
from traces.sim.truth import (
    DEFAULT_PROFILE,
    PAPER_KV_BYTES_PER_TOKEN,
    PAPER_PREFILL_SCALE,
    DecodeTruth,
    fit_truth,
)

_D = DecodeTruth()
PAPER_KV_LAYERS = 80  # LLaMA3-70B


# the simulator's SLOs when none is given: loose, the paper's clusters at the trace's full lengths
SIM_SLO_TTFT_S = 30.0
SIM_SLO_TBT_S = 0.1
# a live replay's when none is given: `conductor demo`'s (0.5 s, 40 ms), which its emulated cluster
# at the demo's scaled lengths meets when the routing is good and misses when it is not; the
# gateway's own SLOs are not exposed on its API, so the replay cannot read them
LIVE_SLO_TTFT_S = 0.5
LIVE_SLO_TBT_S = 0.04


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Truth model, capacities, SLOs and replay speed."""
    g = parser.add_argument_group("simulated cluster")
    g.add_argument(
        "--profile",
        default=str(DEFAULT_PROFILE),
        help="profile CSV the prefill and link truth is fitted from (default: bundled Qwen3-8B/H800)",
    )
    g.add_argument(
        "--prefill-scale",
        type=float,
        default=1.0,
        help=f"multiply the profile's prefill cost (70B-class on 8xA800: {PAPER_PREFILL_SCALE:g})",
    )
    g.add_argument(
        "--paper",
        action="store_true",
        help=f"the FAST'25 setting: --prefill-scale {PAPER_PREFILL_SCALE:g} and "
        f"{PAPER_KV_BYTES_PER_TOKEN} KV bytes/token unless given explicitly",
    )
    g.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV size per token (default: profile's)")
    g.add_argument(
        "--link-gbps", type=float, default=None, help="KV link bandwidth in GB/s per instance (default: fitted from the profile)"
    )
    g.add_argument("--prefill-cache-tokens", type=int, default=3_000_000, help="local prefix cache per prefill")
    g.add_argument(
        "--max-prefill-queue",
        type=int,
        default=256,
        help="prefills queued per instance before requests are rejected (queue_full)",
    )
    g.add_argument("--store-tokens", type=int, default=0, help="Mooncake Store pool capacity (0: no store)")
    g.add_argument(
        "--pull",
        choices=PULL_MODES,
        default="both",
        help="prefix pulls the cluster can do: from peer prefill instances, from the store "
        "(needs --store-tokens), both, or none; staged / staged-fcfs: peer pulls behind a staging "
        "request on the holder, as the gateway drives them over vLLM NIXL; policies with an "
        "allow_pull option are told",
    )
    g.add_argument("--decode-kv-tokens", type=int, default=_D.kv_capacity_tokens, help="KV capacity per decode")
    g.add_argument(
        "--decode-kv",
        choices=DECODE_KV_MODES,
        default="preempt",
        help="decode KV space: preempt the last joined sequence when the cache fills and recompute "
        "it on rejoin (vLLM), or reserve prompt + all output at join and never preempt",
    )
    g.add_argument(
        "--kv-handoff",
        choices=KV_HANDOFF_MODES,
        default="whole",
        help="P -> D KV transfer: whole after the prefill (vLLM's connectors) or layerwise, streamed "
        "as the prefill computes each layer (Mooncake's engine)",
    )
    g.add_argument(
        "--kv-layers",
        type=int,
        default=None,
        help=f"layers the KV streams by with --kv-handoff layerwise (default {DEFAULT_KV_LAYERS}, Qwen3-8B; "
        f"{PAPER_KV_LAYERS} with --paper)",
    )
    g.add_argument("--decode-max-batch", type=int, default=_D.max_batch, help="running sequences per decode")
    g.add_argument("--tbt-base-ms", type=float, default=_D.base_s * 1e3, help="decode step fixed cost")
    g.add_argument("--tbt-per-seq-ms", type=float, default=_D.per_seq_s * 1e3, help="decode step cost per sequence")
    g.add_argument(
        "--tbt-per-mtok-ms", type=float, default=_D.per_kv_token_s * 1e9, help="decode step cost per million resident KV tokens"
    )
    _add_slo_args(g)
    g.add_argument("--speedup", type=float, default=1.0, help="replay arrivals X times faster")
    g.add_argument("--noise", type=float, default=0.05, help="lognormal sigma on the truth model (0: exact)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--limit", type=int, default=None, help="use only the first N requests of the trace")
    g.add_argument("--no-observe", action="store_true", help="do not feed outcomes back to the policy")
    _add_view_args(g)


def _add_view_args(g: argparse._ArgumentGroup) -> None:
    """What the policy sees of the trace's sessions and of the caches (the gateway's session header, its KV index)."""
    g.add_argument(
        "--no-session-tags",
        action="store_true",
        help="hide the trace's sessions (session_id) from the policy, as requests without a session header",
    )
    index = g.add_mutually_exclusive_group()
    index.add_argument(
        "--index-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="the policy's KV index learns a finished prefill's blocks S seconds late (a live index's KV-event lag)",
    )
    index.add_argument(
        "--no-index", action="store_true", help="KV awareness off (kv.enabled: false): no block keys, no cached prefix"
    )


def _add_slo_args(g: argparse._ArgumentGroup) -> None:
    # None until given: a simulation then judges by SIM_SLO_*, a live replay by the demo's (traces.live)
    for flag, sim, live, what in (
        ("--slo-ttft", SIM_SLO_TTFT_S, LIVE_SLO_TTFT_S, "TTFT"),
        ("--slo-tbt", SIM_SLO_TBT_S, LIVE_SLO_TBT_S, "TBT"),
    ):
        g.add_argument(
            flag, type=float, default=None, help=f"{what} SLO in seconds (default {sim:g}; with --live {live:g}, the demo's)"
        )


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """Options applied to every policy spec of a run (a spec's own options win)."""
    g = parser.add_argument_group("policies")
    g.add_argument(
        "--admission",
        choices=("none", "early", "predicted"),
        default=None,
        help="SLO admission mode for every policy whose spec sets none",
    )
    g.add_argument(
        "--fit-predictors",
        action="store_true",
        help="judge the baselines' placements with kvcache_aware's online-fitted predictors and "
        "admission (default mode: predicted), for a like-for-like comparison",
    )


def apply_policy_args(specs: list[PolicySpec], args: argparse.Namespace) -> list[PolicySpec]:
    """The specs with --admission / --fit-predictors added where a spec does not set them; the
    label says so, in spec syntax."""
    out = []
    for spec in specs:
        extra: dict[str, object] = {}
        if args.admission is not None and "admission" not in spec.options:
            extra["admission"] = args.admission
        if args.fit_predictors and "fit_predictors" not in spec.options:
            extra["fit_predictors"] = True
        if not extra:
            out.append(spec)
            continue
        suffix = "".join(f":{k}={str(v).lower()}" for k, v in extra.items())
        out.append(PolicySpec(spec.name, {**spec.options, **extra}, (spec.label or spec.name) + suffix))
    return out


def config_from_args(args: argparse.Namespace, n_prefill: int, n_decode: int) -> SimConfig:
    scale = args.prefill_scale
    kv_bytes = args.kv_bytes_per_token
    if args.paper:
        scale = PAPER_PREFILL_SCALE if scale == 1.0 else scale
        kv_bytes = PAPER_KV_BYTES_PER_TOKEN if kv_bytes is None else kv_bytes
    decode = DecodeTruth(
        base_s=args.tbt_base_ms / 1e3,
        per_seq_s=args.tbt_per_seq_ms / 1e3,
        per_kv_token_s=args.tbt_per_mtok_ms / 1e9,
        kv_capacity_tokens=args.decode_kv_tokens,
        max_batch=args.decode_max_batch,
    )
    truth = fit_truth(args.profile).with_options(
        prefill_scale=scale,
        kv_bytes_per_token=kv_bytes,
        link_bandwidth_bps=None if args.link_gbps is None else args.link_gbps * 1e9,
        decode=decode,
    )
    return SimConfig(
        n_prefill=n_prefill,
        n_decode=n_decode,
        truth=truth,
        prefill_cache_tokens=args.prefill_cache_tokens,
        store_capacity_tokens=args.store_tokens,
        max_prefill_queue=args.max_prefill_queue,
        slo=Slo(
            ttft_s=SIM_SLO_TTFT_S if args.slo_ttft is None else args.slo_ttft,
            tbt_s=SIM_SLO_TBT_S if args.slo_tbt is None else args.slo_tbt,
        ),
        speedup=args.speedup,
        noise=args.noise,
        seed=args.seed,
        observe=not args.no_observe,
        sessions=not args.no_session_tags,
        index_delay_s=None if args.no_index else args.index_delay,
        pull=args.pull,
        decode_kv=args.decode_kv,
        kv_handoff=args.kv_handoff,
        kv_layers=args.kv_layers or (PAPER_KV_LAYERS if args.paper else DEFAULT_KV_LAYERS),
    )


def describe(config: SimConfig) -> str:
    """One line for printed headers: the transfer mechanisms and caches a run assumed."""
    if config.pull == "none":
        pulls = "no prefix pulls"
    else:
        ways = []
        if config.pull_from_peer:
            ways.append(
                {"priority": "peer-to-peer, staged with priority", "fcfs": "peer-to-peer, staged FCFS"}.get(
                    config.staging or "", "peer-to-peer"
                )
            )
        if config.pull_from_store:
            ways.append(
                f"store ({config.store_capacity_tokens:,} tokens)"
                if config.store_capacity_tokens
                else "store (none configured: --store-tokens 0)"
            )
        pulls = "prefix pulls " + " + ".join(ways)
    slo = config.slo
    return (
        f"{config.n_prefill}P+{config.n_decode}D, {pulls} (--pull {config.pull}), "
        f"SLO TTFT {slo.ttft_s}s TBT {slo.tbt_s}s, speedup {config.speedup:g}, "
        f"prefill x{config.truth.prefill_scale:g}, KV {config.truth.kv_bytes_per_token:,} B/token"
    )
