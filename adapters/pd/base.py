"""What every P/D handshake shares: the targets it talks to, the outgoing request, the result."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import msgspec

from adapters.upstream import Upstream, UpstreamReply, UpstreamStream
from conductor.core.errors import UpstreamError
from conductor.core.fast_init import fast_init

CACHED_TOKENS_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

# Fields that only make sense for the leg that generates tokens; vLLM's toy proxy strips them from
# the prefill leg (a 1-token prefill cannot honour a minimum length).
# sampling the prefill leg must not do: its one token is thrown away, so logprobs are wasted work, and
# more than one choice would start child requests whose KV holds no decode ever reads (vLLM answers
# only the first prompt's kv_transfer_params; the others stay pinned until the connector's timeout)
DECODE_ONLY_FIELDS = ("min_tokens", "min_completion_tokens", "stream_options", "logprobs", "top_logprobs", "best_of")


def encode_json(obj: Any) -> bytes:
    return _encode(obj)


def decode_json(data: bytes) -> Any:
    return _decode(data)


def host_of(url: str) -> str:
    """The host part of a URL, IPv6 addresses in brackets (as bootstrap addresses need)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True, slots=True)
class Target:
    """One chosen worker."""

    name: str
    upstream: Upstream
    host: str  # host part of its URL
    bootstrap_port: int | None = None  # Mooncake / SGLang bootstrap server on that host
    # it runs vLLM's --scheduling-policy priority (its settings' `scheduling_policy`): only then does
    # a leg to it carry the request's engine priority (`leg_body`)
    priority_scheduling: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class Outgoing:
    """The client's request as the gateway will forward it."""

    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: Mapping[str, Any]  # the client's JSON, with any gateway substitutions (token ids)
    headers: Mapping[str, str]  # X-Request-ID, Content-Type, upstream Authorization
    request_id: str  # the gateway's own id: unique, the only id workers and internal tables see
    stream: bool
    client_request_id: str = ""  # the client's X-Request-ID (checked), echoed back, never a key
    # kv_transfer_params the prefill leg adds to its usual ones: a pull the decision planned (NIXL
    # readback of a decode's pinned KV, conductor/routing/readback.py); None: no pull
    pull: Mapping[str, Any] | None = None
    # headers of one leg ("prefill", or "decode": the leg that answers the client) on top of
    # `headers`, asked as that leg is sent: the gateway's trace context of the leg (its span starts
    # then, conductor/ops/tracing.py); None: every leg sends `headers`
    leg_headers: Callable[[str], Mapping[str, str]] | None = None
    # vLLM's `priority` for the request's legs on instances that schedule by priority (its class's,
    # conductor/routing/priority.py); None: none. `body` itself never holds a `priority`
    engine_priority: int | None = None
    # called once the prefill leg of a sequential handshake (nixl) has answered, with its seconds
    # from sent to answered and the cached tokens it reported, before the decode leg is sent: the
    # prefill instance is free of the request then, not when the decode answers (a non-streamed
    # decode answers at its last token); None: nobody is told
    prefill_answered: Callable[[float, int | None], None] | None = None

    def headers_for(self, leg: str) -> Mapping[str, str]:
        """The headers the `leg` ("prefill" or "decode") sends, asked once as it is sent."""
        if self.leg_headers is None:
            return self.headers
        return {**self.headers, **self.leg_headers(leg)}


@dataclass(slots=True)
class Exchange:
    """The outcome of a handshake: the decode (or only) leg's answer, plus what the prefill leg told.

    Exactly one of `stream` and `reply` is set. `pending` holds legs still running in the
    background (a concurrent prefill); whoever finishes the exchange must `abort()` or await them.
    """

    stream: UpstreamStream | None = None
    reply: UpstreamReply | None = None
    prefill_s: float | None = None  # prefill leg: sent to answered
    prefill_cached_tokens: int | None = None  # as the prefill worker reported
    prefill_failed: BaseException | None = None
    pending: list[asyncio.Task[Any]] = field(default_factory=list)
    # the decode's own kv_transfer_params, taken off its answer before the client sees it: where a
    # bidirectional NIXL decode keeps the request's KV for a later readback
    decode_kv_params: Any = None

    def abort(self) -> None:
        """Cancel every leg still in flight: the workers see their connections close."""
        for task in self.pending:
            task.cancel()
        if self.stream is not None:
            self.stream.close()

    async def settle(self, timeout_s: float | None = None) -> bool:
        """Wait for background legs to end (after a normal finish), at most `timeout_s`; legs still
        running then are cancelled. True when every leg ended by itself."""
        if not self.pending:
            return True
        _done, late = await asyncio.wait(self.pending, timeout=timeout_s)
        for task in late:
            task.cancel()
        for task in self.pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return not late


