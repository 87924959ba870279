"""The KV event subscribers of the instances: made from their settings, started together, and
watched for instances that went silent.

A subscriber whose socket cannot be bound or connected at start-up (a port another process holds,
an endpoint that is no address) stops the gateway with a `ConfigError` naming the instance, the
address and the setting, which `conductor serve` prints as one line, instead of a ZMQError
traceback out of the ASGI lifespan.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import httpx
import zmq
import zmq.asyncio

from adapters.kv_events import EventSource, EventSubscriber, offset_endpoint
from conductor.config.kv import KVEventsEndpoint
from conductor.core.errors import ConfigError
from conductor.core.event_bounds import EventBounds
from conductor.kv.canary import EventSink

log = logging.getLogger(__name__)


def subscribers_for(
    instance: str,
    url: str,
    events: KVEventsEndpoint,
    feeder: EventSink,
    context: zmq.asyncio.Context,
    *,
    replay_timeout_s: float,
    catch_up: bool,
    bounds: EventBounds,
) -> list[EventSubscriber]:
    """One subscriber per data-parallel rank of `instance` (rank r publishes on port + r). `feeder`:
    the index feeder, or the KV canary in front of it (conductor/kv/canary.py)."""
    return [
        EventSubscriber(
            EventSource.for_instance(
                instance,
                url,
                offset_endpoint(events.endpoint, rank),
                None if events.replay_endpoint is None else offset_endpoint(events.replay_endpoint, rank),
                events.topic,
                rank,
            ),
            feeder.on_batch,
            feeder.on_resync,
            context=context,
            replay_timeout_s=replay_timeout_s,
            catch_up=catch_up,
            **bounds,
        )
        for rank in range(events.data_parallel_size)
    ]


def first_address(subscribers: Sequence[EventSubscriber], instance: str) -> str | None:
    """Where the gateway hears `instance`'s events (its first rank's), None when nowhere."""
    return next((sub.address for sub in subscribers if sub.source.instance == instance), None)


def feed_progress(subscribers: Sequence[EventSubscriber], instance: str) -> tuple[int, int | None, bool]:
    """(batches applied, last seq, replay endpoint known) of `instance`'s first rank: a last seq
    past the batches applied means batches went out before the gateway listened."""
    for sub in subscribers:
        if sub.source.instance == instance and sub.source.rank == 0:
            stats = sub.stats
            return stats.batches, stats.last_seq, sub.source.replay_endpoint is not None
    return 0, None, False


async def start_subscribers(subscribers: Sequence[EventSubscriber]) -> None:
    """Start them all at once (each may wait up to replay_timeout_s for its worker's replay); a
    socket that cannot be opened is a ConfigError naming the first such instance."""
    results = await asyncio.gather(*(sub.start() for sub in subscribers), return_exceptions=True)
    for sub, result in zip(subscribers, results, strict=True):
        if isinstance(result, zmq.ZMQError):
            raise _socket_error(sub, result) from None
        if isinstance(result, BaseException):
            raise result


def _socket_error(sub: EventSubscriber, exc: zmq.ZMQError) -> ConfigError:
    source = sub.source
    verb = "bind" if sub.binds else "connect to"
    reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
    why = (
        "the gateway binds there because the endpoint names a host, as vLLM connects to it: another process holds "
        "that port (another gateway, a worker on the same host?), or the host is not one of this machine's addresses"
        if sub.binds
        else "it is no address the gateway can connect to"
    )
    return ConfigError(
        f"KV events of instance {source.instance}: cannot {verb} {sub.address} "
        f"(kv_events_endpoint {source.endpoint!r}, data-parallel rank {source.rank}): {reason}; {why}"
    )


async def watch_silent_instances(
    subscribers: Callable[[], Sequence[EventSubscriber]],
    urls: Callable[[], dict[str, str]],
    gone: set[str],
    on_gone: Callable[[str], Awaitable[None]],
    silence_s: float,
) -> None:
    """Forever: an instance whose events stopped for `silence_s` and whose /health fails is added
    to `gone` and handed to `on_gone` (the index forgets it); its events coming back take it out."""
    interval = max(silence_s / 2, 0.05)
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            await asyncio.sleep(interval)
            now = asyncio.get_running_loop().time()
            members = urls()
            for sub in subscribers():
                inst = sub.source.instance
                last = sub.stats.last_event_at
                if last is not None and now - last < silence_s:
                    gone.discard(inst)
                    continue
                if inst in gone or inst not in members:
                    continue
                if not await _healthy(client, members[inst]):
                    log.warning("instance %s: no KV events for %.0fs and /health fails: dropped from the index", inst, silence_s)
                    gone.add(inst)
                    await on_gone(inst)


async def _healthy(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url.rstrip('/')}/health")).status_code == 200
    except httpx.HTTPError:
        return False
