"""A stand-in vLLM worker for wire-format tests: it records every request body and header it
receives and answers the way vLLM's OpenAI server and KV connectors do, with knobs for failure."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.support.asgi import lifespan, whole_body

Scope = dict[str, Any]

# How long a worker with `answer_after` holds an answer at most: a bound that only a gateway which
# never sends the other leg while this one is open reaches (the test then fails on `released`).
ANSWER_HOLD_S = 30.0


@dataclass
class Recorded:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    received: float
    client_port: int
    released: bool | None = None  # held for `answer_after`: whether it was set while held (None: not held)


@dataclass
class StandIn:
    role: str = "mixed"  # prefill | decode | mixed
    model: str = "tiny"
    # the base models it serves, when given (else `model` alone): /v1/models lists these, and, as
    # vLLM does, a completion for a model neither here nor in `adapters` is answered 404
    models: tuple[str, ...] = ()
    # LoRA adapters loaded, served name -> path: listed as vLLM lists them (parent: the first base
    # model, root: the path); a test may add one while the worker runs (vLLM's dynamic loading)
    adapters: dict[str, str] = field(default_factory=dict)
    models_status: int = 200  # what GET /v1/models answers with (not 200: an error, no list)
    models_reads: int = 0  # GET /v1/models received
    engine_id: str = "engine-0"
    token_delay_s: float = 0.0
    # a stream's every token after the first waits for one release: a test steps the worker in
    # lockstep with what it has received, so a chunk held back anywhere shows as a stream that stops
    token_gate: threading.Semaphore | None = None
    prefill_delay_s: float = 0.0
    fail_status: int | None = None  # answer every completion with this status
    hang: bool = False  # never answer completions
    # a NIXL decode with bidirectional_kv_xfer: full answers say where the request's KV stays pinned
    bidirectional: bool = False
    fail_pulls: int | None = None  # a prefill: answer requests that carry a readback with this status
    cached_tokens: int = 0
    metrics_text: str = ""  # what GET /metrics answers (vLLM's cache_config_info line tells the block size)
    # The order of events across stand-ins, with no clock: `arrived` is set once a request is
    # recorded; a worker given another's `arrived` as `answer_after` holds each answer until that
    # worker has received a request, so only legs that overlap are answered at once.
    arrived: threading.Event = field(default_factory=threading.Event)
    answer_after: threading.Event | None = None
    requests: list[Recorded] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def model_cards(self) -> list[dict[str, Any]]:
        """What its /v1/models lists: its base models, then its adapters (vLLM's card shapes)."""
        bases = self.models or (self.model,)
        cards: list[dict[str, Any]] = [{"id": m, "object": "model", "owned_by": "vllm", "root": m, "parent": None} for m in bases]
        for name, path in self.adapters.items():
            cards.append({"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": bases[0]})
        return cards

    def bodies(self, path_suffix: str = "completions") -> list[dict[str, Any]]:
        return [r.body for r in self.requests if r.path.endswith(path_suffix)]

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        path = scope["path"]
        if scope["method"] == "GET":
            if path == "/health":
                return await _json(send, 200, {})
            if path == "/metrics":
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
                return await send({"type": "http.response.body", "body": self.metrics_text.encode()})
            if path == "/v1/models":
                self.models_reads += 1
                if self.models_status != 200:
                    return await _json(send, self.models_status, {"error": {"message": "down", "code": self.models_status}})
                return await _json(send, 200, {"object": "list", "data": self.model_cards()})
            return await _json(send, 404, {"error": "no"})
        body = json.loads(await whole_body(receive))
        if path == "/tokenize":  # not served, as by an engine without the route: kv.tokenizer auto falls back
            return await _json(send, 404, {"error": "no"})
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        record = Recorded(path, body, headers, time.monotonic(), scope["client"][1])
        self.requests.append(record)
        self.arrived.set()
        if self.models and body.get("model") not in (*self.models, *self.adapters):
            message = f"The model `{body.get('model')}` does not exist."
            return await _json(send, 404, {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}})
        rid = headers.get("x-request-id", "")
        pulling = (body.get("kv_transfer_params") or {}).get("remote_block_ids") and self.role == "prefill"
        if self.fail_pulls is not None and pulling:
            return await _json(
                send,
                self.fail_pulls,
                {"error": {"message": "KV load failure", "type": "x", "param": None, "code": self.fail_pulls}},
            )
        if self.fail_status is not None:
            return await _json(
                send, self.fail_status, {"error": {"message": "boom", "type": "x", "param": None, "code": self.fail_status}}
            )
        watcher = asyncio.create_task(_disconnected(receive, asyncio.current_task()))
        try:
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.prefill_delay_s)
            if self.answer_after is not None:  # off the loop, which keeps serving
                record.released = await asyncio.to_thread(self.answer_after.wait, ANSWER_HOLD_S)
            await self._answer(send, path, body, rid)
            self.finished.append(rid)
        except (asyncio.CancelledError, OSError):
            self.cancelled.append(rid)
            raise
        finally:
            watcher.cancel()

    async def _answer(self, send: Any, path: str, body: dict[str, Any], rid: str) -> None:
        if path.endswith("/embeddings"):  # vLLM's pooling answer, one vector per input
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            data = [{"object": "embedding", "index": i, "embedding": [0.25, -0.5, float(i)]} for i in range(len(inputs))]
            return await _json(
                send, 200, {"object": "list", "data": data, "model": self.model, "usage": {"prompt_tokens": 4, "total_tokens": 4}}
            )
        if path.endswith("/responses"):  # the Responses API's non-streamed shape
            n = body.get("max_output_tokens") or 16
            return await _json(
                send,
                200,
                {
                    "id": f"resp_{rid}",
                    "object": "response",
                    "created_at": 1,
                    "model": self.model,
                    "status": "completed",
                    "output": [
                        {
                            "type": "message",
                            "id": "msg_1",
                            "status": "completed",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": "x " * n, "annotations": []}],
                        }
                    ],
                    "parallel_tool_calls": True,
                    "tool_choice": "auto",
                    "tools": [],
                    "usage": {
                        "input_tokens": 4,
                        "output_tokens": n,
                        "total_tokens": 4 + n,
                        "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0},
                    },
                },
            )
        chat = path.endswith("chat/completions")
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 10
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        params = body.get("kv_transfer_params") or {}
        out_params = None
        if self.role == "prefill" and params.get("do_remote_decode"):
            out_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3],
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
        if self.role == "decode" and self.bidirectional:
            out_params = {
                "do_remote_prefill": False,
                "do_remote_decode": True,
                # one block per 16 prompt bytes at least: covers what a byte tokenizer keys
                "remote_block_ids": [list(range(1, len(json.dumps(body.get("prompt"))) // 16 + 2))],
                "remote_engine_id": self.engine_id,
                "remote_request_id": rid,
                "remote_host": "127.0.0.1",
                "remote_port": 5601,
                "tp_size": 1,
                "remote_num_tokens": prompt_tokens + n - 1,
            }
        cid = ("chatcmpl-" if chat else "cmpl-") + rid
        if not body.get("stream"):
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x " * n},
                    "finish_reason": "length",
                }
            else:
                choice = {"index": 0, "text": "x " * n, "finish_reason": "length"}
            payload = {
                "id": cid,
                "object": "chat.completion" if chat else "text_completion",
                "created": 1,
                "model": self.model,
                "choices": [choice],
                "usage": usage,
                "kv_transfer_params": out_params,
            }
            return await _json(send, 200, payload)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(n):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.token_gate is not None and i > 0:
                # off the loop (which keeps serving), in short waits: a cancelled stream leaves no
                # thread blocked for good
                while not await asyncio.to_thread(self.token_gate.acquire, True, 0.1):
                    pass
            if chat:
                chunk = {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": {"content": "x "}, "finish_reason": None}],
                }
            else:
                chunk = {
                    "id": cid,
                    "object": "text_completion",
                    "created": 1,
                    "model": self.model,
                    "choices": [{"index": 0, "text": "x ", "finish_reason": None}],
                }
            await send(
                {"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n", "more_body": True}
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            final: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }
            await send(
                {"type": "http.response.body", "body": b"data: " + json.dumps(final).encode() + b"\n\n", "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _disconnected(receive: Any, task: Any) -> None:
    # Like vLLM: when the client's connection goes away, the request is aborted.
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def _json(send: Any, status: int, payload: Any) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


@dataclass
class BootstrapStandIn:
    """The Mooncake bootstrap server of a prefill instance (vLLM's shape of GET /query)."""

    engine_id: str = "engine-0"
    shape: str = "dp_rank"  # "dp_rank": {dp: {engine_id, worker_addr}}; "engine": {engine_id: {dp: ...}}
    queries: int = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        self.queries += 1
        if self.shape == "dp_rank":
            payload: Any = {"0": {"engine_id": self.engine_id, "worker_addr": {"0": {"0": "127.0.0.1:7000"}}}}
        else:
            payload = {self.engine_id: {"0": {"0": {"0": "127.0.0.1:7000"}}}}
        await _json(send, 200, payload)
