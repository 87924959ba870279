"""The bounds on hostile bytes are settings, and the settings reach the parts that enforce them: the
upstream pool (a worker's answer), the HTTP server (a client's connections, pipelining, body time)
and every KV-event subscriber (a publisher's messages). The enforcement itself is tested in
tests/adapters (test_http1_limits, test_http1_server_limits, test_kv_events_bounds)."""

from __future__ import annotations

from adapters.http1 import ResponseLimits
from adapters.http1_server_limits import ServerLimits
from conductor.config.settings import Settings
from conductor.gateway import Gateway
from conductor.server.serving import uvicorn_config

LIMITS = {
    "max_upstream_head_bytes": 4096,
    "max_upstream_headers": 17,
    "max_upstream_body_bytes": 123_456,
    "max_client_connections": 9,
    "max_pipelined_requests": 3,
}
EVENTS = {
    "events_max_message_bytes": 65_536,
    "events_max_seq_jump": 77,
    "events_slice_blocks": 5,
    "events_log_interval_s": 2.5,
}


def _settings() -> Settings:
    return Settings(
        mixed=[{"url": "http://127.0.0.1:9", "role": "mixed", "name": "mixed-0", "kv_events_endpoint": "tcp://127.0.0.1:25557"}],
        policy="round_robin",
        limits=LIMITS,
        timeouts={"request_body_s": 4.5},
        kv={"enabled": True, "tokenizer": "builtin", **EVENTS},
    )


async def test_the_upstream_pool_and_the_server_get_the_configured_limits() -> None:
    settings = _settings()
    gateway = Gateway(settings)
    try:
        assert gateway.pool.limits == ResponseLimits(head_bytes=4096, headers=17, body_bytes=123_456)
        http = uvicorn_config(settings, gateway).http
        assert isinstance(http, type)
        assert http.limits == ServerLimits(max_connections=9, body_timeout_s=4.5, max_pipelined=3)  # type: ignore[attr-defined]
    finally:
        await gateway.close()


async def test_every_kv_event_subscriber_gets_the_configured_bounds() -> None:
    gateway = Gateway(_settings())
    try:
        subscribers = gateway.analyzer.subscribers  # type: ignore[attr-defined]
        assert subscribers, "the instance's KV events endpoint gives a subscriber"
        for sub in subscribers:
            assert (sub._max_message_bytes, sub._max_seq_jump, sub._slice_blocks) == (65_536, 77, 5)
            assert sub._log.interval_s == 2.5
    finally:
        await gateway.close()


def test_the_defaults_bound_everything() -> None:
    s = Settings()
    assert s.limits.max_upstream_body_bytes == 64 * 1024 * 1024 and s.limits.max_upstream_head_bytes == 64 * 1024
    assert s.limits.max_client_connections > 0 and s.limits.max_pipelined_requests > 0
    assert s.timeouts.request_body_s > 0
    assert s.kv.events_max_message_bytes == 32 * 1024 * 1024 and s.kv.events_slice_blocks > 0
