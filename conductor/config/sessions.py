"""The `sessions:` settings section: where a request names the session (conversation, agent run) it belongs to.

    sessions:
      header: x-session-id     # the session header, read first
      from_user: true          # else `prompt_cache_key`, else the body's `user` (false: `user` is not read)
      max_key_chars: 256       # a longer key is a 400 naming where it came from

A request's session key (conductor/routing/sessions.py): the header, else the body's `prompt_cache_key`
(OpenAI's field for exactly this), else its `user` where `from_user` allows. The key is hashed (with the
tenant) into a bounded integer before anything keeps it; the policy may then keep the session's turns
and an agent's parallel calls on the instance that served its last turn (kvcache_aware's
`session_affinity`). `enabled: false` reads nothing: every request is session-less, as before.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["SessionSettings"]

_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")


class SessionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    header: str = Field(default="x-session-id", min_length=1)
    # `user` names a person, who may run several conversations at once: operators whose clients set
    # `user` but not a session key may not want those conversations pinned together
    from_user: bool = True
    # a key is hashed anyway; the bound keeps a client from making the gateway hash megabytes
    max_key_chars: int = Field(default=256, ge=1, le=4096)

    @field_validator("header")
    @classmethod
    def _plain_header(cls, value: str) -> str:
        lowered = value.lower()  # ASGI servers give header names lower-cased
        if not set(lowered) <= _HEADER_CHARS:
            raise ValueError(f"sessions.header: {value!r} is not a plain header name (letters, digits, '-', '_')")
        return lowered
