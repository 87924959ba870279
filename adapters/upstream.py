"""Pooled HTTP clients to the workers.

One keep-alive pool per upstream instance, created at start-up and reused by every request: a
request never opens a client of its own. The pools are the lean HTTP/1.1 client of
`adapters/http1.py` (see there for why not aiohttp or httpx); its connections set TCP_NODELAY so
small SSE writes are not held back by Nagle's algorithm meeting delayed ACKs (the ~40 ms stall
seen in some routers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from adapters.http1 import ConnectionFailed, Pool, ReadTimeout, Response
from conductor.core.errors import ConfigError, UpstreamError, UpstreamTimeout


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 120.0  # longest silence between two reads
    total_s: float = 600.0  # a non-streamed answer must be complete by then


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A finished, non-streamed upstream answer."""

    status: int
    body: bytes
    content_type: str
    elapsed_s: float


class UpstreamStream:
    """An open streamed upstream answer; iterate the bytes, always close it."""

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
        except ConnectionFailed as exc:
            raise UpstreamError(f"{self.instance} broke the stream: {exc}", instance=self.instance) from exc

    def close(self) -> None:
        """Drop the connection (unless fully read): the worker sees the client leave and aborts."""
        self._response.close()


class Upstream:
    """The connection pool to one worker."""

    def __init__(self, name: str, base_url: str, *, timeouts: Timeouts, max_connections: int = 256) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._max_connections = max_connections
        self._pool: Pool | None = None

    async def start(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"upstream {self.name}: only http:// worker URLs are supported, got {self.base_url}")
        self._prefix = parts.path.rstrip("/")
        self._pool = Pool(
            parts.hostname, parts.port or 80, limit=self._max_connections,
            connect_timeout_s=self.timeouts.connect_s, read_timeout_s=self.timeouts.read_s,
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            raise RuntimeError(f"upstream {self.name} used before start()")
        return self._pool

    def _fail(self, exc: BaseException, path: str) -> UpstreamError:
        if isinstance(exc, ReadTimeout | asyncio.TimeoutError):
            return UpstreamTimeout(f"{self.name} did not answer {path} in time", instance=self.name)
        return UpstreamError(f"{self.name} failed on {path}: {exc}", instance=self.name)

    async def _request(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        try:
            return await self.pool.request(method, self._prefix + path, headers, body)
        except (ConnectionFailed, ReadTimeout) as exc:
            raise self._fail(exc, path) from exc

    async def _read(self, response: Response, path: str, started: float, total_s: float) -> UpstreamReply:
        try:
            data = await asyncio.wait_for(response.read(), total_s) if total_s else await response.read()
        except (TimeoutError, ConnectionFailed, ReadTimeout) as exc:
            response.close()
            raise self._fail(exc, path) from exc
        return UpstreamReply(response.status, data, response.header("content-type", "application/json"),
                             time.monotonic() - started)

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        started = time.monotonic()
        response = await self._request("POST", path, headers, body)
        return await self._read(response, path, started, 0.0)

    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamStream:
        return UpstreamStream(await self._request("POST", path, headers, body), self.name)

    async def get(self, path: str, *, timeout_s: float | None = None) -> UpstreamReply:
        started = time.monotonic()
        try:
            response = await asyncio.wait_for(self._request("GET", path, {}, b""), timeout_s) if timeout_s \
                else await self._request("GET", path, {}, b"")
        except TimeoutError as exc:
            raise self._fail(exc, path) from exc
        return await self._read(response, path, started, timeout_s or 0.0)


class UpstreamPool:
    """Every worker's pool, keyed by instance name."""

    def __init__(self, timeouts: Timeouts, max_connections: int = 256) -> None:
        self.timeouts = timeouts
        self._max_connections = max_connections
        self._by_name: dict[str, Upstream] = {}

    def add(self, name: str, base_url: str) -> Upstream:
        upstream = Upstream(name, base_url, timeouts=self.timeouts, max_connections=self._max_connections)
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
