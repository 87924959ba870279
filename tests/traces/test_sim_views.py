"""The simulator's fast view builders make exactly what the frozen dataclasses' constructors make."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role
from traces.sim.views import active_decode, instance_view, queued_prefill


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a))  # type: ignore[arg-type]


def test_views_equal_the_dataclass_built_ones_field_for_field() -> None:
    q = (QueuedPrefill(100, 20, 0.5), QueuedPrefill(7, 0, 0.0))
    d = (ActiveDecode(300, 12), ActiveDecode(50, 9, decoding=False))
    built = instance_view("decode-3", Role.DECODE, q, d, 1000, 0.25, 4)
    plain = InstanceView(id="decode-3", role=Role.DECODE, prefill_queue=q, decodes=d, kv_capacity_tokens=1000,
                         kv_usage=0.25, waiting_requests=4)
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
