"""Default bounds on what one KV-event publisher may send, shared by their settings
(conductor/config/kv.py, `kv.events_*`) and the subscriber that enforces them (adapters/kv_events.py)."""

from __future__ import annotations

from typing import TypedDict


class EventBounds(TypedDict):
    """What one KV-event publisher may send, as adapters.kv_events.EventSubscriber's keyword arguments."""

    max_message_bytes: int
    max_seq_jump: int
    slice_blocks: int
    log_interval_s: float


DEFAULT_EVENT_BOUNDS = EventBounds(
    max_message_bytes=32 << 20,  # a vLLM batch is one engine step's blocks: a few MB at most
    max_seq_jump=10_000,  # vLLM's default buffer_steps: a longer gap cannot be replayed anyway
    slice_blocks=4096,  # blocks applied between two turns of the event loop
    log_interval_s=10.0,  # a bad message is logged at most this often per instance (each is counted)
)
