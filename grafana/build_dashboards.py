"""Writes the Grafana dashboards in this folder (the JSON files are generated: edit this script).

    python grafana/build_dashboards.py           # rewrite grafana/*.json
    python grafana/build_dashboards.py --check   # exit 1 if a JSON file is stale

Every query reads metric names the gateway exports (conductor/ops/metrics.py) or vLLM's own
(`vllm:`); tests/helm/test_dashboards.py checks them against a live gateway's /metrics, checks each
panel's unit against its metrics' names (seconds, bytes, fractions, per-second rates) and that every
panel has a description (building a Panel without one fails). Panels use the
`${DS_PROMETHEUS}` datasource variable, so the files work both when imported by hand and when the
chart's ConfigMap is provisioned by the Grafana sidecar.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling module
from dashboard_model import RATE, Panel, Row, Target, dashboard, mean, of_role, quantile, rate, sel

HERE = Path(__file__).resolve().parent

_HEALTH = (
    {
        "type": "value",
        "options": {"0": {"text": "down", "color": "red", "index": 0}, "1": {"text": "up", "color": "green", "index": 1}},
    },
)
_CONFIGURED = (
    {
        "type": "value",
        "options": {
            "0": {"text": "no endpoint", "color": "orange", "index": 0},
            "1": {"text": "configured", "color": "green", "index": 1},
        },
    },
)


def _gateway_rows() -> tuple[Row, ...]:
    ok = rate("conductor_requests_total", 'status=~"2.."')
    cached = rate("conductor_prompt_tokens_total", 'source="cached"')
    return (
        Row(
            "Traffic",
            (
                Panel(
                    "Requests by status",
                    (Target(f"sum by (status) ({rate('conductor_requests_total')})", "{{status}}"),),
                    "reqps",
                    stack=True,
                    description="Answers per second at the gateway, by HTTP status (499: client went away).",
                ),
                Panel(
                    "Success ratio",
                    # no 2xx series at all while requests fail is 0%, not "No data"
                    (Target(f"(sum({ok}) or vector(0)) / sum({rate('conductor_requests_total')})", "2xx"),),
                    "percentunit",
                    kind="stat",
                    width=4,
                    description="Share of answers with a 2xx status over the range's rate window (429s and "
                    "client disconnects count as failures here).",
                ),
                Panel(
                    "Client disconnects",
                    (Target(f"sum({rate('conductor_client_disconnects_total')})", "disconnects"),),
                    "reqps",
                    kind="stat",
                    width=4,
                    description="Requests per second whose client went away before the answer ended; every "
                    "leg of such a request is cancelled.",
                ),
                Panel(
                    "Rejections (HTTP 429) by reason",
                    (Target(f"sum by (reason) ({rate('conductor_rejections_total')})", "{{reason}}"),),
                    "reqps",
                    stack=True,
                    description="Requests refused before forwarding: predicted TTFT/TBT over the SLO, queue full, ...",
                ),
                Panel(
                    "Upstream errors by instance and kind",
                    (Target(f"sum by (instance, kind) ({rate('conductor_upstream_errors_total')})", "{{instance}} {{kind}}"),),
                    "reqps",
                    description="Failed legs to workers per second (connect, timeout, 5xx, ...). A series "
                    "appears at an instance's first error; until a gateway has seen one the panel reads 0.",
                ),
                Panel(
                    "Decisions by prefill instance",
                    (Target(f"sum by (prefill) ({rate('conductor_decisions_total')})", "{{prefill}}"),),
                    "reqps",
                    stack=True,
                    description="Routing decisions per second by the prefill instance chosen: how "
                    "the policy spreads load and follows cached prefixes.",
                ),
            ),
        ),
        Row(
            "Latency",
            (
                Panel(
                    "TTFT at the gateway",
                    tuple(Target(quantile(q, "conductor_ttft_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                    "s",
                    description="Arrival to first streamed token, quantiles over all gateway replicas.",
                ),
                Panel(
                    "TBT at the gateway",
                    tuple(Target(quantile(q, "conductor_tbt_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                    "s",
                    description="Mean time between tokens of each stream.",
                ),
                Panel(
                    "Predicted vs observed TTFT",
                    (
                        Target(mean("conductor_predicted_ttft_seconds"), "predicted mean"),
                        Target(mean("conductor_ttft_seconds"), "observed mean"),
                        Target(quantile(0.9, "conductor_predicted_ttft_seconds"), "predicted p90"),
                        Target(quantile(0.9, "conductor_ttft_seconds"), "observed p90"),
                    ),
                    "s",
                    description="The policy's TTFT prediction for admitted requests against what streams saw.",
                ),
                Panel(
                    "TTFT histogram",
                    (Target(f"sum by (le) (increase({sel('conductor_ttft_seconds_bucket')}[{RATE}]))", "{{le}}", heatmap=True),),
                    "s",
                    kind="heatmap",
                    description="Streams by time to first token, per interval: the whole distribution, "
                    "where quantiles hide a second mode.",
                ),
                Panel(
                    "TBT histogram",
                    (Target(f"sum by (le) (increase({sel('conductor_tbt_seconds_bucket')}[{RATE}]))", "{{le}}", heatmap=True),),
                    "s",
                    kind="heatmap",
                    description="Streams by mean time between tokens, per interval.",
                ),
                Panel(
                    "Request duration (arrival to last byte)",
                    tuple(Target(quantile(q, "conductor_request_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                    "s",
                    description="Whole requests at the gateway, streamed or not, from arrival to the last byte sent.",
                ),
                Panel(
                    "Decision time",
                    tuple(Target(quantile(q, "conductor_decision_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.99)),
                    "s",
                    description="Prompt analysis and the policy's decision, per request.",
                ),
                Panel(
                    "Prefill leg p90 by instance",
                    (Target(quantile(0.9, "conductor_prefill_leg_seconds", by="instance"), "{{instance}}"),),
                    "s",
                    description="Queue plus prefill on each prefill instance, as the gateway timed it: nixl "
                    "only. Under pdProtocol mooncake (and sglang) both legs go out at once and the decode "
                    "answers before the prefill leg ends, so no prefill leg is timed and this panel shows "
                    '"No data": read the prefill pods\' "Engine TTFT p90" (their prefill) and "TTFT at '
                    'the gateway" instead.',
                ),
            ),
        ),
        Row(
            "Predictors",
            (
                Panel(
                    "Prediction error (MAPE) by component",
                    (Target(f"avg by (component) ({sel('conductor_prediction_mape')})", "{{component}}"),),
                    "percentunit",
                    description="Mean absolute percentage error over each predictor's recent window, "
                    "averaged over instances and gateway replicas.",
                ),
                Panel(
                    "MAPE by component and instance",
                    (Target(f"avg by (component, instance) ({sel('conductor_prediction_mape')})", "{{component}} {{instance}}"),),
                    "percentunit",
                    description="The same error per instance: one instance far above the others has a "
                    "profile that no longer fits it (other hardware, other model settings).",
                ),
                Panel(
                    "p90 coverage (ideal 0.9)",
                    (Target(f"avg by (component) ({sel('conductor_prediction_p90_coverage')})", "{{component}}"),),
                    "percentunit",
                    width=5,
                    description="Share of actuals at or under the predicted p90: well below 0.9 means the "
                    "predictor is optimistic and admission lets too much in.",
                ),
                Panel(
                    "Samples in error window",
                    (Target(f"sum by (component) ({sel('conductor_prediction_samples')})", "{{component}}"),),
                    "short",
                    kind="stat",
                    width=3,
                    description="Observations behind the MAPE and coverage figures: few samples, noisy figures.",
                ),
            ),
        ),
        Row(
            "Instances (gateway view)",
            (
                Panel(
                    "Queued prefill tokens per instance",
                    (
                        Target(
                            f"sum by (instance) ({of_role(sel('conductor_instance_queued_prefill_tokens'), 'prefill|mixed')})",
                            "{{instance}}",
                        ),
                    ),
                    "short",
                    description="Prefill tokens the gateway replicas have in flight on each prefill and mixed "
                    "instance (decode instances, which never prefill for the gateway, are left out).",
                ),
                Panel(
                    "Running decodes per instance",
                    (
                        Target(
                            f"sum by (instance) ({of_role(sel('conductor_instance_running_decodes'), 'decode|mixed')})",
                            "{{instance}}",
                        ),
                    ),
                    "short",
                    description="Decode streams the gateway replicas have in flight on each decode and mixed "
                    "instance (prefill instances, which only prefill, are left out).",
                ),
                Panel(
                    "Instance health",
                    (Target(f"min by (instance, role) ({sel('conductor_instance_healthy')})", "{{role}} {{instance}}"),),
                    "short",
                    kind="stat",
                    mappings=_HEALTH,
                    description="Worst health result across gateway replicas: probes answered and not ejected as an outlier.",
                ),
                Panel(
                    "Failovers",
                    (
                        Target(
                            f"sum by (instance, reason) ({rate('conductor_failovers_total')})", "from {{instance}} ({{reason}})"
                        ),
                    ),
                    "reqps",
                    width=8,
                    description="Requests decided again on another instance after a leg failed before "
                    "any byte reached the client, by the instance that failed and why.",
                ),
                Panel(
                    "Lessons between worker processes",
                    (Target(f"sum by (event) ({rate('conductor_worker_lessons_total')})", "{{event}}"),),
                    "ops",
                    width=8,
                    description="`--workers N`: predictor samples each worker sent to its siblings "
                    "(sent), learned from them (received), lost to a sibling not there or not keeping up (dropped), "
                    "or refused as malformed (refused). Zero with one process or a policy without online predictors.",
                ),
                Panel(
                    "Outlier ejections",
                    (Target(f"sum by (instance) ({rate('conductor_instance_ejections_total')})", "ejected {{instance}}"),),
                    "ops",
                    width=8,
                    description="Instances taken out of rotation per second after consecutive 5xx "
                    "answers or transport failures (summed over gateway replicas).",
                ),
                Panel(
                    "Late prefill failures",
                    (Target(f"sum by (instance) ({rate('conductor_late_prefill_failures_total')})", "{{instance}}"),),
                    "reqps",
                    width=8,
                    description="Concurrent (Mooncake/SGLang) prefill legs that failed or were cut "
                    "after their decode had answered the client in full: harmless to the client, a sign of a sick prefill.",
                ),
            ),
        ),
        Row(
            "KV cache index",
            (
                Panel(
                    "Index hash agreement and coverage",
                    (
                        Target(f"min({sel('conductor_kv_hash_agreement')})", "agreement, worst replica"),
                        Target(f"avg({sel('conductor_kv_hash_agreement')})", "agreement, mean"),
                        Target(f"min({sel('conductor_kv_hash_coverage')})", "coverage, worst replica"),
                    ),
                    "percentunit",
                    width=8,
                    description="Agreement: share of the cached tokens the index predicted that the workers "
                    "reported (low: over-prediction; the gateway's block keys do not match the engines': "
                    "block size, hash algorithm or seed, tokenizer). Coverage: share of the workers' reported "
                    "cached tokens the index knew (low: KV events missing, late start). Near 1 is healthy.",
                ),
                Panel(
                    "Cached prompt tokens: predicted vs reported",
                    (
                        Target(f"sum({rate('conductor_kv_predicted_cached_tokens_total')})", "predicted by the index"),
                        Target(f"sum({rate('conductor_kv_reported_cached_tokens_total')})", "reported by workers"),
                    ),
                    "suffix: tok/s",
                    width=16,
                    description="Cached prompt tokens per second: what the index "
                    "predicted on the chosen prefill instance against what the workers reported.",
                ),
                Panel(
                    "KV index memory (estimated)",
                    (Target(f"sum by (structure) ({sel('conductor_kv_memory_bytes')})", "{{structure}}"),),
                    "bytes",
                    width=8,
                    description="Bytes the index and the per-instance hash maps hold, from measured "
                    "per-entry costs; bounded by kv.index_memory_bytes and kv.hash_map_memory_bytes_per_instance.",
                ),
                Panel(
                    "KV index entries vs cap",
                    (
                        Target(f"sum by (structure) ({sel('conductor_kv_memory_entries')})", "{{structure}} entries"),
                        Target(f"sum by (structure) ({sel('conductor_kv_memory_cap_entries')})", "{{structure}} cap"),
                    ),
                    "short",
                    width=8,
                    description="Entries each in-process structure holds against the cap its byte budget allows.",
                ),
                Panel(
                    "KV index evictions",
                    (Target(f"sum by (structure) ({rate('conductor_kv_memory_evictions_total')})", "{{structure}}"),),
                    "ops",
                    width=8,
                    description="Entries evicted to stay within the memory budget.",
                ),
            ),
        ),
        Row(
            "Prefix cache",
            (
                Panel(
                    "Prefix hit rate (gateway)",
                    (Target(f"sum({cached}) / sum({rate('conductor_prompt_tokens_total')})", "cached / all prompt tokens"),),
                    "percentunit",
                    description="Share of routed prompt tokens the workers reported cached.",
                ),
                Panel(
                    "Prompt tokens: cached vs computed",
                    (Target(f"sum by (source) ({rate('conductor_prompt_tokens_total')})", "{{source}}"),),
                    "suffix: tok/s",
                    stack=True,
                    description="Routed prompt tokens per second, by whether the worker reported them cached.",
                ),
                Panel(
                    "Prompt tokens by source (workers)",
                    (Target(f"sum by (source) ({rate('vllm:prompt_tokens_by_source_total')})", "{{source}}"),),
                    "suffix: tok/s",
                    stack=True,
                    description="vLLM: computed here, local prefix-cache hit, or pulled over the KV connector.",
                ),
                Panel(
                    "Decode readbacks (prefix pulls)",
                    (Target(f"sum by (event) ({rate('conductor_pd_readback_total')})", "{{event}}"),),
                    "ops",
                    description="NIXL bidirectional transfer: decode answers whose pinned KV the gateway "
                    "kept (recorded), could not use (unusable), handed to the next turn's prefill to pull (pulled), "
                    "lost to another request first (lost), or whose pull failed and was computed instead (failed).",
                ),
                Panel(
                    "Prefill-to-prefill pulls",
                    (Target(f"sum by (event) ({rate('conductor_pd_peer_pull_total')})", "{{event}}"),),
                    "ops",
                    description="Pulls of a prefix another prefill holds (conductor/routing/peer_pull.py): staging "
                    "requests that pinned it on the holder (staged), that failed (stage_failed: computed instead), "
                    "planned pulls not staged (skipped: too small or too late for the lease), and staged pulls the "
                    "prefill failed to read (failed).",
                ),
                Panel(
                    "Prefill-to-prefill staging time",
                    (
                        Target(
                            f"sum({rate('conductor_pd_peer_pull_stage_seconds_sum')}) / "
                            f"sum({rate('conductor_pd_peer_pull_stage_seconds_count')})",
                            "mean",
                        ),
                    ),
                    "s",
                    description="A pull's staging request on the holder, sent to answered (its wait there, one "
                    "token, the pin): what a pull adds before the read.",
                ),
            ),
        ),
    )


def _kv_events_row() -> Row:
    """The gateway's view of each prefill/mixed engine's KV event feed and of how well its index matches."""
    return Row(
        "KV cache events (gateway view)",
        (
            Panel(
                "KV event feeds configured",
                (Target(f"min by (instance) ({sel('conductor_kv_events_configured')})", "{{instance}}"),),
                "short",
                kind="stat",
                width=8,
                mappings=_CONFIGURED,
                description="Prefill and mixed instances with a KV events endpoint in the gateway's settings. "
                "Without one the index learns only from the gateway's own dispatches.",
            ),
            Panel(
                "KV event batches per instance",
                (
                    Target(f"max by (instance) ({rate('conductor_kv_events_batches_total')})", "{{instance}} applied"),
                    Target(f"max by (instance) ({rate('conductor_kv_events_replayed_batches_total')})", "{{instance}} replayed"),
                ),
                "ops",
                width=8,
                description="Event batches applied per second, live and from the replay socket "
                "(max over gateway replicas: each one subscribes to every engine itself).",
            ),
            Panel(
                "KV event silence and delay",
                (
                    Target(f"max by (instance) ({sel('conductor_kv_events_silence_seconds')})", "{{instance}} silence"),
                    Target(f"max by (instance) ({sel('conductor_kv_events_delay_seconds')})", "{{instance}} delay"),
                ),
                "s",
                width=8,
                description="Silence: time since the last batch (worst gateway replica); an idle "
                "engine publishes nothing, a busy one that stays silent has lost its feed. Delay: receive time "
                "minus the engine's publish time of the last batch (includes clock skew between hosts).",
            ),
            Panel(
                "KV event gaps, replays and resyncs",
                (
                    Target(f"sum by (instance) ({rate('conductor_kv_events_gaps_total')})", "{{instance}} gaps"),
                    Target(
                        f"sum by (instance) ({rate('conductor_kv_events_replay_requests_total')})", "{{instance}} replay requests"
                    ),
                    Target(f"sum by (instance) ({rate('conductor_kv_events_resyncs_total')})", "{{instance}} resyncs"),
                ),
                "ops",
                width=8,
                description="Sequence gaps on the live feed, requests to the engine's replay "
                "socket to fill them (and at start-up), and resyncs, when the index forgot the instance and "
                "refilled from events (summed over gateway replicas).",
            ),
            Panel(
                "Blocks from KV events",
                (
                    Target(f"max by (instance) ({rate('conductor_kv_events_blocks_stored_total')})", "{{instance}} stored"),
                    Target(f"max by (instance) ({rate('conductor_kv_events_blocks_removed_total')})", "{{instance}} removed"),
                    Target(f"max by (instance) ({rate('conductor_kv_events_blocks_skipped_total')})", "{{instance}} skipped"),
                    Target(f"max by (instance) ({rate('conductor_kv_events_orphan_blocks_total')})", "{{instance}} orphans"),
                ),
                "ops",
                width=8,
                description="Blocks indexed and removed per second; skipped: not indexable (LoRA, "
                "extra keys, another KV cache group or block size); orphans: stored under a parent block the "
                "gateway never saw (it started late or lost events).",
            ),
            Panel(
                "KV event sequence numbers",
                (Target(f"min by (instance, rank) ({sel('conductor_kv_events_last_seq')})", "{{instance}} rank {{rank}}"),),
                "short",
                width=8,
                description="Last sequence number applied per engine and data-parallel rank "
                "(slowest gateway replica); -1 before any batch. A line that stops rising while the engine "
                "serves means the feed stalled.",
            ),
            Panel(
                "vLLM block hash mismatches",
                (
                    Target(
                        f"sum by (instance) ({rate('conductor_kv_events_hash_mismatched_total')}) / "
                        f"sum by (instance) ({rate('conductor_kv_events_hash_checked_total')})",
                        "{{instance}}",
                    ),
                ),
                "percentunit",
                width=8,
                description="Share of prompt-start blocks whose vLLM hash the gateway "
                'recomputed (key mode "vllm") and found different from the engine\'s: above 0 means a wrong '
                "kv.vllm_hash_seed or kv.vllm_hash_algo. Empty in the default key mode.",
            ),
            Panel(
                "Hash agreement and coverage per instance",
                (
                    Target(f"min by (instance) ({sel('conductor_kv_instance_hash_agreement')})", "{{instance}} agreement"),
                    Target(f"min by (instance) ({sel('conductor_kv_instance_hash_coverage')})", "{{instance}} coverage"),
                ),
                "percentunit",
                width=8,
                description='Agreement and coverage (see "Index hash agreement and '
                'coverage") for each prefill instance, worst gateway replica: one instance low alone points at '
                "that engine's settings or its event feed.",
            ),
            Panel(
                "KV hash alarms",
                (
                    Target(
                        f"max by (instance, direction, cause) ({sel('conductor_kv_hash_alarm')})",
                        "{{instance}} {{direction}}: {{cause}}",
                    ),
                ),
                "short",
                width=8,
                description="1 while an agreement (direction over) or coverage (direction under) "
                "alarm is raised on an instance, labelled with the likely cause; the gateway logs the same "
                "diagnosis once (logger conductor.kv.analyzer).",
            ),
            Panel(
                "Prompt length mismatches",
                (
                    Target(
                        # an instance's mismatch series appears at its first mismatch: until then its share is 0
                        f"(sum by (instance) ({rate('conductor_kv_prompt_length_mismatches_total')}) or "
                        f"0 * sum by (instance) ({rate('conductor_kv_prompt_length_checks_total')})) / "
                        f"sum by (instance) ({rate('conductor_kv_prompt_length_checks_total')})",
                        "{{instance}}",
                    ),
                ),
                "percentunit",
                width=8,
                description="Share of requests whose prompt length the worker counted "
                "unlike the gateway's tokenizer: above 0, the gateway tokenizes with another tokenizer or chat "
                "template than the engines, and its block keys cannot match.",
            ),
        ),
    )


def _worker_row() -> Row:
    return Row(
        "Workers (vLLM)",
        (
            Panel(
                "Running requests",
                (Target(f"sum by (pod) ({sel('vllm:num_requests_running')})", "{{pod}}"),),
                description="Requests each engine is running (prefill or decode) right now.",
            ),
            Panel(
                "Waiting requests",
                (Target(f"sum by (pod) ({sel('vllm:num_requests_waiting')})", "{{pod}}"),),
                description="Requests queued in each engine's scheduler: a rising line is an overloaded engine.",
            ),
            Panel(
                "KV cache usage",
                (Target(f"max by (pod) ({sel('vllm:kv_cache_usage_perc')})", "{{pod}}"),),
                "percentunit",
                description="Share of each engine's GPU KV cache blocks in use (vLLM reports a fraction despite the _perc name).",
            ),
            Panel(
                "Prefix cache hit rate",
                (
                    Target(
                        f"sum by (pod) ({rate('vllm:prefix_cache_hits_total')}) / "
                        f"sum by (pod) ({rate('vllm:prefix_cache_queries_total')})",
                        "{{pod}}",
                    ),
                ),
                "percentunit",
                description="Share of the prompt tokens each engine looked up that its own prefix cache held.",
            ),
            Panel(
                "Engine TTFT p90",
                (Target(quantile(0.9, "vllm:time_to_first_token_seconds", by="pod"), "{{pod}}"),),
                "s",
                description="Time to first token inside each engine (a prefill pod's includes only its leg).",
            ),
            Panel(
                "Inter-token latency p90",
                (Target(quantile(0.9, "vllm:inter_token_latency_seconds", by="pod"), "{{pod}}"),),
                "s",
                description="Time between consecutive output tokens inside each engine.",
            ),
            Panel(
                "Queue time p90",
                (Target(quantile(0.9, "vllm:request_queue_time_seconds", by="pod"), "{{pod}}"),),
                "s",
                description="Time requests wait in each engine's queue before they are scheduled.",
            ),
            Panel(
                "Generation tokens",
                (Target(f"sum by (pod) ({rate('vllm:generation_tokens_total')})", "{{pod}}"),),
                "suffix: tok/s",
                stack=True,
                description="Output tokens per second by engine.",
            ),
        ),
    )


def overview() -> dict[str, Any]:
    return dashboard(
        "conductor-overview",
        "Conductor overview",
        "Conductor gateway (admission, routing, latency, prefix reuse) and its vLLM workers.",
        (*_gateway_rows(), _kv_events_row(), _worker_row()),
    )


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    out = {}
    for name, board in (("conductor-overview.json", overview()),):
        out[name] = json.dumps(board, indent=2, sort_keys=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file differs")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run python grafana/build_dashboards.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