class NoBootstrap:
    """For handshakes that need nothing from the prefill instances before the first request."""

    prefill_answers_first = False

    async def start(self, prefills: list[Target]) -> None:
        return None

    def ready(self, target: Target) -> bool:
        return True

    async def close(self) -> None:
        return None


class PDProtocol(Protocol):
    """A P/D handshake: how one request is split into legs."""

    name: str
    # the prefill leg answers before the decode leg is sent (nixl: Outgoing.prefill_answered is
    # called then), so the gateway sees a prefill's end even when the answer is not streamed
    prefill_answers_first: bool

    async def start(self, prefills: list[Target]) -> None: ...

    def ready(self, target: Target) -> bool: ...

    async def exchange(self, out: Outgoing, prefill: Target, decode: Target | None) -> Exchange: ...

    async def close(self) -> None: ...


@runtime_checkable
class PrefixStager(Protocol):
    """Optional beside PDProtocol: a handshake that can have a prefill holding a prefix pin it for
    another prefill to pull (vLLM NIXL, conductor/routing/peer_pull.py). It names Target and
    Outgoing, so it lives here rather than in conductor/core (which imports nothing of the project)."""

    async def stage_prefix(
        self, holder: Target, out: Outgoing, token_ids: Sequence[int], priority: int | None = None
    ) -> tuple[Any, float]:
        """Have `holder` compute one token after `token_ids` and keep the request's KV for a
        reader: (its JSON answer, seconds from sent to answered). Raises UpstreamError on failure."""
        ...


def cached_tokens_of(reply_body: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of an OpenAI response, when present."""
    if not isinstance(reply_body, dict):
        return None
    usage = reply_body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def prefill_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking the connector to keep the KV."""
    out = {k: v for k, v in body.items() if k not in DECODE_ONLY_FIELDS}
    out["kv_transfer_params"] = dict(kv_transfer_params)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "n" in out:
        out["n"] = 1
    return out


def leg_body(target: Target, out: Outgoing, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """`body` as one leg sends it to `target`: with the request's engine priority where `target`
    schedules by priority, never elsewhere (vLLM's API calls a non-zero one there an error)."""
    if out.engine_priority is None or not target.priority_scheduling:
        return body
    return {**body, "priority": out.engine_priority}


def leg_failed(target: Target, leg: str, status: int, body: bytes) -> UpstreamError:
    """A leg answered an error status: the error keeps the worker's own status and body (a 4xx is
    the client's fault and is passed on as such)."""
    return UpstreamError(
        f"{leg} leg on {target.name} answered HTTP {status}", upstream_status=status, instance=target.name, body=body
    )


def check_leg(reply: UpstreamReply, target: Target, leg: str) -> Any:
    """Decode a non-streamed leg's JSON answer, or raise `leg_failed`."""
    if reply.status >= 400:
        raise leg_failed(target, leg, reply.status, reply.body)
    if reply.content_type.startswith("text/event-stream"):
        # SGLang's prefill leg gets the client's body as is, so it may stream: keep its usage only
        match = CACHED_TOKENS_RE.search(reply.body)
        return {"usage": {"prompt_tokens_details": {"cached_tokens": int(match.group(1))}}} if match else {}
    try:
        return decode_json(reply.body)
    except msgspec.DecodeError as exc:
        raise UpstreamError(f"{leg} leg on {target.name} answered invalid JSON", instance=target.name) from exc


async def open_leg(target: Target, out: Outgoing, body: Mapping[str, Any]) -> Exchange:
    """Send the leg that answers the client: streamed or not, as the client asked."""
    data = encode_json(leg_body(target, out, body))
    headers = out.headers_for("decode")
    if out.stream:
        stream = await target.upstream.open_stream(out.path, data, headers)
        if stream.status >= 400:
            try:
                payload = b"".join([c async for c in stream.chunks()])
            finally:
                stream.close()
            raise leg_failed(target, "decode", stream.status, payload)
        return Exchange(stream=stream)
    reply = await target.upstream.post(out.path, data, headers)
    if reply.status >= 500:  # a 4xx answer is relayed to the client as the worker wrote it
        raise leg_failed(target, "decode", reply.status, reply.body)
    return Exchange(reply=reply)
