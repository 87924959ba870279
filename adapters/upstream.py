"""Pooled HTTP clients to the workers.

One keep-alive pool per upstream instance, created at start-up and reused by every request: a
request never opens a client of its own. The pools are the lean HTTP/1.1 client of
`adapters/http1.py` (see there for why not aiohttp or httpx); its connections set TCP_NODELAY so
small SSE writes are not held back by Nagle's algorithm meeting delayed ACKs (the ~40 ms stall
seen in some routers).

Each instance also has a small pool of its own for health probes (`get(..., probe=True)`): when
every connection of the main pool carries a long stream, a probe must still go out at once, or a
busy worker would look dead.

Failures become `UpstreamError`s whose `maybe_processed` says whether the worker may have read the
request: False only when nothing was written (refused connection, no free pooled connection), the
one case where the gateway may send the same request to another instance.

A worker's answer is bounded (`ResponseLimits`: its head, and a body read whole); one past the
bounds fails the leg like any broken answer (an UpstreamError: 502, counted with the others) and
its connection is dropped, never reused.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from adapters.http1 import DEFAULT_LIMITS, HTTPClientError, Pool, PoolTimeout, ReadTimeout, Response, ResponseLimits
from conductor.core.errors import ConfigError, UpstreamError, UpstreamTimeout
from conductor.core.fast_init import fast_init


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 120.0  # longest silence between two reads
    pool_s: float | None = None  # longest wait for a free pooled connection; None: connect_s


class UpstreamPoolExhausted(UpstreamError):
    """Every pooled connection to the worker stayed busy for the pool timeout; nothing was sent."""

    status = 503
    type = "service_unavailable"
    code = "upstream_pool_exhausted"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


@fast_init
@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A finished, non-streamed upstream answer."""

    status: int
    body: bytes
    content_type: str
    elapsed_s: float


class UpstreamStream:
    """An open streamed upstream answer; iterate the bytes, always close it (dropping it, or
    leaving `chunks()` early, closes it too)."""

    def __init__(self, response: Response, instance: str) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.header("content-type", "text/event-stream")
        self.instance = instance

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.chunks():
                yield chunk
        except ReadTimeout as exc:
            raise UpstreamTimeout(f"{self.instance}: {exc}", instance=self.instance) from exc
        except HTTPClientError as exc:
            raise UpstreamError(f"{self.instance} broke the stream: {exc}", instance=self.instance) from exc
        finally:
            self._response.close()

    def close(self) -> None:
        """Drop the connection (unless fully read): the worker sees the client leave and aborts."""
        self._response.close()


