"""Instances that join and leave while the gateway runs: DNS discovery and the admin API.

`Membership` applies both to the registry (conductor/fleet/instances.py) and keeps the rest in step: the
KV index forgets a removed instance and stops its KV events subscriber, a new one is subscribed,
the per-instance metric series of a removed one go, a new Mooncake prefill's engine is looked up.

Who wins when DNS and the admin API disagree:
- DNS adds and drains only instances it found itself (origin "dns"); instances from the settings'
  lists or added by the API are never touched by it, and it adds no address whose URL is a member.
- An address that leaves DNS is drained (its streams finish), not cut; if it comes back before the
  drain ends it returns to rotation.
- The API may drain or remove a DNS-found instance; that holds for as long as DNS keeps listing the
  address (it is not re-added on the next resolution). Once DNS stops listing it the decision is
  forgotten, so a new pod that later gets the same address joins normally.
- The API cannot add an instance whose name or URL is a member already (409).

The admin routes (`admin_routes`) need a key from `admin_api_keys` / `admin_api_keys_file` as a
Bearer token. Without any admin key configured they answer 403 with a message saying so: a default
install exposes no way to change its fleet.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.metrics import MetricWrapperBase
from pydantic import ValidationError

from adapters.discovery import Discovered, DnsDiscovery, DnsResolver, DnsSource
from adapters.pd.base import PDProtocol
from conductor.config.keys import ApiKeys
from conductor.config.settings import InstanceSpec, Settings
from conductor.core.errors import BadRequest, ConductorError
from conductor.core.types import Role
from conductor.fleet.instances import InstanceRegistry, InstanceState, Origin
from conductor.kv.analysis import PromptAnalyzer
from conductor.kv.analyzer import KVAwareAnalyzer, KVEventsEndpoint
from conductor.kv.canary_access import canary_of
from conductor.ops.loop_metrics import LoopMetric
from conductor.ops.metrics import GatewayMetrics

log = logging.getLogger(__name__)

_SERIES_LABELS = ("instance", "prefill", "decode")  # label names that hold an instance name
_NAME = re.compile(r"[A-Za-z0-9._-]{1,63}")  # it becomes a metric label and a URL path segment


class AdminDisabled(ConductorError):
    status = 403
    type = "permission_error"
    code = "admin_api_disabled"


class Membership:
    """Listens to the registry's membership changes and runs DNS discovery when configured."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: InstanceRegistry,
        protocol: PDProtocol,
        analyzer: PromptAnalyzer,
        metrics: GatewayMetrics,
    ) -> None:
        """The parts an instance's arrival or departure touches besides the registry: the
        protocol (a Mooncake prefill's engine), the analyzer (KV events) and the metrics."""
        self.settings = settings
        self.registry = registry
        self.protocol = protocol
        self.analyzer = analyzer
        self.metrics = metrics
        self.admin_keys = settings.auth.admin_keys()  # read once, like the client keys
        self._admin = ApiKeys(self.admin_keys, what="admin API key")
        # DNS-found instances the API drained or removed, by name: kept out while DNS lists them
        self.overruled: set[str] = set()
        registry.listeners.append(self)
        canary = canary_of(analyzer)
        key = settings.auth.upstream_key()
        if canary is not None and key:  # the KV canary's requests go to the workers like any other
            canary.headers = {"Authorization": f"Bearer {key}"}
        d = settings.discovery
        self.discovery: DnsDiscovery | None = None
        self.live = False  # the gateway's parts have started: a new instance is started by us
        if d.sources():
            sources = [
                DnsSource(role, s.name, s.port, s.scheme, s.kv_events_port, s.kv_events_replay_port, s.bootstrap_port)
                for role, s in d.sources().items()
            ]
            resolver = DnsResolver(d.nameserver, d.nameserver_port, d.timeout_s)
            self.discovery = DnsDiscovery(sources, resolver, self.apply_dns, d.interval_s)

    async def start(self) -> None:
        """The first DNS answer, before the protocol and the analyzer start (they start its instances)."""
        if self.discovery is not None:
            await self.discovery.refresh()

    def watch(self) -> None:
        """From now on changes are applied as they come: resolved again every interval."""
        self.live = True
        if self.discovery is not None:
            self.discovery.watch()

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()

    # ---- DNS ----------------------------------------------------------------------------
    async def apply_dns(self, role: Role, found: tuple[Discovered, ...]) -> None:
        """`found` is every instance of `role` DNS lists now: add the new ones, drain the gone ones."""
        registry = self.registry
        names = {d.name for d in found}
        listed_here = {n for n in self.overruled if n.startswith(f"{role.value}-")}
        self.overruled -= listed_here - names  # DNS let go of them: the API's word is spent
        urls = {s.spec.url for s in registry.states.values()}
        source = self.settings.discovery.sources().get(role)
        policy = source.scheduling_policy if source is not None else "fcfs"
        for d in found:
            state = registry.states.get(d.name)
            if d.name in self.overruled:
                continue
            if state is not None:
                if state.draining and state.drained_by == "dns":
                    registry.undrain(d.name)
                continue
            if d.url in urls or d.name in registry.retired:
                continue  # listed already (settings, API) or its old requests still end
            spec = InstanceSpec(
                url=d.url,
                role=role,
                name=d.name,
                bootstrap_port=d.bootstrap_port,
                kv_events_endpoint=d.kv_events_endpoint,
                kv_events_replay_endpoint=d.kv_events_replay_endpoint,
                scheduling_policy=policy,
            )
            await registry.add(spec, origin="dns")
        for state in list(registry.states.values()):
            if state.origin == "dns" and state.spec.role is role and state.name not in names and not state.draining:
                registry.drain(state.name, by="dns")

    # ---- what the registry tells --------------------------------------------------------
    async def instance_added(self, spec: InstanceSpec) -> None:
        assert spec.name is not None
        for kind in ("status", "transport"):  # series at 0 from the start, as for the static ones
            self.metrics.upstream_errors.labels(spec.name, kind)
        self.metrics.ejections.labels(spec.name)
        if isinstance(self.analyzer, KVAwareAnalyzer):
            events = self.settings.kv.kv_events.get(spec.name)
            if events is None and spec.kv_events_endpoint:
                events = KVEventsEndpoint(endpoint=spec.kv_events_endpoint, replay_endpoint=spec.kv_events_replay_endpoint)
            await self.analyzer.add_instance(spec.name, spec.role, spec.url, events)
        state = self.registry.states[spec.name]
        if self.live and spec.role in (Role.PREFILL, Role.MIXED) and not self.protocol.ready(state.target):
            # a Mooncake prefill's engine id comes from its bootstrap server; until then it is not ready
            await self.protocol.start([state.target])

    async def instance_removed(self, name: str) -> None:
        if isinstance(self.analyzer, KVAwareAnalyzer):
            await self.analyzer.remove_instance(name)
        self._drop_series(name)

    def instance_released(self, name: str) -> None:
        self._drop_series(name)  # what its last requests recorded after the removal

    def _drop_series(self, name: str) -> None:
        for metric in vars(self.metrics).values():
            if not isinstance(metric, MetricWrapperBase | LoopMetric):
                continue
            for label in _SERIES_LABELS:
                try:
                    metric.remove_by_labels({label: name})
                except ValueError:  # the metric has no such label
                    continue

    # ---- the admin API ------------------------------------------------------------------
    def authorize(self, authorization: str | None) -> None:
        if not self.admin_keys:
            raise AdminDisabled("the admin API is disabled: configure auth.admin_api_keys or auth.admin_api_keys_file")
        self._admin.check(authorization)  # constant time, any case of 'Bearer' (conductor/config/keys.py)

    async def add_from_api(self, body: Any) -> InstanceState:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object with url and role")
        allowed = {"url", "role", "name", "kv_events_endpoint", "kv_events_replay_endpoint", "bootstrap_port", "models",
                   "scheduling_policy"}  # fmt: skip
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise BadRequest(f"unknown fields: {unknown}; allowed: {sorted(allowed)}", param=unknown[0])
        try:
            spec = InstanceSpec.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or None
            raise BadRequest(f"{where}: {err['msg']}" if where else err["msg"], param=where) from None
        settings = self.settings
        if (spec.role is Role.MIXED) == settings.disaggregated:
            raise BadRequest(
                f"a {spec.role.value} instance does not fit this gateway "
                f"({'prefill/decode' if settings.disaggregated else 'mixed'} workers)",
                param="role",
            )
        if spec.role is Role.PREFILL and settings.pd.protocol in ("mooncake", "sglang") and spec.bootstrap_port is None:
            raise BadRequest(f"pd.protocol {settings.pd.protocol} needs a bootstrap_port for a prefill", param="bootstrap_port")
        if spec.name is not None and not _NAME.fullmatch(spec.name):
            raise BadRequest("name must be 1-63 letters, digits, '.', '_' or '-'", param="name")
        if spec.name is None:
            spec = spec.model_copy(update={"name": self._free_name(spec.role)})
        return await self.registry.add(spec, origin="admin")

    def _free_name(self, role: Role) -> str:
        taken = self.registry.states.keys() | self.registry.retired.keys()
        n = 0
        while f"{role.value}-{n}" in taken:
            n += 1
        return f"{role.value}-{n}"

    def overrule(self, state: InstanceState) -> None:
        if state.origin == "dns":
            self.overruled.add(state.name)


