"""Helpers shared by the built-in policies."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

from conductor.core.types import (
    CandidateScore,
    ClusterSnapshot,
    Decision,
    InstanceView,
    Observation,
    Rejection,
    RequestView,
    Role,
)

NO_INSTANCE = "no_instance"


_OS_RANDOM = random.SystemRandom()  # holds no state of ours: every draw reads the OS


class BasePolicy:
    """Policies that remember nothing: `on_decided` and `observe` do nothing."""

    name = "base"

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        return None

    def observe(self, observation: Observation) -> None:
        return None


def request_rng(seed: int | None, request: RequestView, draw: int = 0) -> random.Random:
    """Random draws for this request alone, so `decide` stays a function of its arguments: the same
    seed, request (its gateway sequence number) and `draw` (which of the decision's random choices)
    give the same result, in the gateway and in the simulator alike. `seed=None` draws from the OS.
    Building one costs a few microseconds: policies build it only when a choice is random."""
    if seed is None:
        return _OS_RANDOM
    return random.Random(hash((seed, request.seq, draw)))  # ints hash the same in every process


def no_instance(request: RequestView, policy: str, role: Role) -> Decision:
    """A decision that says no healthy instance of `role` can take the request (HTTP 503)."""
    return Decision(
        request_id=request.request_id,
        policy=policy,
        rejection=Rejection(reason=NO_INSTANCE, message=f"no healthy {role.value} instance", retry_after_s=5.0),
    )


def pools(cluster: ClusterSnapshot) -> tuple[tuple[InstanceView, ...], tuple[InstanceView, ...], bool]:
    """(prefill-capable, decode, disaggregated): mixed workers form the first pool when no P/D."""
    prefill = cluster.by_role(Role.PREFILL)
    decode = cluster.by_role(Role.DECODE)
    if prefill or decode:
        return prefill, decode, True
    return cluster.by_role(Role.MIXED), (), False


def missing_pool(
    request: RequestView,
    policy: str,
    prefill: Sequence[InstanceView],
    decode: Sequence[InstanceView],
    disaggregated: bool,
) -> Decision | None:
    """The 503 decision when a pool the request needs is empty, else None."""
    if not prefill:
        return no_instance(request, policy, Role.PREFILL if disaggregated else Role.MIXED)
    if disaggregated and not decode:
        return no_instance(request, policy, Role.DECODE)
    return None


def listed_indices(scores: Sequence[float], limit: int | None, chosen: int) -> list[int]:
    """Which of a pool's candidates a decision lists, in pool order: the `limit` lowest `scores`
    (the first of equals) and the `chosen` one; all of them when `limit` is None or not below the
    pool's size."""
    if limit is None or len(scores) <= limit:
        return list(range(len(scores)))
    if limit == 1:  # the simulator's setting: nsmallest(1, ...) is this min() with a heap's overhead
        best, low = 0, scores[0]  # min(range(len(scores)), key=scores.__getitem__), the first of equals
        for i in range(1, len(scores)):
            if scores[i] < low:
                best, low = i, scores[i]
        if best == chosen:
            return [best]
        return [best, chosen] if best < chosen else [chosen, best]
    return sorted({*heapq.nsmallest(limit, range(len(scores)), key=scores.__getitem__), chosen})


def local_prefix(request: RequestView, instance_id: str) -> int:
    """Leading prompt tokens an instance holds in its own memory (device or host tier)."""
    p = request.cached.get(instance_id)
    return 0 if p is None or p.tier.value == "store" else min(p.tokens, request.prompt_tokens)


def decided(
    request: RequestView,
    policy: str,
    prefill: str,
    decode: str | None,
    candidates: tuple[CandidateScore, ...] = (),
    rejection: Rejection | None = None,
    unlisted: int = 0,
) -> Decision:
    if rejection is not None:
        return Decision(
            request_id=request.request_id, policy=policy, rejection=rejection, candidates=candidates, unlisted_candidates=unlisted
        )
    return Decision(
        request_id=request.request_id,
        policy=policy,
        prefill=prefill,
        decode=decode,
        candidates=candidates,
        unlisted_candidates=unlisted,
    )


def check_listed(listed_candidates: int | None) -> int | None:
    """A policy's `listed_candidates` option, checked: how many instances of each pool a decision
    lists in `candidates` (the best this many by score and the chosen one, see listed_indices),
    None for all of them (the default: the decision log shows every instance weighed)."""
    if listed_candidates is not None and listed_candidates < 1:
        raise ValueError(f"listed_candidates must be at least 1 or None, not {listed_candidates!r}")
    return listed_candidates