class Upstream:
    """The connection pools to one worker: the main one and a small one for health probes."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        timeouts: Timeouts,
        max_connections: int = 256,
        probe_connections: int = 2,
        tls: ssl.SSLContext | None = None,
        limits: ResponseLimits = DEFAULT_LIMITS,
    ) -> None:
        self.name = name
        self.limits = limits
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._max_connections = max_connections
        self._probe_connections = probe_connections
        self._tls = tls  # for https:// workers; None: the system's trust store
        self._pool: Pool | None = None
        self._probe_pool: Pool | None = None
        self._prefix = ""

    async def start(self) -> None:
        parts = urlsplit(self.base_url)
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"upstream {self.name}: invalid port in {self.base_url}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"upstream {self.name}: only http:// and https:// worker URLs are supported, got {self.base_url}")
        tls = None
        if parts.scheme == "https":
            tls = self._tls or ssl.create_default_context()
        self._prefix = parts.path.rstrip("/")
        t, host, port = self.timeouts, parts.hostname, port or (443 if tls else 80)

        def pool(limit: int) -> Pool:
            return Pool(
                host,
                port,
                limit=limit,
                connect_timeout_s=t.connect_s,
                read_timeout_s=t.read_s,
                pool_timeout_s=t.pool_s,
                tls=tls,
                limits=self.limits,
            )

        self._pool = pool(self._max_connections)
        self._probe_pool = pool(self._probe_connections)

    async def close(self) -> None:
        for pool in (self._pool, self._probe_pool):
            if pool is not None:
                await pool.close()
        self._pool = self._probe_pool = None

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            raise RuntimeError(f"upstream {self.name} used before start()")
        return self._pool

    @property
    def probe_pool(self) -> Pool:
        """The health probes' own connections, never taken by requests."""
        if self._probe_pool is None:
            raise RuntimeError(f"upstream {self.name} used before start()")
        return self._probe_pool

    def _fail(self, exc: BaseException, path: str) -> UpstreamError:
        if isinstance(exc, PoolTimeout):
            return UpstreamPoolExhausted(
                f"{self.name}: no free connection for {path}: {exc}", instance=self.name, maybe_processed=False
            )
        if isinstance(exc, ReadTimeout | TimeoutError):
            return UpstreamTimeout(f"{self.name} did not answer {path} in time", instance=self.name)
        sent = exc.sent if isinstance(exc, HTTPClientError) else True
        return UpstreamError(f"{self.name} failed on {path}: {exc}", instance=self.name, maybe_processed=sent)

    async def _exchange(
        self, pool: Pool, method: str, path: str, headers: Mapping[str, str], body: bytes, total_s: float | None
    ) -> UpstreamReply:
        started = time.monotonic()
        try:
            if total_s:
                async with asyncio.timeout(total_s):
                    response = await pool.request(method, self._prefix + path, headers, body)
                    data = await response.read()
            else:  # bounded by the caller's deadline and the connection's read timeout: no timer of its own
                response = await pool.request(method, self._prefix + path, headers, body)
                data = await response.read()
        except (HTTPClientError, TimeoutError) as exc:
            raise self._fail(exc, path) from exc
        return UpstreamReply(
            response.status, data, response.header("content-type", "application/json"), time.monotonic() - started
        )

    async def post(self, path: str, body: bytes, headers: Mapping[str, str], *, total_s: float | None = None) -> UpstreamReply:
        """One non-streamed request. Its time is bounded by the connection's read timeout (silence)
        and by `total_s` when given; the request path passes none: its own deadline
        (request_timeout_s, conductor/server/endpoint.py) covers every leg, and a timer per leg would cost
        more CPU than the answer (profiled: ~5% of the gateway's time at concurrency 64)."""
        return await self._exchange(self.pool, "POST", path, headers, body, total_s)

    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamStream:
        try:
            response = await self.pool.request("POST", self._prefix + path, headers, body)
        except HTTPClientError as exc:
            raise self._fail(exc, path) from exc
        return UpstreamStream(response, self.name)

    async def get(self, path: str, *, timeout_s: float | None = None, probe: bool = False) -> UpstreamReply:
        """A GET; `probe=True` sends it on the health probes' own pool, so it never waits behind
        the requests that hold every connection of the main one."""
        return await self._exchange(self.probe_pool if probe else self.pool, "GET", path, {}, b"", timeout_s)


class UpstreamPool:
    """Every worker's pools, keyed by instance name."""

    def __init__(
        self,
        timeouts: Timeouts,
        max_connections: int = 256,
        *,
        probe_connections: int = 2,
        tls: ssl.SSLContext | None = None,
        limits: ResponseLimits = DEFAULT_LIMITS,
    ) -> None:
        self.timeouts = timeouts
        self.limits = limits
        self._max_connections = max_connections
        self._probe_connections = probe_connections
        self._tls = tls
        self._by_name: dict[str, Upstream] = {}

    def add(self, name: str, base_url: str) -> Upstream:
        upstream = Upstream(
            name,
            base_url,
            timeouts=self.timeouts,
            max_connections=self._max_connections,
            probe_connections=self._probe_connections,
            tls=self._tls,
            limits=self.limits,
        )
        self._by_name[name] = upstream
        return upstream

    def __getitem__(self, name: str) -> Upstream:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    async def start(self) -> None:
        for upstream in self._by_name.values():
            await upstream.start()

    async def close(self) -> None:
        for upstream in self._by_name.values():
            await upstream.close()