def describe(state: InstanceState, ready: bool = True) -> dict[str, Any]:
    """One instance as GET /admin/instances lists it."""
    condition = "draining" if state.draining else "healthy" if state.healthy and ready else "unhealthy"
    spec = state.spec
    return {
        "name": state.name,
        "role": spec.role.value,
        "url": spec.url,
        "state": condition,
        "inflight": state.inflight,
        "origin": state.origin,
        "bootstrap_port": spec.bootstrap_port,
        "kv_events_endpoint": spec.kv_events_endpoint,
    }


def admin_routes(membership: Membership) -> APIRouter:
    """GET/POST /admin/instances, POST /admin/instances/{name}/drain, DELETE /admin/instances/{name}."""
    router = APIRouter(prefix="/admin/instances", tags=["admin"])
    registry, protocol = membership.registry, membership.protocol
    errors: dict[int | str, dict[str, Any]] = {
        401: {"description": "no admin key or an unknown one"},
        403: {"description": "the admin API is disabled (no admin key configured)"},
    }

    def listed(state: InstanceState) -> dict[str, Any]:
        return describe(state, protocol.ready(state.target) or state.spec.role is not Role.PREFILL)

    @router.get("", responses=errors)
    async def list_instances(request: Request) -> JSONResponse:
        membership.authorize(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [listed(s) for s in registry.states.values()]})

    @router.post(
        "",
        status_code=201,
        responses={
            **errors,
            400: {"description": "a malformed instance"},
            409: {"description": "the name or URL is a member already"},
        },
    )
    async def add_instance(request: Request) -> JSONResponse:
        membership.authorize(request.headers.get("authorization"))
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise BadRequest("the body is not valid JSON") from None
        state = await membership.add_from_api(body)
        return JSONResponse(listed(state), status_code=201)

    @router.post("/{name}/drain", status_code=202, responses={**errors, 404: {"description": "unknown instance"}})
    async def drain_instance(name: str, request: Request) -> JSONResponse:
        membership.authorize(request.headers.get("authorization"))
        state = registry.drain(name, by="admin")
        membership.overrule(state)
        return JSONResponse(listed(state), status_code=202)

    @router.delete("/{name}", responses={**errors, 404: {"description": "unknown instance"}})
    async def remove_instance(name: str, request: Request) -> JSONResponse:
        membership.authorize(request.headers.get("authorization"))
        state = registry.states.get(name)
        await registry.remove(name)  # 404 when unknown
        if state is not None:
            membership.overrule(state)
        return JSONResponse({"name": name, "deleted": True})

    return router


__all__ = ["Membership", "Origin", "admin_routes", "describe"]
