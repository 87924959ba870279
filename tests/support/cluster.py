"""A gateway in front of stand-in workers, all real uvicorn servers on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from conductor.config.settings import load_settings, merge_settings
from conductor.core.types import Policy
from conductor.gateway import Gateway
from tests.support.servers import READY_TIMEOUT_S, ServerThread, serve, serve_gateway
from tests.support.standin import BootstrapStandIn, StandIn


@dataclass
class Cluster:
    url: str
    gateway: Gateway
    prefills: list[StandIn] = field(default_factory=list)
    decodes: list[StandIn] = field(default_factory=list)
    mixed: list[StandIn] = field(default_factory=list)
    bootstraps: list[BootstrapStandIn] = field(default_factory=list)
    servers: dict[str, ServerThread] = field(default_factory=dict)


@contextmanager
def cluster(
    protocol: str = "nixl",
    *,
    n_prefill: int = 1,
    n_decode: int = 1,
    n_mixed: int = 0,
    policy: Policy | None = None,
    standin: dict[str, Any] | None = None,
    tracing: Any = None,
    gateway_http: str | None = None,
    ready_timeout_s: float | None = READY_TIMEOUT_S,
    **settings: Any,
) -> Iterator[Cluster]:
    """`gateway_http`: a uvicorn protocol name ("httptools", "h11") to serve the gateway on instead
    of its own (adapters/http1_server.py), for what must work under any ASGI server.

    `ready_timeout_s`: how long to wait for the gateway to report itself ready (serve_gateway).

    The gateway routes round robin without the KV index unless `settings` say otherwise (`policy`
    passes a Policy object): the tests built on this helper are about the gateway's HTTP, P/D and
    fault handling, written against that baseline, not about the serve defaults (kvcache_aware with
    the index on: tests/conductor/server/test_serve_defaults.py). With `kv: {enabled: true}` the tokenizer
    is the built-in one, the stand-ins' own (they serve no /tokenize)."""
    opts = standin or {}
    with ExitStack() as stack:
        c = Cluster(url="", gateway=None)  # type: ignore[arg-type]
        prefill_specs: list[dict[str, Any]] = []
        decode_specs: list[str] = []
        mixed_specs: list[str] = []
        for i in range(n_prefill):
            worker = StandIn(role="prefill", engine_id=f"engine-p{i}", **opts.get("prefill", {}))
            server = stack.enter_context(serve(worker))
            boot = BootstrapStandIn(engine_id=f"engine-p{i}", **opts.get("bootstrap", {}))
            boot_server = stack.enter_context(serve(boot))
            c.prefills.append(worker)
            c.bootstraps.append(boot)
            c.servers[f"prefill-{i}"] = server
            prefill_specs.append({"url": server.url, "bootstrap_port": boot_server.port})
        for role, count, workers, specs in (
            ("decode", n_decode, c.decodes, decode_specs),
            ("mixed", n_mixed, c.mixed, mixed_specs),
        ):
            for i in range(count):
                worker = StandIn(role=role, **opts.get(role, {}))
                server = stack.enter_context(serve(worker))
                workers.append(worker)
                c.servers[f"{role}-{i}"] = server
                specs.append(server.url)
        baseline = {"policy": "round_robin", "kv": {"enabled": False, "tokenizer": "builtin"}}
        overrides = merge_settings({**baseline, "pd": {"protocol": protocol}, "health": {"interval_s": 0.5}}, settings)
        if prefill_specs:
            overrides["prefill"] = prefill_specs
        if decode_specs:
            overrides["decode"] = decode_specs
        if mixed_specs:
            overrides["mixed"] = mixed_specs
        gateway = Gateway(load_settings(environ={}, overrides=overrides), policy=policy, tracing=tracing)
        server_config = {} if gateway_http is None else {"http": gateway_http}
        gw_server = stack.enter_context(serve_gateway(gateway, ready_timeout_s=ready_timeout_s, **server_config))
        c.url, c.gateway = gw_server.url, gateway
        c.servers["gateway"] = gw_server
        yield c
