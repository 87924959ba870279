"""API keys a route accepts, checked in constant time.

A client proves itself with `Authorization: Bearer <key>`. The scheme name is case-insensitive
(RFC 7235 section 2.1: "bearer" and "BEARER" are "Bearer"), and any run of spaces may separate it
from the key. The key is compared with every accepted key, each comparison `hmac.compare_digest`
over SHA-256 digests, all of them every time: how long a check takes says neither which key nor
how many leading characters matched (comparing the digests also hides the keys' lengths, which
compare_digest alone would not). A set lookup, as before, hashed and compared the presented key
with the stored one byte by byte and stopped at the first difference.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from conductor.core.errors import Unauthorized

SCHEME = "bearer"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, whatever the scheme's case; None
    when the header is missing, names another scheme or carries no token."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != SCHEME or not token:
        return None
    return token


class ApiKeys:
    """The keys one kind of route accepts; with none, every request is let through."""

    def __init__(self, keys: Iterable[str], *, what: str = "API key") -> None:
        self._digests = tuple(_digest(key) for key in keys)
        self.what = what  # named in the 401 messages: "API key", "admin API key"

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the keys. Every key is compared, matched or not, so the time
        taken is the same for every wrong token and for the right one wherever it is listed."""
        presented = _digest(token)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched

    def check(self, authorization: str | None) -> None:
        """Nothing when no key is configured or the header carries one of them; else 401."""
        if not self._digests:
            return
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized(f"missing {self.what}: send 'Authorization: Bearer <key>'")
        if not self.accepts(token):
            raise Unauthorized(f"invalid {self.what}")
