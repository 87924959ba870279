"""A request's priority class (conductor/config/priority.py), as the endpoint works it out once per request.

In this order: the class header (`priority.header`, `x-priority`); else the body's `priority` when it is
a string (then taken out of the body: vLLM's own `priority` is an integer, and an integer is left
where it is and passed to the worker as before); else the default class of the request's tenant (the
owner of its API key, `auth.tenants.<name>.priority`); else `priority.default`. A class named in the
request that is not one of `priority.classes` is a 400 that lists them. With no classes configured
nothing is read and nothing changes: the class is None, a string `priority` goes to the worker as
before (which refuses it, as today).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conductor.config.priority import PrioritySettings
from conductor.core.errors import BadRequest

BODY_FIELD = "priority"


class Classifier:
    """Names each request's class; `enabled` False when no class is configured."""

    __slots__ = ("_default", "_known", "_names", "_tenant_default", "enabled", "header")

    def __init__(self, priority: PrioritySettings, tenant_classes: Mapping[str, str | None]) -> None:
        self.enabled = priority.enabled
        self.header = priority.header
        self._known = frozenset(priority.classes)
        self._names = ", ".join(priority.names())
        self._default = priority.default
        # tenant -> its default class, for the tenants that set one
        self._tenant_default = {tenant: cls for tenant, cls in tenant_classes.items() if cls is not None}

    def read_headers(self, read: frozenset[bytes]) -> frozenset[bytes]:
        """The request headers an endpoint decodes (`read`), the class header among them where classes are configured."""
        return read | {self.header.encode()} if self.enabled else read

    def classify(self, header: str | None, body: dict[str, Any], tenant: str | None) -> str | None:
        """The request's class (None when no class is configured); a string `priority` is removed
        from `body`. BadRequest (400) when the header or the body names a class that is not one."""
        if not self.enabled:
            return None
        named = body.get(BODY_FIELD)
        if isinstance(named, str):
            del body[BODY_FIELD]  # the gateway's class, not vLLM's integer: the worker would refuse it
        else:
            named = None
        if header is not None:
            return self._known_class(header.strip(), self.header)
        if named is not None:
            return self._known_class(named, BODY_FIELD)
        if tenant is not None:
            return self._tenant_default.get(tenant, self._default)
        return self._default

    def _known_class(self, name: str, where: str) -> str:
        if name not in self._known:
            raise BadRequest(
                f"unknown priority class {name[:64]!r} in {where}; the classes are: {self._names}",
                param=where,
                code="invalid_priority",
            )
        return name
