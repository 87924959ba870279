"""DNS discovery against a real DNS server whose records change (dnsmasq, re-reading its hosts file
on SIGHUP): the resolver's answers, and a running gateway that follows them without a restart."""

from __future__ import annotations

import asyncio
import getpass
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from adapters.discovery import DnsDiscovery, DnsResolver, DnsSource, ResolutionFailed, StaticResolver, instance_for
from conductor.config.settings import Settings, load_settings
from conductor.core.types import Role
from conductor.gateway import Gateway
from conductor.server.app import create_app
from tests.support.ci import require
from tests.support.servers import ServerThread, free_port, serve
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

NAME = "mixed.conductor.test"
KEY = "admin-secret"


class Dnsmasq:
    """dnsmasq on a free UDP port of 127.0.0.1, answering only from a hosts file the test rewrites."""

    def __init__(self, directory: Path) -> None:
        self.hosts = directory / "hosts"
        self.hosts.write_text("")
        self.port = free_port(socket.SOCK_DGRAM)
        self.log = directory / "dnsmasq.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Dnsmasq:
        args = [
            "dnsmasq",
            "--no-daemon",
            "--no-resolv",
            "--no-hosts",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--addn-hosts={self.hosts}",
            "--local=/test/",  # names under .test it does not hold are NXDOMAIN, not REFUSED
            "--pid-file=",  # none: it would need a writable /run
            # stay the user it runs as: as root it would switch to nobody, who may not read tmp_path
            f"--user={getpass.getuser()}",
            "--log-queries",
        ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        assert wait_for(lambda: self._answers(), timeout=10), self.log.read_text()
        return self

    def _answers(self) -> bool:
        try:
            return bool(asyncio.run(DnsResolver("127.0.0.1", self.port, 0.5).resolve("probe.test")) == ())
        except ResolutionFailed:
            return False

    def set(self, name: str, addresses: list[str]) -> None:
        """Publish exactly these A records for `name`; SIGHUP makes dnsmasq re-read the file."""
        self.hosts.write_text("".join(f"{a} {name}\n" for a in addresses))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        resolver = DnsResolver("127.0.0.1", self.port, 1.0)
        assert wait_for(lambda: set(asyncio.run(resolver.resolve(name))) == set(addresses), timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[Dnsmasq]:
    # .ci/run installs it: there a missing dnsmasq fails the tests that need it (tests/support/ci.py)
    require(shutil.which("dnsmasq") is not None, "dnsmasq not installed (bash .ci/apt.sh dnsmasq-base)")
    server = Dnsmasq(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def test_the_resolver_reads_every_record_and_tells_none_from_unknown(dns: Dnsmasq) -> None:
    dns.set(NAME, ["127.0.0.3", "127.0.0.2", "127.0.0.10"])
    resolver = DnsResolver("127.0.0.1", dns.port, 1.0)
    assert asyncio.run(resolver.resolve(NAME)) == ("127.0.0.2", "127.0.0.3", "127.0.0.10")
    assert asyncio.run(resolver.resolve("absent.conductor.test")) == ()  # NXDOMAIN: none
    dns.stop()
    with pytest.raises(ResolutionFailed):  # nobody answers: unknown, not none
        asyncio.run(resolver.resolve(NAME))


def test_discovery_keeps_the_last_set_when_resolution_fails() -> None:
    resolver = StaticResolver({NAME: ["10.0.0.1", "10.0.0.2"]})
    seen: list[tuple[str, ...]] = []

    async def apply(role: Role, found: tuple[Any, ...]) -> None:
        seen.append(tuple(d.name for d in found))

    source = DnsSource(Role.PREFILL, NAME, 8100, kv_events_port=5557, bootstrap_port=8998)
    discovery = DnsDiscovery([source], resolver, apply)
    asyncio.run(discovery.refresh())
    resolver.fail(NAME)
    asyncio.run(discovery.refresh())  # not applied at all: the last set stands
    resolver.set(NAME, [])
    asyncio.run(discovery.refresh())  # an empty answer is an empty set
    assert seen == [("prefill-10-0-0-1", "prefill-10-0-0-2"), ()]
    assert discovery.failures == 1
    one = instance_for(source, "10.0.0.1")
    assert (one.url, one.kv_events_endpoint, one.bootstrap_port) == ("http://10.0.0.1:8100", "tcp://*:5557", 8998)


def _serve_on(app: Any, host: str, port: int) -> ServerThread:
    """A stand-in on one loopback address: every instance of a DNS name shares the port."""
    server = ServerThread(app, port)
    server.config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server.server = uvicorn.Server(server.config)
    server.url = f"http://{host}:{port}"
    return server


@contextmanager
def _workers(addresses: list[str], port: int) -> Iterator[dict[str, StandIn]]:
    with ExitStack() as stack:
        workers = {}
        for address in addresses:
            workers[address] = StandIn(model="tiny")
            server = _serve_on(workers[address], address, port).start()
            stack.callback(server.stop)
        yield workers


def _listed(url: str) -> dict[str, str]:
    r = httpx.get(url + "/admin/instances", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    return {i["name"]: i["state"] for i in r.json()["data"]}


def _send(url: str, n: int) -> None:
    for _ in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text


def _dns_settings(dns: Dnsmasq, port: int, *, discovery: dict[str, Any] | None = None, **extra: Any) -> Settings:
    """A gateway that finds its workers as NAME on the test's DNS server. Round robin with KV off:
    these tests count where requests went, and kvcache_aware would keep a repeated prompt together."""
    found = {"mixed": {"name": NAME, "port": port}, "interval_s": 0.2, "nameserver": "127.0.0.1", "nameserver_port": dns.port}
    overrides = {
        "models": ["tiny"],
        "policy": "round_robin",
        "kv": {"enabled": False},
        "health": {"interval_s": 0.3},
        "auth": {"admin_api_keys": [KEY]},
        "discovery": {**found, **(discovery or {})},
        **extra,
    }
    return load_settings(environ={}, overrides=overrides)


def test_the_gateway_follows_the_records_without_a_restart(dns: Dnsmasq) -> None:
    port = free_port()
    addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    dns.set(NAME, addresses[:2])
    with _workers(addresses, port) as workers:
        settings = _dns_settings(dns, port, discovery={"timeout_s": 0.5})
        gateway = Gateway(settings)
        with serve(create_app(gateway)) as g:
            healthy = {"mixed-127-0-0-2": "healthy", "mixed-127-0-0-3": "healthy"}
            assert wait_for(lambda: _listed(g.url) == healthy, timeout=20), _listed(g.url)
            _send(g.url, 4)
            assert [len(workers[a].bodies()) for a in addresses] == [2, 2, 0]

            dns.set(NAME, addresses[1:])  # .2 leaves, .4 joins
            moved = {"mixed-127-0-0-3": "healthy", "mixed-127-0-0-4": "healthy"}
            assert wait_for(lambda: _listed(g.url) == moved, timeout=20), _listed(g.url)
            _send(g.url, 4)
            assert [len(workers[a].bodies()) for a in addresses] == [2, 4, 2]

            failures = gateway.membership.discovery.failures if gateway.membership.discovery else 0
            dns.stop()  # no answer at all from now on: the fleet stays as it was
            discovery = gateway.membership.discovery
            assert discovery is not None
            assert wait_for(lambda: discovery.failures >= failures + 3, timeout=30)
            assert _listed(g.url) == moved
            _send(g.url, 2)
            assert [len(workers[a].bodies()) for a in addresses] == [2, 5, 3]


def test_a_name_with_no_records_means_no_instances(dns: Dnsmasq) -> None:
    port = free_port()
    dns.set(NAME, ["127.0.0.2"])
    with _workers(["127.0.0.2"], port):
        settings = _dns_settings(dns, port, timeouts={"drain_grace_s": 0.5})
        with serve(create_app(Gateway(settings))) as g:
            assert wait_for(lambda: _listed(g.url) == {"mixed-127-0-0-2": "healthy"}, timeout=20)
            dns.set(NAME, [])  # the name is gone (NXDOMAIN): drained, then removed
            assert wait_for(lambda: _listed(g.url) == {}, timeout=20), _listed(g.url)
            r = httpx.post(g.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["message"]
            assert httpx.get(g.url + "/ready").status_code == 503


def test_the_api_overrules_dns_while_dns_lists_the_address(dns: Dnsmasq) -> None:
    port = free_port()
    dns.set(NAME, ["127.0.0.2", "127.0.0.3"])
    with _workers(["127.0.0.2", "127.0.0.3"], port) as workers:
        settings = _dns_settings(dns, port)
        gateway = Gateway(settings)
        with serve(create_app(gateway)) as g:
            assert wait_for(lambda: len(_listed(g.url)) == 2, timeout=20)
            r = httpx.delete(g.url + "/admin/instances/mixed-127-0-0-2", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200
            discovery = gateway.membership.discovery
            assert discovery is not None
            # several resolutions later DNS still lists .2, and it stays out
            rounds = discovery.rounds
            assert wait_for(lambda: discovery.rounds >= rounds + 3, timeout=20)
            assert set(_listed(g.url)) == {"mixed-127-0-0-3"}
            _send(g.url, 2)
            assert len(workers["127.0.0.2"].bodies()) == 0
            # once DNS let go of it, it may come back as a new member
            dns.set(NAME, ["127.0.0.3"])
            assert wait_for(lambda: "mixed-127-0-0-2" not in gateway.membership.overruled, timeout=20)
            dns.set(NAME, ["127.0.0.2", "127.0.0.3"])
            assert wait_for(lambda: set(_listed(g.url)) == {"mixed-127-0-0-2", "mixed-127-0-0-3"}, timeout=20)


def test_discovery_settings_come_from_the_environment() -> None:
    env = {
        "CONDUCTOR_DISCOVERY__PREFILL__NAME": "p.ns.svc.cluster.local",
        "CONDUCTOR_DISCOVERY__PREFILL__PORT": "8100",
        "CONDUCTOR_DISCOVERY__DECODE__NAME": "d.ns.svc.cluster.local",
        "CONDUCTOR_DISCOVERY__DECODE__PORT": "8200",
        "CONDUCTOR_DISCOVERY__INTERVAL_S": "5",
    }
    settings = load_settings(environ=env)
    assert settings.disaggregated and settings.discovery.interval_s == 5
    assert set(settings.discovery.sources()) == {Role.PREFILL, Role.DECODE}
    assert os.environ.get("CONDUCTOR_DISCOVERY__PREFILL__NAME") is None
