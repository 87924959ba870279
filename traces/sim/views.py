"""Building the frozen view values the simulator hands to policies, at the rate it needs them.

The engine rebuilds every decode instance's `InstanceView` (with its streams' `ActiveDecode`
entries) and every running prefill's (with its head's `QueuedPrefill`) at nearly every arrival:
the refresh interval (0.1 s) is shorter than the trace's time between arrivals, and a decoding
stream's entry moves with every token. A frozen slotted dataclass's generated `__init__` sets each
field through `object.__setattr__` by name and handles defaults, which for InstanceView's nine
fields costs about twice what storing them does. These builders make the same objects (equal to
the dataclass-built ones, field for field: tested in tests/traces/test_sim_views.py) by storing
each slot through its descriptor.

They check, once at import, that the classes still have exactly the fields written here, so a
field added to conductor/core/types.py fails loudly instead of being left unset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role

_VIEW_FIELDS = ("id", "role", "url", "healthy", "prefill_queue", "decodes", "kv_capacity_tokens", "kv_usage",
                "waiting_requests")
_DECODE_FIELDS = ("context_tokens", "remaining_tokens", "decoding")
_QUEUED_FIELDS = ("new_tokens", "cached_tokens", "elapsed_s")


def _setters(cls: type, expected: tuple[str, ...]) -> list[Callable[[object, object], None]]:
    names = tuple(f.name for f in fields(cls))
    if names != expected:
        raise RuntimeError(f"{cls.__name__} has fields {names}, traces/sim/views.py builds {expected}")
    return [cls.__dict__[name].__set__ for name in names]


_new = object.__new__
_v_id, _v_role, _v_url, _v_healthy, _v_queue, _v_decodes, _v_kv_cap, _v_kv_usage, _v_waiting = _setters(
    InstanceView, _VIEW_FIELDS
)
_d_context, _d_remaining, _d_decoding = _setters(ActiveDecode, _DECODE_FIELDS)
_q_new, _q_cached, _q_elapsed = _setters(QueuedPrefill, _QUEUED_FIELDS)


def instance_view(
    instance_id: str,
    role: Role,
    prefill_queue: tuple[QueuedPrefill, ...] = (),
    decodes: tuple[ActiveDecode, ...] = (),
    kv_capacity_tokens: int | None = None,
    kv_usage: float | None = None,
    waiting_requests: int | None = None,
) -> InstanceView:
    """InstanceView(id=instance_id, role=role, ...) of a healthy instance without a URL."""
    view: InstanceView = _new(InstanceView)
    _v_id(view, instance_id)
    _v_role(view, role)
    _v_url(view, "")
    _v_healthy(view, True)
    _v_queue(view, prefill_queue)
    _v_decodes(view, decodes)
    _v_kv_cap(view, kv_capacity_tokens)
    _v_kv_usage(view, kv_usage)
    _v_waiting(view, waiting_requests)
    return view


def active_decode(context_tokens: int, remaining_tokens: int, decoding: bool = True) -> ActiveDecode:
    """ActiveDecode(context_tokens, remaining_tokens, decoding)."""
    entry: ActiveDecode = _new(ActiveDecode)
    _d_context(entry, context_tokens)
    _d_remaining(entry, remaining_tokens)
    _d_decoding(entry, decoding)
    return entry


def queued_prefill(new_tokens: int, cached_tokens: int, elapsed_s: float) -> QueuedPrefill:
    """QueuedPrefill(new_tokens, cached_tokens, elapsed_s)."""
    entry: QueuedPrefill = _new(QueuedPrefill)
    _q_new(entry, new_tokens)
    _q_cached(entry, cached_tokens)
    _q_elapsed(entry, elapsed_s)
    return entry
