"""A request's priority class (conductor/config/priority.py), as the endpoint works it out once per request.

In this order: the class header (`priority.header`, `x-priority`); else the body's `priority` when it is
a string (then taken out of the body: vLLM's own `priority` is an integer); else the default class of
the request's tenant (the owner of its API key, `auth.tenants.<name>.priority`); else
`priority.default`. A class named in the request that is not one of `priority.classes` is a 400 that
lists them. With no classes configured no class is read: the class is None.

The engine's priority (`engine_priority`, once the request is routed): the body loses any `priority`
of the client's, whatever its type (vLLM's lax parsing reads "-5" and -5.0 as -5), and the request
carries its class's `engine_priority` (else the client's integer, where
`priority.trust_client_engine_priority` allows it), which each leg adds only for an instance that
runs vLLM's priority scheduling (adapters/pd/base.py `leg_body`): a client never sets what vLLM's
scheduler sees unless trusted, and an "fcfs" worker never sees a priority.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conductor.config.priority import PrioritySettings
from conductor.core.errors import BadRequest

BODY_FIELD = "priority"


class Classifier:
    """Names each request's class; `enabled` False when no class is configured."""

    __slots__ = ("_default", "_engine", "_known", "_names", "_tenant_default", "_trust_client", "enabled", "header")

    def __init__(self, priority: PrioritySettings, tenant_classes: Mapping[str, str | None]) -> None:
        self.enabled = priority.enabled
        self.header = priority.header
        self._known = frozenset(priority.classes)
        self._names = ", ".join(priority.names())
        self._default = priority.default
        # tenant -> its default class, for the tenants that set one
        self._tenant_default = {tenant: cls for tenant, cls in tenant_classes.items() if cls is not None}
        self._engine = priority.engine_priorities()  # class -> vLLM priority (None: none sent)
        self._trust_client = priority.trust_client_engine_priority

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

    def engine_priority(self, cls: str | None, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """(the body without the client's `priority`, the engine priority the request's legs give
        "priority" instances): its class's; else, where trusted, the client's integer; else None.
        `body` itself is left as it is (a copy is made only when it holds a `priority`)."""
        given = body.get(BODY_FIELD)
        if BODY_FIELD in body:
            body = {k: v for k, v in body.items() if k != BODY_FIELD}
        chosen = self._engine.get(cls) if cls is not None else None
        if chosen is None and self._trust_client and type(given) is int:
            chosen = given
        return body, chosen

    def _known_class(self, name: str, where: str) -> str:
        if name not in self._known:
            raise BadRequest(
                f"unknown priority class {name[:64]!r} in {where}; the classes are: {self._names}",
                param=where,
                code="invalid_priority",
            )
        return name
