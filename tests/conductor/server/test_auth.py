"""Client keys (conductor/config/keys.py): the Bearer scheme in any case, every key compared in
constant time; and through a real gateway."""

from __future__ import annotations

import hmac

import httpx
import pytest

from conductor.config.keys import ApiKeys, bearer_token
from conductor.core.errors import Unauthorized
from tests.support.cluster import cluster


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer sk-1", "sk-1"),  # RFC 7235: the scheme is case-insensitive
        ("BEARER   sk-1 ", "sk-1"),
        ("Basic c2stMQ==", None),
        ("Bearer", None),
        ("Bearer    ", None),
        ("sk-1", None),
        ("", None),
        (None, None),
    ],
)
def test_the_bearer_token_whatever_the_schemes_case(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_keys_accept_theirs_and_refuse_the_rest() -> None:
    keys = ApiKeys(["sk-short", "sk-a-much-longer-key", "sk-ü"])
    for key in ("sk-short", "sk-a-much-longer-key", "sk-ü"):
        keys.check(f"bearer {key}")
    for wrong in ("sk-shor", "sk-short-", "SK-SHORT", "sk-a-much-longer-kez"):
        with pytest.raises(Unauthorized, match="invalid API key"):
            keys.check(f"Bearer {wrong}")
    with pytest.raises(Unauthorized, match="missing API key"):
        keys.check(None)
    ApiKeys([]).check(None)  # no keys configured: open


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A set lookup, or any() over the keys, stops early and so takes less time the sooner the
    right key is listed; each check here compares against every key, digests of equal length."""
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = ApiKeys([f"sk-{i}" * (i + 1) for i in range(5)])
    for token in ("sk-0", "sk-4" * 5, "nope"):
        compared.clear()
        keys.accepts(token)
        assert len(compared) == 5
        assert {pair for pair in compared} == {(32, 32)}  # the keys' lengths do not show either


def test_a_lower_case_bearer_passes_the_gateway() -> None:
    with cluster("nixl", models=["tiny"], auth={"api_keys": ["sk-1", "sk-2"]}) as c:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for header in ("bearer sk-2", "BEARER sk-1", "Bearer  sk-1"):
            r = httpx.post(c.url + "/v1/completions", json=body, headers={"Authorization": header}, timeout=30)
            assert r.status_code == 200, (header, r.text)
        assert httpx.get(c.url + "/v1/models", headers={"Authorization": "bearer sk-1"}).status_code == 200
        r = httpx.post(c.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-3"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
