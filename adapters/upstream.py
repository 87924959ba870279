"""Pooled HTTP clients to the workers.

One aiohttp session (one connection pool) per upstream instance, created at start-up and reused by
every request: a request never opens a client of its own. aiohttp rather than httpx because the
gateway's CPU per request is its budget: on this box aiohttp costs about 150 us of CPU per upstream
call against httpx's 510 us (measured side by side, see benchmarks/). Connections set TCP_NODELAY
(aiohttp does it for every connection it makes; a test checks the option on the live socket) so
small SSE writes are not held back by Nagle's algorithm meeting delayed ACKs (the ~40 ms stall seen
in some routers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
import aiohttp

from conductor.errors import UpstreamError, UpstreamTimeout


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 120.0  # longest silence between two reads
    total_s: float = 600.0


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A finished, non-streamed upstream answer."""

    status: int
    body: bytes
    content_type: str
    elapsed_s: float


class UpstreamStream:
    """An open streamed upstream answer; iterate the bytes, always close it."""

    def __init__(self, response: aiohttp.ClientResponse, instance: str, read_s: float) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "text/event-stream")
        self.instance = instance
        self._read_s = read_s

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(f"{self.instance} stopped sending for {self._read_s:g} s", instance=self.instance) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{self.instance} broke the stream: {exc}", instance=self.instance) from exc

    def close(self) -> None:
        """Drop the connection: the worker sees the client go away and aborts the request."""
        self._response.close()

    async def release(self) -> None:
        """Return a fully read connection to the pool."""
        self._response.release()


class Upstream:
    """The connection pool to one worker."""

    def __init__(self, name: str, base_url: str, *, timeouts: Timeouts, max_connections: int = 256) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            keepalive_timeout=30,
        )
        self._session = aiohttp.ClientSession(
            base_url=self.base_url,
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=self.timeouts.total_s,
                sock_connect=self.timeouts.connect_s,
                sock_read=self.timeouts.read_s,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"upstream {self.name} used before start()")
        return self._session

    def _fail(self, exc: BaseException, path: str) -> UpstreamError:
        if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
            return UpstreamTimeout(f"{self.name} did not answer {path} in time", instance=self.name)
        return UpstreamError(f"{self.name} failed on {path}: {type(exc).__name__}: {exc}", instance=self.name)

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamReply:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self.session.post(path, data=body, headers=headers) as resp:
                data = await resp.read()
                return UpstreamReply(
                    resp.status, data, resp.headers.get("Content-Type", "application/json"), loop.time() - started
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._fail(exc, path) from exc

    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamStream:
        try:
            response = await self.session.post(path, data=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._fail(exc, path) from exc
        return UpstreamStream(response, self.name, self.timeouts.read_s)

    async def get(self, path: str, *, timeout_s: float | None = None) -> UpstreamReply:
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        try:
            async with self.session.get(path, timeout=timeout) as resp:
                data = await resp.read()
                return UpstreamReply(
                    resp.status, data, resp.headers.get("Content-Type", ""), loop.time() - started
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._fail(exc, path) from exc


class UpstreamPool:
    """Every worker's pool, keyed by instance name; plus a shared session for other addresses
    (bootstrap servers) so those also reuse connections."""

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
