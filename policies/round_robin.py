"""Round robin over healthy prefill and decode instances: what vLLM's example proxies and
vllm-router do by default. Stateless: it rotates on the request's gateway sequence number."""

from __future__ import annotations

from conductor.core.types import ClusterSnapshot, Decision, RequestView, Role
from policies.base import BasePolicy, no_instance


class RoundRobinPolicy(BasePolicy):
    name = "round_robin"

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill = cluster.by_role(Role.PREFILL)
        decode = cluster.by_role(Role.DECODE)
        if cluster.by_role(Role.PREFILL, Role.DECODE, healthy_only=False):
            if not prefill or not decode:
                return no_instance(request, self.name, Role.PREFILL if not prefill else Role.DECODE)
            return Decision(
                request_id=request.request_id,
                policy=self.name,
                prefill=prefill[request.seq % len(prefill)].id,
                decode=decode[request.seq % len(decode)].id,
            )
        mixed = cluster.by_role(Role.MIXED)
        if not mixed:
            return no_instance(request, self.name, Role.MIXED)
        return Decision(request_id=request.request_id, policy=self.name, prefill=mixed[request.seq % len(mixed)].id)
