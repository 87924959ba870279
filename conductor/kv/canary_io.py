"""The KV canary's requests to a worker and its metrics (the runs: conductor/kv/canary.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


async def served_model(client: httpx.AsyncClient, url: str) -> str | None:
    """The first model the worker's /v1/models lists (its base model), None when it lists none."""
    reply = await client.get(url.rstrip("/") + "/v1/models")
    data = reply.json().get("data") if reply.status_code == 200 else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    return None


async def complete(
    client: httpx.AsyncClient,
    url: str,
    model: str | None,
    prompt: Sequence[int] | str,
    usage: dict[str, Any] | None = None,
) -> None:
    """One completion of one token; `usage` gets the answer's usage. Anything but a 200 raises."""
    body: dict[str, Any] = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "max_tokens": 1, "temperature": 0}
    if model is not None:
        body["model"] = model
    reply = await client.post(url.rstrip("/") + "/v1/completions", json=body)
    if reply.status_code != 200:
        raise httpx.HTTPStatusError(f"status {reply.status_code}: {reply.text[:120]}", request=reply.request, response=reply)
    if usage is not None:
        got = reply.json().get("usage")
        if isinstance(got, dict):
            usage.update(got)


class CanaryMetrics:
    """conductor_kv_canary_total{instance,result}, conductor_kv_canary_unverified,
    conductor_kv_canary_excluded{instance}, conductor_kv_canary_seconds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs = Counter(
            "conductor_kv_canary",
            "KV canary runs by instance and result (verified, block_size, hash_algo, hash_seed, extra_keys, "
            "tokenizer, no_events, unreachable, late_start)",
            ["instance", "result"],
            registry=registry,
        )
        self.unverified = Gauge(
            "conductor_kv_canary_unverified",
            "Instances whose KV events are not verified (canary pending or failed): kept out of KV-aware placement",
            registry=registry,
        )
        self.excluded = Gauge(
            "conductor_kv_canary_excluded",
            "1 while the instance is kept out of KV-aware placement by its KV canary",
            ["instance"],
            registry=registry,
        )
        self.seconds = Histogram(
            "conductor_kv_canary_seconds",
            "From an instance's join or restart to its KV canary's verdict",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )

    def forget(self, instance: str, results: Sequence[str]) -> None:
        for result in results:
            try:
                self.runs.remove(instance, result)
            except KeyError:
                pass
        try:
            self.excluded.remove(instance)
        except KeyError:
            pass
