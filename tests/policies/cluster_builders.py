"""Small builders for cluster snapshots and requests used by the policy tests."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

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
    """A request; its gateway sequence number follows from its id (policies draw randomness per request)."""
    prefixes = {k: v if isinstance(v, CachedPrefix) else CachedPrefix(v) for k, v in (cached or {}).items()}
    seq = zlib.crc32(rid.encode())
    return RequestView(rid, seq, "m", prompt, 128, cached=prefixes, slo=slo or Slo(), store_cached_tokens=store)


def snapshot(*instances: InstanceView) -> ClusterSnapshot:
    return ClusterSnapshot(now=100.0, instances=instances)


def routed(policy: Policy, req: RequestView, cluster: ClusterSnapshot) -> Decision:
    """Decide as the gateway and the simulator do: `decide`, then `on_decided` with its result."""
    decision = policy.decide(req, cluster)
    policy.on_decided(req, cluster, decision)
    return decision
