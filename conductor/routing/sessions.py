"""A request's session key (conductor/config/sessions.py), worked out once per request by the endpoint.

In this order: the session header (`sessions.header`, `x-session-id`), else the body's `prompt_cache_key`
(OpenAI's field for routing requests that share a prefix together), else the body's `user` (when
`sessions.from_user`). The key found is hashed with the request's tenant (xxhash64, a fixed seed) into
`RequestView.session`: the client's string is never a key of any table, two tenants' equal keys are
two sessions, and the policy's memory of a session is one integer. A key that is not a string or is
longer than `sessions.max_key_chars` is a 400 naming where it came from; an empty one names no session.

`prompt_cache_key` and `user` stay in the body and go to the worker: vLLM's OpenAI server reads
`user` and ignores `prompt_cache_key` (its request models allow extra fields and log them as
ignored); neither enters vLLM's block hashes (only `cache_salt` does), so the gateway's block keys
still match the worker's.
"""

from __future__ import annotations

from typing import Any

import xxhash

from conductor.config.sessions import SessionSettings
from conductor.core.errors import BadRequest

SEED = 0x5E55_1075  # fixed: every gateway replica and process hashes a key alike
BODY_FIELDS = ("prompt_cache_key", "user")


class SessionKeys:
    """Names each request's session; `enabled` False when `sessions.enabled` is off."""

    __slots__ = ("_fields", "_limit", "enabled", "header")

    def __init__(self, settings: SessionSettings) -> None:
        self.enabled = settings.enabled
        self.header = settings.header
        self._fields = BODY_FIELDS if settings.from_user else BODY_FIELDS[:1]
        self._limit = settings.max_key_chars

    def read_headers(self, read: frozenset[bytes]) -> frozenset[bytes]:
        """The request headers an endpoint decodes (`read`), the session header among them when enabled."""
        return read | {self.header.encode()} if self.enabled else read

    def session_of(self, header: str | None, body: dict[str, Any], tenant: str | None) -> int | None:
        """The request's session as a bounded integer, None when it names none (or sessions are off).
        BadRequest (400) for a key that is not a string or is too long; the body is not changed."""
        if not self.enabled:
            return None
        if header is not None and header.strip():
            return self._hashed(header.strip(), self.header, tenant)
        for name in self._fields:
            value = body.get(name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise BadRequest(f"'{name}' must be a string, got {type(value).__name__}", param=name)
            if value:
                return self._hashed(value, name, tenant)
        return None

    def _hashed(self, key: str, where: str, tenant: str | None) -> int:
        if len(key) > self._limit:
            raise BadRequest(
                f"session key in {where} is {len(key)} characters long; the limit is {self._limit}",
                param=where,
                code="invalid_session",
            )
        scope = b"" if tenant is None else tenant.encode()
        return xxhash.xxh64_intdigest(scope + b"\0" + key.encode("utf-8", "surrogatepass"), seed=SEED)
