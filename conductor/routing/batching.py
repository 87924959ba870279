"""Batched completions prompts in P/D: split into one request per prompt, merge the answers back.

vLLM answers a batched /v1/completions prefill with ONE `kv_transfer_params`, the first prompt's
(`final_res_batch[0].kv_transfer_params`): sent as one request through a P/D handshake, every prompt
but the first would decode on the first prompt's KV. So the gateway sends each prompt as its own
request (own prefill leg, params and decode leg) and merges the answers into what one mixed vLLM
engine answers for the batch:

- choices in prompt order, `index` = i * n + j (prompt i, choice j of that prompt, n per prompt);
- `usage` summed over the prompts (prompt, completion, total tokens; cached tokens when reported);
- `id`, `created`, `model` (and every other top-level field) from the first prompt's answer;
  no top-level `kv_transfer_params` (a worker-to-worker field).
No I/O here: the streams are whatever async iterators of bytes the caller hands in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec

from conductor.core.errors import UpstreamError

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
DONE_EVENT = b"data: [DONE]\n\n"
_QUEUE_PER_STREAM = 16  # events read ahead per sub-stream before its reader waits for the client


def split_prompts(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """One /v1/completions body per prompt when `prompt` is a batch, else None.

    A batch: a list of more than one element, all strings or all lists (token-id lists, kept as
    token ids). None for one prompt: a string, a list of token ids (vLLM's single token prompt), or
    a batch of ONE element, left as it is since a worker answers it exactly as a single prompt (one
    choice, index 0, its own kv_transfer_params). None too for a list mixing forms: the request
    validation's (or the worker's) 400. The bodies are shallow copies: replace fields, never mutate.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return None
    return [{**body, "prompt": p} for p in prompt]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(value: Any) -> int:
    return _int(value) or 0


