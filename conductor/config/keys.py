"""API keys a route accepts, checked in constant time.

A client proves itself with `Authorization: Bearer <key>`. The scheme name is case-insensitive
(RFC 7235 section 2.1: "bearer" and "BEARER" are "Bearer"), and any run of spaces may separate it
from the key. The key is compared with every accepted key, each comparison `hmac.compare_digest`
over SHA-256 digests, all of them every time: how long a check takes says neither which key nor
how many leading characters matched (comparing the digests also hides the keys' lengths, which
compare_digest alone would not). A set lookup, as before, hashed and compared the presented key
with the stored one byte by byte and stopped at the first difference.

A key may have an owner (`auth.tenants`: the tenant it belongs to): `check` answers it, found in
the same pass over every key, so which tenant a key is changes nothing of the time taken either.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

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
    """The keys one kind of route accepts; with none, every request is let through. `owners`: key ->
    the name `check` answers for it (a tenant); a key of `owners` not in `keys` is accepted too."""

    def __init__(self, keys: Iterable[str], *, what: str = "API key", owners: Mapping[str, str] | None = None) -> None:
        owners = owners or {}
        listed = list(dict.fromkeys([*keys, *owners]))
        self._digests = tuple(_digest(key) for key in listed)
        # index + 1 of each key's owner in _names (0: none); a plain key list leaves this all zeros
        self._names: tuple[str | None, ...] = (None, *dict.fromkeys(owners.values()))
        self._owner_of = tuple(self._names.index(owners[key]) if key in owners else 0 for key in listed)
        self.what = what  # named in the 401 messages: "API key", "admin API key"

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the keys. Every key is compared, matched or not, so the time
        taken is the same for every wrong token and for the right one wherever it is listed."""
        return self._match(token) >= 0

    def _match(self, token: str) -> int:
        """The index in _names of the owner of `token` (0: a key without one), -1 when it is no key;
        every key compared, the owner picked by arithmetic rather than a branch on the match."""
        presented = _digest(token)
        matched = False
        owner = 0
        for digest, index in zip(self._digests, self._owner_of, strict=True):
            same = hmac.compare_digest(presented, digest)
            matched |= same
            owner += index * same  # keys are distinct: at most one term is not 0
        return owner if matched else -1

    def check(self, authorization: str | None) -> str | None:
        """The owner of the header's key (None: a key without one, or no key configured); 401 when
        keys are configured and the header carries none of them."""
        if not self._digests:
            return None
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized(f"missing {self.what}: send 'Authorization: Bearer <key>'")
        owner = self._match(token)
        if owner < 0:
            raise Unauthorized(f"invalid {self.what}")
        return self._names[owner]
