"""Scheduling policies: pure functions of (RequestView, ClusterSnapshot) -> Decision."""

# the policy the docs and `conductor` recommend: KVCache-centric, SLO-aware (FAST'25 Algorithm 1)
RECOMMENDED_POLICY = "kvcache_aware"
