"""The cache and engine rows of the overview dashboard (grafana/build_dashboards.py writes it):
the gateway's KV index, prefix reuse, the KV event feeds as the gateway sees them, and the vLLM
workers' own metrics."""

from __future__ import annotations

from dashboard_model import Panel, Row, Target, quantile, rate, sel

_CONFIGURED = (
    {
        "type": "value",
        "options": {
            "0": {"text": "no endpoint", "color": "orange", "index": 0},
            "1": {"text": "configured", "color": "green", "index": 1},
        },
    },
)


_UNLOAD_LEGEND = "unload, {{instance}} {{result}}"


def kv_index_row() -> Row:
    """The gateway's KV index: agreement with the workers, memory, evictions; the LoRA adapters it loads."""
    return Row(
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
            Panel(
                "LoRA adapters loaded by the gateway",
                (
                    Target(f"sum by (instance, result) ({rate('conductor_lora_loads_total')})", "load, {{instance}} {{result}}"),
                    Target(f"sum by (instance, result) ({rate('conductor_lora_unloads_total')})", _UNLOAD_LEGEND),
                ),
                "ops",
                width=24,
                description="lora_adapters: loads of an adapter no worker listed, on the worker a request "
                "for it went to (loaded, present: the worker held it already, failed: the request failed "
                "over or got a 502), and unloads to stay within the gateway's cap per worker. Each "
                "adapter's blocks are keyed apart in the index.",
            ),
        ),
    )


def prefix_row() -> Row:
    """Prefix reuse: hit rate, cached against computed tokens, pulls between instances."""
    cached = rate("conductor_prompt_tokens_total", 'source="cached"')
    return Row(
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
    )


def _feed_panels() -> tuple[Panel, ...]:
    """Each engine's KV event feed: configured, flowing, late, gapped, rejected, the blocks it moves."""
    return (
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
            "KV event messages rejected",
            (Target(f"sum by (instance, reason) ({rate('conductor_kv_events_rejected_total')})", "{{instance}} {{reason}}"),),
            "ops",
            width=8,
            description="Messages from an engine's KV event feed dropped unapplied, by reason (bad "
            "frames, oversize, undecodable, invalid events, an implausible sequence jump); their sequence "
            "numbers are not acted on. Above 0: a faulty or forged publisher on that endpoint.",
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
    )


def _match_panels() -> tuple[Panel, ...]:
    """Whether the index matches the engines: sequence numbers, hashes, agreement, alarms, prompt lengths."""
    return (
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
    )


def _canary_panels() -> tuple[Panel, ...]:
    """The KV canary's verdicts (conductor/kv/canary.py): which engines' events are trusted."""
    return (
        Panel(
            "KV canary: instances kept out of KV-aware placement",
            (
                Target(f"max ({sel('conductor_kv_canary_unverified')})", "unverified"),
                Target(f"max by (instance) ({sel('conductor_kv_canary_excluded')})", "{{instance}} excluded"),
            ),
            "short",
            width=8,
            description="Instances whose KV events have not checked out (canary pending or failed: block size, "
            "hash seed or algorithm, tokenizer, no events). Their cached prefixes are ignored until they do; "
            "GET /ready (kv_canary) and the gateway's log name the setting to fix.",
        ),
        Panel(
            "KV canary verdicts",
            (Target(f"sum by (instance, result) ({rate('conductor_kv_canary_total')})", "{{instance}} {{result}}"),),
            "ops",
            width=8,
            description="Canary runs by verdict: at an instance's join and after an engine restart "
            "(its event sequence went back, or a gap could not be replayed).",
        ),
        Panel(
            "KV canary time to verdict p90",
            (Target(quantile(0.9, "conductor_kv_canary_seconds"), "p90"),),
            "s",
            width=8,
            description="From an instance's join or restart to its canary's verdict; "
            "kv.canary_timeout_s bounds a run whose events never come.",
        ),
    )


def kv_events_row() -> Row:
    """The gateway's view of each prefill/mixed engine's KV event feed and of how well its index matches."""
    return Row("KV cache events (gateway view)", (*_feed_panels(), *_canary_panels(), *_match_panels()))


def worker_row() -> Row:
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
