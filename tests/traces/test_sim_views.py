"""The simulator's fast view builders make exactly what the frozen dataclasses' constructors make."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from conductor.core.types import (
    ActiveDecode,
    CachedPrefix,
    ClusterSnapshot,
    InstanceView,
    Observation,
    QueuedPrefill,
    RequestView,
    Role,
    Slo,
)
from traces.sim.views import (
    active_decode,
    cluster_snapshot,
    instance_view,
    observation,
    queued_prefill,
    request_view,
)


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a))  # type: ignore[arg-type]


def test_views_equal_the_dataclass_built_ones_field_for_field() -> None:
    q = (QueuedPrefill(100, 20, 0.5), QueuedPrefill(7, 0, 0.0))
    d = (ActiveDecode(300, 12), ActiveDecode(50, 9, decoding=False))
    built = instance_view("decode-3", Role.DECODE, q, d, 1000, 0.25, 4)
    plain = InstanceView(
        id="decode-3", role=Role.DECODE, prefill_queue=q, decodes=d, kv_capacity_tokens=1000, kv_usage=0.25, waiting_requests=4
    )
    assert _same(built, plain) and built == plain and hash(built) == hash(plain)
    assert _same(instance_view("prefill-0", Role.PREFILL), InstanceView("prefill-0", Role.PREFILL))
    assert _same(active_decode(300, 12), ActiveDecode(300, 12))
    assert _same(active_decode(5, 1, False), ActiveDecode(5, 1, decoding=False))
    assert _same(queued_prefill(100, 20, 0.5), QueuedPrefill(100, 20, 0.5))
    assert built.resident_kv_tokens == 350 and built.queued_prefill_tokens == 107


def test_views_stay_frozen() -> None:
    view = instance_view("p", Role.PREFILL)
    with pytest.raises(FrozenInstanceError):
        view.id = "q"  # type: ignore[misc]


def test_request_snapshot_and_observation_equal_the_dataclass_built_ones() -> None:
    cached = {"prefill-1": CachedPrefix(1024)}
    slo = Slo(ttft_s=30.0, tbt_s=0.1)
    built = request_view("r7", 7, "m", 3000, 200, 512, (1, 2, 3), cached, 512, slo)
    plain = RequestView(
        request_id="r7",
        seq=7,
        model="m",
        prompt_tokens=3000,
        max_tokens=200,
        block_size=512,
        block_keys=(1, 2, 3),
        cached=cached,
        store_cached_tokens=512,
        slo=slo,
        stream=True,
    )
    assert _same(built, plain) and built == plain and plain.pull_sources is None
    views = (instance_view("prefill-0", Role.PREFILL), instance_view("decode-0", Role.DECODE))
    assert _same(cluster_snapshot(1.5, views), ClusterSnapshot(now=1.5, instances=views))
    kw = {
        "request_id": "r7",
        "prefill": "prefill-0",
        "decode": "decode-0",
        "prompt_tokens": 3000,
        "cached_tokens": 1024,
        "predicted_cached_tokens": 512,
        "queue_and_prefill_s": 0.5,
        "ttft_s": 0.7,
        "token_intervals_s": (0.02, 0.02),
        "output_tokens": 3,
        "decode_batch": 4,
        "decode_resident_kv_tokens": 9000,
    }
    assert _same(observation(**kw), Observation(**kw))  # type: ignore[arg-type]
    failed = {
        "request_id": "r8",
        "prefill": "prefill-0",
        "decode": "decode-0",
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "predicted_cached_tokens": 0,
        "queue_and_prefill_s": None,
        "ttft_s": None,
        "ok": False,
    }
    assert _same(observation(**failed), Observation(**failed))  # type: ignore[arg-type]
    with pytest.raises(FrozenInstanceError):
        built.seq = 8  # type: ignore[misc]