def _cached(usage: Mapping[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None


def sum_usage(usages: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """vLLM's usage of a batch: the prompts' usages summed; None when no prompt reported one.
    `prompt_tokens_details`: `{"cached_tokens": sum}` when any prompt reported cached tokens, null
    when the answers carried the key without a count, absent when none carried it."""
    present = [u for u in usages if isinstance(u, Mapping)]
    if not present:
        return None
    prompt = sum(_count(u.get("prompt_tokens")) for u in present)
    completion = sum(_count(u.get("completion_tokens")) for u in present)
    # total = prompt + completion, as vLLM counts it (so a sub-answer lacking total_tokens still adds up)
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    cached = [c for u in present if (c := _cached(u)) is not None]
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    elif any("prompt_tokens_details" in u for u in present):
        out["prompt_tokens_details"] = None
    return out


def _choice_index(choice: Mapping[str, Any], position: int) -> int:
    index = _int(choice.get("index"))
    return position if index is None else index


def merge_replies(replies: Sequence[bytes]) -> bytes:
    """The non-streamed answers of the single-prompt requests (prompt order) merged into the batch's
    (module doc); n = choices per answer (every sub-request carries the client's n). UpstreamError
    (502) when an answer is not a JSON object with a `choices` list."""
    if not replies:
        raise ValueError("merge_replies needs at least one reply")
    bodies: list[dict[str, Any]] = []
    for raw in replies:
        try:
            body = _decode(raw)
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"a batched prompt's answer is not JSON: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            raise UpstreamError("a batched prompt's answer has no choices list")
        bodies.append(body)
    n = max(1, max(len(b["choices"]) for b in bodies))
    choices: list[Any] = []
    for i, body in enumerate(bodies):
        own = [c for c in body["choices"] if isinstance(c, dict)]
        for position, choice in enumerate(own):
            choices.append({**choice, "index": i * n + _choice_index(choice, position)})
    merged = dict(bodies[0])
    merged.pop("kv_transfer_params", None)
    merged["choices"] = choices
    usage = sum_usage([b.get("usage") for b in bodies])
    if usage is not None or "usage" in merged:
        merged["usage"] = usage
    return _encode(merged)


class _SseBuffer:
    """Cuts one byte stream into SSE events at blank lines (`\\n\\n` or `\\r\\n\\r\\n`), whatever
    the chunk boundaries; an event is returned without its separator."""

    __slots__ = ("_buf", "_scanned")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes already known to hold no separator (minus a possible partial one)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        events: list[bytes] = []
        while True:
            start = max(0, self._scanned - 3)  # a separator may straddle the old end
            lf = self._buf.find(b"\n\n", start)
            crlf = self._buf.find(b"\r\n\r\n", start)
            if lf < 0 and crlf < 0:
                self._scanned = len(self._buf)
                return events
            cut, width = (crlf, 4) if crlf >= 0 and (lf < 0 or crlf < lf) else (lf, 2)
            events.append(bytes(self._buf[:cut]))
            del self._buf[: cut + width]
            self._scanned = 0

    def rest(self) -> bytes | None:
        """What is left when the stream ended without a final blank line, if anything."""
        rest = bytes(self._buf).strip()
        self._buf.clear()
        return rest or None


def _data_of(event: bytes) -> bytes | None:
    """The event's data (data lines joined by newlines, as SSE defines); None when it has none."""
    lines = [line.rstrip(b"\r") for line in event.split(b"\n")]
    data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


_Item = tuple[int, bytes | BaseException | None]  # (prompt, an event / its reader's error / its end)


class StreamMerger:
    """The SSE streams of the single-prompt requests (stream i = prompt i) merged into the stream one
    vLLM engine sends for the batch: `async for chunk in merger`.

    - Each sub-stream is cut into events at blank lines whatever its chunk boundaries; every event
      is relayed as soon as its last byte arrives (prompts interleaved in arrival order), ending `\\n\\n`.
    - JSON chunks with choices get `choices[k].index` rewritten to i * n + index (bytes relayed as
      they came when that changes nothing); usage they carry is relayed as is.
    - Dropped: each sub-stream's `data: [DONE]` and usage-only chunk (`"choices": []` with `usage`);
      the last usage each reported is kept (`usage_by_prompt`).
    - Relayed unchanged: events without data (comments), data that is not a JSON object with
      choices, error events (`{"error": ...}`: the other prompts go on, as in vLLM).
    - Once every sub-stream ended: if `include_usage` and any reported usage, one chunk `{"id",
      "object", "created", "model" (the first prompt's), "choices": [], "usage": <sum>}`; then one
      `data: [DONE]`.
    - A sub-stream that raises: the others are cancelled and closed (`aclose()` where they have
      it), the error re-raised. Closing the merger (`aclose()`, or cancelling the task iterating
      it) closes them all the same way.

    Then `usage` (summed, or None), `prompt_tokens`, `completion_tokens` and `cached_tokens` (None
    when no prompt reported any) are for the gateway to learn from.
    """

    def __init__(self, streams: Sequence[AsyncIterator[bytes]], *, include_usage: bool, n: int = 1) -> None:
        if not streams:
            raise ValueError("StreamMerger needs at least one stream")
        self.streams = list(streams)
        self.include_usage = include_usage
        self.n = max(1, n)
        self.usage_by_prompt: list[dict[str, Any] | None] = [None] * len(self.streams)
        self._heads: list[dict[str, Any] | None] = [None] * len(self.streams)
        self._gen = self._merge()
        self._started = False

    @property
    def usage(self) -> dict[str, Any] | None:
        return sum_usage(self.usage_by_prompt)

    @property
    def prompt_tokens(self) -> int:
        return sum(_count(u.get("prompt_tokens")) for u in self.usage_by_prompt if u)

    @property
    def completion_tokens(self) -> int:
        return sum(_count(u.get("completion_tokens")) for u in self.usage_by_prompt if u)

    @property
    def cached_tokens(self) -> int | None:
        cached = [c for u in self.usage_by_prompt if u and (c := _cached(u)) is not None]
        return sum(cached) if cached else None

    def __aiter__(self) -> StreamMerger:
        return self

    async def __anext__(self) -> bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()
        if not self._started:  # never iterated: its sub-streams were opened all the same
            await self._stop([])

    async def _read(self, i: int, queue: asyncio.Queue[_Item]) -> None:
        buffer = _SseBuffer()
        try:
            async for data in self.streams[i]:
                for event in buffer.feed(data):
                    await queue.put((i, event))
            rest = buffer.rest()
            if rest is not None:  # a last event without its blank line: still an event
                await queue.put((i, rest))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which stops all and re-raises
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    def _rewrite(self, i: int, event: bytes) -> bytes | None:
        """The event as the merged stream carries it, or None to drop it."""
        data = _data_of(event)
        if data is None:
            return event + b"\n\n"
        if data.strip() == b"[DONE]":
            return None
        try:
            obj = _decode(data)
        except msgspec.DecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            return event + b"\n\n"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage_by_prompt[i] = usage  # cumulative per prompt: the last one counts
        if self._heads[i] is None:
            self._heads[i] = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        choices = obj["choices"]
        if not choices:
            return None if usage is not None else event + b"\n\n"
        changed = False
        for position, choice in enumerate(choices):
            if isinstance(choice, dict):
                new = i * self.n + _choice_index(choice, position)
                if choice.get("index") != new:
                    choice["index"] = new
                    changed = True
        return b"data: " + _encode(obj) + b"\n\n" if changed else event + b"\n\n"

    async def _merge(self) -> AsyncGenerator[bytes, None]:
        self._started = True
        queue: asyncio.Queue[_Item] = asyncio.Queue(_QUEUE_PER_STREAM * len(self.streams))
        loop = asyncio.get_running_loop()
        readers = [loop.create_task(self._read(i, queue)) for i in range(len(self.streams))]
        try:
            running = len(readers)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    out = self._rewrite(i, item)
                    if out is not None:
                        yield out
            usage = self.usage
            if self.include_usage and usage is not None:
                head = next((h for h in self._heads if h is not None), {})  # the first prompt's
                yield b"data: " + _encode({**head, "choices": [], "usage": usage}) + b"\n\n"
            yield DONE_EVENT
        finally:
            await self._stop(readers)

    async def _stop(self, readers: list[asyncio.Task[None]]) -> None:
        """Cancel the readers, then close the sub-streams (an async generator cannot be closed while
        a reader is inside it). Errors while closing are not the consumer's: suppressed."""
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for stream in self.streams:
            close = getattr(stream, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
