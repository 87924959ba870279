"""Small builders for cluster snapshots and requests used by the policy tests."""

from __future__ import annotations

from collections.abc import Mapping

from policies.types import (
    ActiveDecode,
    CachedPrefix,
    ClusterSnapshot,
    InstanceView,
    QueuedPrefill,
    RequestView,
    Role,
    Slo,
)


def prefill(iid: str, queued: int = 0, tokens: int = 8000) -> InstanceView:
    """A prefill instance with `queued` prefills of `tokens` uncached tokens waiting."""
    return InstanceView(iid, Role.PREFILL, prefill_queue=tuple(QueuedPrefill(tokens, 0, 0.0) for _ in range(queued)))


def decode(iid: str, streams: int = 0, context: int = 2000, remaining: int = 200) -> InstanceView:
    return InstanceView(iid, Role.DECODE, decodes=tuple(ActiveDecode(context, remaining) for _ in range(streams)))


def request(
    prompt: int = 8192,
    cached: Mapping[str, int | CachedPrefix] | None = None,
    slo: Slo | None = None,
    store: int = 0,
    rid: str = "r1",
) -> RequestView:
    prefixes = {k: v if isinstance(v, CachedPrefix) else CachedPrefix(v) for k, v in (cached or {}).items()}
    return RequestView(rid, 1, "m", prompt, 128, cached=prefixes, slo=slo or Slo(), store_cached_tokens=store)


def snapshot(*instances: InstanceView) -> ClusterSnapshot:
    return ClusterSnapshot(now=100.0, instances=instances)
