"""A third-party policy: always the healthy instance whose id sorts last (easy to recognise)."""

from __future__ import annotations

from conductor.core.types import ClusterSnapshot, Decision, Observation, RequestView, Role


class LastInstancePolicy:
    name = "demo_last"

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.observed = 0
        self.decided = 0

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill = max(i.id for i in cluster.by_role(Role.PREFILL))
        decode = max(i.id for i in cluster.by_role(Role.DECODE))
        return Decision(request_id=request.request_id, policy=self.name + self.tag, prefill=prefill, decode=decode)

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        self.decided += 1

    def observe(self, observation: Observation) -> None:
        self.observed += 1
