"""vLLM's POST /v1/responses (the OpenAI Responses API, without tools) on the emulated engine.

The request (vLLM's ResponsesRequest): `input` a string (one user message) or a list of message
items (`{"role", "content"}`, content a string or a list of `input_text` / `output_text` parts),
`instructions` (a system message before them), `max_output_tokens`, `stream`, `top_logprobs` and
`include: ["message.output_text.logprobs"]`. The prompt is the chat template of those messages, one
engine sequence: prefill and decode steps as for a chat request. vLLM (without a store) refuses
`previous_response_id` (404), `background` (400) and tools without Harmony (400); so does this.
Without `max_output_tokens` the emulator's default output length applies (vLLM's default is the
rest of the context; the emulator bounds it for its callers, as for completions).

The answer (vLLM's ResponsesResponse): `{"id": "resp_...", "created_at", "instructions", "metadata",
"model", "object": "response", "output": [message], "parallel_tool_calls", "temperature",
"tool_choice", "tools", "top_p", "background", "max_output_tokens", ..., "status": "completed",
"top_logprobs", "truncation", "usage": {"input_tokens", "input_tokens_details": {"cached_tokens"},
"output_tokens", "output_tokens_details": {"reasoning_tokens"}, "total_tokens"}, "user"}`, the
message `{"id": "msg_...", "content": [{"annotations": [], "text", "type": "output_text",
"logprobs"}], "role": "assistant", "status": "completed", "type": "message"}`.

Streamed, as vLLM's responses_stream_generator sends it: SSE `event: <type>` + `data: <json>`
frames, `sequence_number` counting from 0: response.created and response.in_progress (the response
in progress, no output), at the first token response.output_item.added and
response.content_part.added, one response.output_text.delta per token, then
response.output_text.done, response.content_part.done, response.output_item.done and
response.completed (the whole response). No `[DONE]`. One `content_index` (0) throughout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters.emulator.asgi import SSE, Send, send_bytes
from adapters.emulator.legs import Leg, relay
from adapters.emulator.logprobs import token_entries
from adapters.emulator.openai_format import MAX_LOGPROBS, ApiError, check_tokens, generated_text, served_model_of, token_text
from adapters.emulator.sequence import Sequence
from conductor.core.tokenization import ByteTokenizer

_encode = msgspec.json.Encoder().encode
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    prompt: list[int]
    max_tokens: int
    stream: bool
    top_logprobs: int
    logprobs: bool  # include the output text's logprobs
    body: Mapping[str, Any]  # what the response echoes


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") in _TEXT_PARTS for p in content):
        return "".join(str(p.get("text") or "") for p in content)
    raise ApiError(400, "Only text content (input_text / output_text parts) is supported.", param="input")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    out = []
    if isinstance(body.get("instructions"), str):
        out.append({"role": "system", "content": body["instructions"]})
    value = body.get("input")
    if isinstance(value, str) and value:
        return [*out, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a non-empty string or a list of message items.", param="input")
    for item in value:
        if not isinstance(item, Mapping) or item.get("type", "message") != "message" or not isinstance(item.get("role"), str):
            raise ApiError(400, "Only message items are supported in `input`.", param="input")
        out.append({"role": item["role"], "content": _content_text(item.get("content"))})
    return out


def _refused(body: Mapping[str, Any]) -> None:
    """What vLLM without a response store or Harmony answers with an error."""
    if body.get("previous_response_id") is not None:
        rid = body["previous_response_id"]
        raise ApiError(404, f"Response with id '{rid}' not found.", "NotFoundError", "previous_response_id")
    if body.get("background"):
        raise ApiError(400, "This vLLM engine does not support `store=True` and therefore does not support the background mode.")
    if body.get("tools"):
        raise ApiError(400, "Tool use is not supported in Responses API without Harmony", param="tools")


def _output_bound(body: Mapping[str, Any], prompt_len: int, max_model_len: int, default_max_tokens: int) -> int:
    if prompt_len >= max_model_len:
        raise ApiError(
            400, f"The engine prompt length {prompt_len} exceeds the max_model_len {max_model_len}. Please reduce prompt."
        )
    room = max_model_len - prompt_len
    value = body.get("max_output_tokens")
    if value is None:
        return max(1, min(default_max_tokens, room))
    if type(value) is not int or value < 1:
        raise ApiError(400, "max_output_tokens must be an integer of at least 1.", param="max_output_tokens")
    return min(value, room)


def parse_responses(
    body: Any, *, tokenizer: ByteTokenizer, served_model: str, max_model_len: int, default_max_tokens: int
) -> ResponsesRequest:
    model = served_model_of(body, served_model)
    _refused(body)
    prompt = tokenizer.apply_chat_template(_messages(body))
    check_tokens(prompt, tokenizer.vocab_size, "input")
    max_tokens = _output_bound(body, len(prompt), max_model_len, default_max_tokens)
    top = body.get("top_logprobs") or 0
    if type(top) is not int or not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}.", param="top_logprobs")
    include = body.get("include") or []
    logprobs = isinstance(include, list) and LOGPROBS_INCLUDE in include
    return ResponsesRequest(model, prompt, max_tokens, bool(body.get("stream")), top, logprobs, body)


class ResponsesRenderer:
    """The response object, its message item and the stream's events, for one request."""

    def __init__(self, req: ResponsesRequest, response_id: str, message_id: str, created: int) -> None:
        self.req = req
        self.id = response_id
        self.message_id = message_id
        self.created = created
        self._sequence_number = 0

    def output_text(self, seq: Sequence) -> dict[str, Any]:
        req = self.req
        text = generated_text(seq.text_seed, seq.generated)
        logprobs = token_entries(seq.text_seed, 0, seq.generated, req.top_logprobs) if req.logprobs else None
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def message(self, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return {"id": self.message_id, "content": content, "role": "assistant", "status": status, "type": "message"}

    def response(self, seq: Sequence | None) -> dict[str, Any]:
        """The response object: in progress (no output yet) when `seq` is None, else completed."""
        body = self.req.body
        out: dict[str, Any] = {
            "id": self.id,
            "created_at": self.created,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.req.model,
            "object": "response",
            "output": [] if seq is None else [self.message([self.output_text(seq)], "completed")],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": [],
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "background": False,
            "max_output_tokens": self.req.max_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": None,
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": "in_progress" if seq is None else "completed",
            "text": body.get("text"),
            "top_logprobs": self.req.top_logprobs,
            "truncation": body.get("truncation", "disabled"),
            "usage": None if seq is None else self.usage(seq),
            "user": body.get("user"),
        }
        return out

    @staticmethod
    def usage(seq: Sequence) -> dict[str, Any]:
        return {
            "input_tokens": seq.prompt_tokens,
            "input_tokens_details": {"cached_tokens": seq.cached_tokens + seq.external_tokens},
            "output_tokens": seq.generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": seq.prompt_tokens + seq.generated,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE frame; every event carries the next sequence number."""
        data = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"

    def opening(self) -> bytes:
        started = self.response(None)
        return self.event("response.created", response=started) + self.event("response.in_progress", response=started)

    def first_output(self) -> bytes:
        empty = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return self.event("response.output_item.added", output_index=0, item=self.message([], "in_progress")) + self.event(
            "response.content_part.added", output_index=0, item_id=self.message_id, content_index=0, part=empty
        )

    def delta(self, seq: Sequence, k: int) -> bytes:
        req = self.req
        logprobs = token_entries(seq.text_seed, k, k + 1, req.top_logprobs, with_bytes=False) if req.logprobs else []
        return self.event(
            "response.output_text.delta",
            output_index=0,
            item_id=self.message_id,
            content_index=0,
            delta=token_text(seq.text_seed, k),
            logprobs=logprobs,
        )

    def closing(self, seq: Sequence) -> bytes:
        part = self.output_text(seq)
        where = {"output_index": 0, "item_id": self.message_id, "content_index": 0}
        return (
            self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"] or [])
            + self.event("response.content_part.done", **where, part=part)
            + self.event("response.output_item.done", output_index=0, item=self.message([part], "completed"))
            + self.event("response.completed", response=self.response(seq))
        )


async def answer_responses(
    send: Send, leg: Leg, renderer: ResponsesRenderer, extra: list[tuple[bytes, bytes]], first_token: Callable[[Leg], None]
) -> None:
    """The response, streamed as events or whole (nothing more once the client has left)."""
    stream = renderer.req.stream
    if stream:
        headers = [(b"content-type", SSE), (b"cache-control", b"no-cache"), *extra]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": renderer.opening(), "more_body": True})
    seq = leg.sequence
    async with contextlib.aclosing(relay([leg], first_token)) as tokens:
        async for _, k in tokens:
            if stream:
                opened = renderer.first_output() if k == 0 else b""  # numbered before its delta
                await send({"type": "http.response.body", "body": opened + renderer.delta(seq, k), "more_body": True})
    if seq.aborted:
        return
    if stream:
        await send({"type": "http.response.body", "body": renderer.closing(seq), "more_body": False})
    else:
        await send_bytes(send, 200, _encode(renderer.response(seq)), headers=extra)
