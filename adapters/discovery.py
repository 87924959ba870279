"""Finding workers by DNS: every A record of a name is one instance.

In Kubernetes the name is a headless Service's (`clusterIP: None`): its A records are the pods'
addresses, and they change as pods come and go. `DnsDiscovery` resolves each role's name every
`interval_s` and hands the instances it found to a callback, which applies the differences.

What an answer means:
- records: exactly these instances;
- NXDOMAIN or an empty answer (NoAnswer): none of that role (a Service with no pods, or deleted);
- anything else (a timeout, SERVFAIL, REFUSED, no server answering): unknown, so the callback is
  not called and the last known set stays. A DNS hiccup must not empty the fleet.

The resolver sits behind `AddressResolver`: `DnsResolver` asks a DNS server with dnspython (the
system's from /etc/resolv.conf, or one given: tests run a real dnsmasq); `StaticResolver` is the
in-memory one, for callers that already know the addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from adapters.tasks import cancel_and_wait
from conductor.core.types import Role

log = logging.getLogger(__name__)


class ResolutionFailed(Exception):
    """The name's addresses are unknown for now (not "there are none")."""


class AddressResolver(Protocol):
    async def resolve(self, name: str) -> tuple[str, ...]:
        """The name's IPv4 addresses, sorted; () when it does not exist or has none. Raises
        ResolutionFailed when the answer is unknown."""
        ...


class DnsResolver:
    """A records from a DNS server: `nameserver` (an IP) and `port`, or the system's resolv.conf."""

    def __init__(self, nameserver: str | None = None, port: int = 53, timeout_s: float = 2.0) -> None:
        import dns.asyncresolver  # only where DNS discovery is configured

        if nameserver is None:
            self._resolver = dns.asyncresolver.Resolver()  # /etc/resolv.conf: search domains, ndots
        else:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [nameserver]
            self._resolver.port = port
        self._resolver.lifetime = timeout_s
        # the answers are the membership: never serve them from a cache of our own
        self._resolver.cache = None

    async def resolve(self, name: str) -> tuple[str, ...]:
        import dns.exception
        import dns.resolver

        try:
            answer = await self._resolver.resolve(name, "A", search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return ()
        except dns.exception.DNSException as exc:  # timeout, SERVFAIL, REFUSED, no nameservers
            raise ResolutionFailed(f"{name}: {type(exc).__name__}: {exc}") from exc
        return tuple(sorted({rr.address for rr in answer}, key=_address_order))


class StaticResolver:
    """In-memory answers: `set` a name's addresses, `fail` it to act like an unreachable server."""

    def __init__(self, answers: Mapping[str, Sequence[str]] | None = None) -> None:
        self._answers = {name: tuple(addrs) for name, addrs in (answers or {}).items()}
        self._failing: set[str] = set()

    def set(self, name: str, addresses: Sequence[str]) -> None:
        self._answers[name] = tuple(addresses)
        self._failing.discard(name)

    def fail(self, name: str) -> None:
        self._failing.add(name)

    async def resolve(self, name: str) -> tuple[str, ...]:
        if name in self._failing:
            raise ResolutionFailed(f"{name}: resolution failing")
        return tuple(sorted(set(self._answers.get(name, ())), key=_address_order))


@dataclass(frozen=True, slots=True)
class DnsSource:
    """One role's name and what every address found under it serves."""

    role: Role
    name: str
    port: int
    scheme: str = "http"
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    bootstrap_port: int | None = None


@dataclass(frozen=True, slots=True)
class Discovered:
    """One instance an address stands for."""

    name: str  # "<role>-<address>": stable for as long as the address is listed
    role: Role
    url: str
    bootstrap_port: int | None
    kv_events_endpoint: str | None  # "tcp://*:PORT": the worker binds, the gateway connects to its host
    kv_events_replay_endpoint: str | None


def instance_for(source: DnsSource, address: str) -> Discovered:
    host = f"[{address}]" if ":" in address else address
    # a name is what the index, the metrics and the admin API know an instance by: derived from the
    # address only, so the same pod keeps its name across resolutions and gateway replicas
    name = f"{source.role.value}-{address.replace('.', '-').replace(':', '-')}"
    events = f"tcp://*:{source.kv_events_port}" if source.kv_events_port else None
    replay = f"tcp://*:{source.kv_events_replay_port}" if source.kv_events_replay_port else None
    return Discovered(name, source.role, f"{source.scheme}://{host}:{source.port}", source.bootstrap_port, events, replay)


Apply = Callable[[Role, tuple[Discovered, ...]], Awaitable[None]]


class DnsDiscovery:
    """Resolves every source now and then every `interval_s`; `apply(role, instances)` gets each
    role's full set after every answer that is known (see the module docstring)."""

    def __init__(self, sources: Sequence[DnsSource], resolver: AddressResolver, apply: Apply, interval_s: float = 10.0) -> None:
        self.sources = tuple(sources)
        self.resolver = resolver
        self._apply = apply
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.failures = 0  # resolutions that kept the last set, for the logs and tests
        self.rounds = 0  # refreshes done
        self._failing: set[str] = set()

    async def start(self) -> None:
        await self.refresh()  # the fleet is known before the gateway says it is ready
        self.watch()

    def watch(self) -> None:
        """Resolve again every interval_s from now on (in the background)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dns-discovery")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def refresh(self) -> None:
        for source in self.sources:
            try:
                addresses = await self.resolver.resolve(source.name)
            except ResolutionFailed as exc:
                self.failures += 1
                if source.name not in self._failing:  # once per outage, not every interval
                    log.warning("DNS discovery of %s instances failed, keeping the last known set: %s", source.role.value, exc)
                self._failing.add(source.name)
                continue
            if source.name in self._failing:
                log.info("DNS discovery of %s instances answers again", source.role.value)
                self._failing.discard(source.name)
            await self._apply(source.role, tuple(instance_for(source, a) for a in addresses))
        self.rounds += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # a bug applying one answer must not end discovery
                log.exception("DNS discovery round failed")


def _address_order(address: str) -> tuple[int, int]:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return (9, 0)
    return (ip.version, int(ip))
