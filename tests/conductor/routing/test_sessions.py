"""A request's session key (conductor/routing/sessions.py): header, then prompt_cache_key, then user; a 400
naming the field for a key that is not a string or is too long; the key hashed with the tenant, never kept."""

from __future__ import annotations

import pytest
import xxhash

from conductor.config.sessions import SessionSettings
from conductor.config.settings import Settings
from conductor.core.errors import BadRequest
from conductor.routing.sessions import SEED, SessionKeys

KEYS = SessionKeys(SessionSettings())


def test_the_header_then_prompt_cache_key_then_user() -> None:
    body = {"prompt_cache_key": "conv-1", "user": "alice"}
    by_header = KEYS.session_of("conv-9", body, None)
    by_key = KEYS.session_of(None, body, None)
    by_user = KEYS.session_of(None, {"user": "alice"}, None)
    assert len({by_header, by_key, by_user}) == 3
    assert by_key == KEYS.session_of(None, {"prompt_cache_key": "conv-1"}, None)  # user does not matter then
    assert by_header == KEYS.session_of("  conv-9 ", {}, None)  # a header's spaces are not part of it
    assert KEYS.session_of(None, {}, None) is None
    assert KEYS.session_of("", {"prompt_cache_key": ""}, None) is None  # empty names no session
    no_user = SessionKeys(SessionSettings(from_user=False))
    assert no_user.session_of(None, {"user": "alice"}, None) is None
    assert no_user.session_of(None, {"user": 5}, None) is None  # not read: the worker judges it
    off = SessionKeys(SessionSettings(enabled=False))
    assert off.session_of("conv-9", body, None) is None and off.read_headers(frozenset()) == frozenset()
    assert KEYS.read_headers(frozenset()) == {b"x-session-id"}
    assert body == {"prompt_cache_key": "conv-1", "user": "alice"}  # left in the body for the worker


def test_the_key_is_a_bounded_hash_scoped_by_tenant_never_the_string() -> None:
    key = "conversation-" + "x" * 200
    session = KEYS.session_of(key, {}, "team-a")
    assert isinstance(session, int) and 0 <= session < 2**64
    assert session == xxhash.xxh64_intdigest(b"team-a\0" + key.encode(), seed=SEED)
    assert session != KEYS.session_of(key, {}, "team-b") != KEYS.session_of(key, {}, None)
    assert SessionKeys(SessionSettings()).session_of(key, {}, "team-a") == session  # every process alike


@pytest.mark.parametrize(
    ("header", "body", "param"),
    [
        (None, {"prompt_cache_key": 12}, "prompt_cache_key"),
        (None, {"prompt_cache_key": ["a"]}, "prompt_cache_key"),
        (None, {"user": {"id": 1}}, "user"),
        ("k" * 257, {}, "x-session-id"),
        (None, {"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        (None, {"user": "u" * 1000}, "user"),
    ],
)
def test_a_key_that_is_not_a_string_or_too_long_is_a_400_naming_it(header: str | None, body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        KEYS.session_of(header, body, None)
    assert caught.value.param == param and caught.value.status == 400


def test_the_settings_group() -> None:
    settings = Settings.model_validate({"sessions": {"header": "X-Conversation", "max_key_chars": 16}})
    assert settings.sessions.header == "x-conversation"
    keys = SessionKeys(settings.sessions)
    assert keys.session_of(None, {"prompt_cache_key": "k" * 16}, None) is not None
    with pytest.raises(BadRequest):
        keys.session_of(None, {"prompt_cache_key": "k" * 17}, None)
    for bad in ({"header": "x session"}, {"max_key_chars": 0}, {"sticky": True}):
        with pytest.raises(ValueError, match="sessions"):
            Settings.model_validate({"sessions": bad})
