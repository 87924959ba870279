"""The gateway's status on the admin surface: `GET /admin/status` (JSON, with the admin API key) and
`GET /status`, a page that shows it live (conductor/server/status_page.py).

The JSON holds the fleet as routing sees it now (each instance's role, health, ejection, panic, the
work this gateway queued and runs there, and its KV hash agreement with any alarm), the last
decisions with each candidate's predictions, and the counts of the last minutes (decisions,
rejections by reason, SLO attainment): conductor/ops/status.py keeps those, fed by the Router.
Sizes, names and figures only, never a prompt's text.

The page itself holds no data, only the script that fetches the JSON with the key its reader types
in; so it is served without a key (a browser cannot send a Bearer header on a plain visit), on the
admin port when there is one, else on the public port beside the other operational routes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from conductor.core.types import Role
from conductor.fleet.instances import InstanceRegistry
from conductor.fleet.membership import Membership, describe
from conductor.fleet.state import InstanceState
from conductor.kv.agreement import HashAgreement, agreement_of
from conductor.routing.request_path import RequestPath
from conductor.server.status_page import STATUS_PAGE_POLICY, status_page

STATUS_PATH = "/admin/status"
PAGE_PATH = "/status"


def _instance(state: InstanceState, ready: bool, panic: frozenset[Role], agreement: HashAgreement | None) -> dict[str, Any]:
    out = describe(state, ready)
    out.update(
        probe_ok=state.health.probe_ok,
        ejected=state.health.ejected,
        panic=state.spec.role in panic and not state.draining,
        queued_prefills=len(state.prefills),
        queued_prefill_tokens=sum(p.new_tokens for p in state.prefills.values()),
        running_decodes=len(state.decodes),
        kv=None if agreement is None else agreement.instance_figures(state.name),
    )
    return out


def status_document(parts: RequestPath, membership: Membership) -> dict[str, Any]:
    """Everything /admin/status answers, as of now."""
    registry: InstanceRegistry = membership.registry
    members = [s for s in registry.states.values() if not s.draining]
    panic = registry.panic_roles(members)  # as the next decision's snapshot will see it
    agreement = agreement_of(parts.analyzer)
    instances = [
        _instance(s, membership.protocol.ready(s.target) or s.spec.role is not Role.PREFILL, panic, agreement)
        for s in registry.states.values()
    ]
    status = parts.router.status
    return {
        "object": "conductor.status",
        "time": round(time.time(), 3),
        "policy": parts.router.policy.name,
        "inflight": {"count": parts.inflight.count, "limit": parts.inflight.limit},
        "panic_roles": sorted(role.value for role in panic),
        "instances": instances,
        "kv": None
        if agreement is None
        else {"agreement": round(agreement.ratio, 4), "coverage": round(agreement.coverage, 4), "alarmed": agreement.alarmed},
        "window": status.window.summary(),
        "decisions": status.ring.records(),
        "decisions_kept": status.ring.capacity,
    }


def status_routes(parts: RequestPath, membership: Membership, authorize: Callable[[str | None], None]) -> APIRouter:
    """GET /admin/status (`authorize`: the admin API's key check, 401 / 403) and GET /status."""
    router = APIRouter()

    @router.get(
        STATUS_PATH,
        tags=["admin"],
        responses={
            401: {"description": "no admin key or an unknown one"},
            403: {"description": "the admin API is disabled (no admin key configured)"},
        },
    )
    async def admin_status(request: Request) -> JSONResponse:
        authorize(request.headers.get("authorization"))
        return JSONResponse(status_document(parts, membership), headers={"Cache-Control": "no-store"})

    @router.get(PAGE_PATH, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(status_page(), headers={"Content-Security-Policy": STATUS_PAGE_POLICY})

    return router
