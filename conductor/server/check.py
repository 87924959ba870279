"""`conductor serve --check [--probe]`: the configuration checked as start-up checks it, without
binding a port, opening a socket or starting a task.

What is checked is what `conductor serve` would otherwise find only while starting: the settings
(every field and its cross-checks), the instance list, `--workers` against `--admin-port`, the policy
and its options (loaded, as at start-up), the P/D protocol and what it needs (a Mooncake schema, a
decode that can prefill for local_prefill_tokens, NIXL for peer pulls), the key files, and the KV
settings (the key scheme and hash algorithm, a tokenizer directory loaded, KV event endpoints that
parse and name known instances). Exit 0 with a one-line summary, 2 with the one-line error; with
`--probe` every worker is reached too (conductor/server/probe.py), one line each, exit 1 if a check
of one failed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TextIO

from adapters.pd import make_protocol
from conductor.config.derived import kv_settings, peer_pull_possible
from conductor.config.kv import KVAwarenessSettings
from conductor.config.settings import Settings
from conductor.core.block_keys import make_scheme
from conductor.core.capabilities import local_prefill_enabled
from conductor.core.errors import ConfigError
from conductor.core.tokenization import ByteTokenizer, Tokenizer
from conductor.core.types import Role
from conductor.server.probe import endpoint_address, probe_instances
from conductor.server.serving import check_workers
from policies.registry import load_policy

EXIT_OK, EXIT_WORKER_FAILED, EXIT_CONFIG = 0, 1, 2
PREFIX = "conductor serve --check"


def check_instances(settings: Settings) -> None:
    if not settings.instances() and not settings.discovery.sources():
        raise ConfigError("no instances: give --prefill/--decode or --mixed, discovery: sources (or a --config file)")


def run_check(load: Callable[[], Settings], *, probe: bool, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Build the settings with `load`, check them (and with `probe` the workers), print the result
    (on `out` and `err`: sys.stdout and sys.stderr as they are when called)."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        settings = load()
        summary, local_tokenizer = check_config(settings)
    except ConfigError as exc:
        print(f"{PREFIX}: {' '.join(exc.message.split())}", file=err)
        return EXIT_CONFIG
    print(f"{PREFIX}: configuration ok: {summary}", file=out)
    if not probe:
        return EXIT_OK
    reports = asyncio.run(probe_instances(settings, local_tokenizer))
    for report in reports:
        print(report.line(), file=out)
    for role, source in settings.discovery.sources().items():
        print(f"discovery {role.value} ({source.name}): not probed, its instances are found at run time", file=out)
    failed = [r.name for r in reports if not r.ok]
    if failed:
        print(f"{PREFIX}: {len(failed)} of {len(reports)} instances failed a check: {', '.join(failed)}", file=out)
        return EXIT_WORKER_FAILED
    return EXIT_OK


def check_config(settings: Settings) -> tuple[str, Tokenizer | None]:
    """(the one-line summary, the tokenizer the gateway computes with itself if any); ConfigError on
    the first problem, as start-up would raise it."""
    check_instances(settings)
    check_workers(settings)
    policy = load_policy(settings.policy, settings.policy_options)
    protocol = settings.pd.protocol if settings.disaggregated else "mixed"
    make_protocol(protocol, mooncake_schema=settings.pd.mooncake_schema)  # checks the schema; opens nothing
    if local_prefill_enabled(policy) and protocol == "sglang":
        raise ConfigError(
            "local_prefill_tokens (prefills on decode instances) needs decodes that compute a request "
            "without a KV transfer (vLLM nixl or mooncake), not pd.protocol sglang"
        )
    if settings.pd.peer_pull == "on" and not peer_pull_possible(settings):
        raise ConfigError(
            "pd.peer_pull 'on' needs the gateway's token ids to be the workers' own: a model "
            "tokenizer for kv.tokenizer, or kv.forward_token_ids true"
        )
    settings.auth.client_keys(), settings.auth.admin_keys(), settings.auth.upstream_key()  # key files readable
    kv_text, local = _check_kv(settings)
    counts = {role: sum(1 for s in settings.instances() if s.role is role) for role in Role}
    found = ", ".join(f"{n} {role.value}" for role, n in counts.items())
    found += "".join(f", {role.value} by DNS" for role in settings.discovery.sources())
    extra = f", {settings.workers} processes" if settings.workers > 1 else ""
    return f"{found}; listens on {settings.host}:{settings.port}{extra}; pd {protocol}; policy {policy.name}; {kv_text}", local


def _check_kv(settings: Settings) -> tuple[str, Tokenizer | None]:
    if not settings.kv.enabled:
        return "KV index off (prompts estimated)", None
    kv = kv_settings(settings)
    names = {spec.name for spec in settings.instances()}
    unknown = sorted(set(kv.kv_events) - names)
    if unknown:
        raise ConfigError(f"kv.kv_events names unknown instances: {unknown}")
    try:
        make_scheme(kv.key_mode, kv.block_size, seed=kv.hash_seed, algo=kv.vllm_hash_algo, vllm_seed=kv.vllm_hash_seed)
        for ep in kv.kv_events.values():
            for endpoint in (ep.endpoint, ep.replay_endpoint):
                if endpoint is not None:
                    endpoint_address(endpoint)
    except ValueError as exc:
        raise ConfigError(f"kv: {exc}") from None
    local = _local_tokenizer(kv, settings)
    cached = [s.name for s in settings.instances() if s.role is not Role.DECODE]
    fed = sum(1 for name in cached if name in kv.kv_events)
    feeds = f"KV events from {fed} of {len(cached)} prefill/mixed instances"
    if fed < len(cached):
        feeds += " (the gateway's own dispatch records for the rest)"
    index = kv.index + (f" at {kv.redis_url}" if kv.index.startswith("redis") else "")
    index += f" at {kv.indexer_url}" if kv.index == "indexer" else ""
    return f"KV index {index}, block size {kv.block_size}, tokenizer {_tokenizer_text(kv)}, {feeds}", local


def _local_tokenizer(kv: KVAwarenessSettings, settings: Settings) -> Tokenizer | None:
    """The tokenizer the gateway computes with itself, loaded as start-up loads it; None for a worker's."""
    if kv.tokenizer == "builtin":
        return ByteTokenizer()
    if kv.tokenizer in ("auto", "worker"):
        prefill_capable = any(s.role is not Role.DECODE for s in settings.instances())
        if kv.tokenizer == "worker" and not kv.tokenizer_url and not prefill_capable:
            raise ConfigError("kv.tokenizer 'worker' needs kv.tokenizer_url or a prefill/mixed instance")
        return None
    from adapters.tokenizers import HFTokenizer  # the tokenizers library, only for a directory

    try:
        return HFTokenizer(kv.tokenizer)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  # a broken tokenizer.json: what start-up would die of
        raise ConfigError(f"kv.tokenizer {kv.tokenizer}: cannot load it: {type(exc).__name__}: {exc}") from None


def _tokenizer_text(kv: KVAwarenessSettings) -> str:
    if kv.tokenizer == "auto":
        where = kv.tokenizer_url or "the prefill/mixed workers"
        return f"auto (the /tokenize of {where}; the built-in one where none is served)"
    if kv.tokenizer == "worker":
        return f"worker (the /tokenize of {kv.tokenizer_url or 'the first prefill/mixed worker'})"
    return kv.tokenizer
