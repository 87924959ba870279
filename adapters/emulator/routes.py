"""The emulator's request plumbing and the routes beside generation: vLLM's /v1/models,
/tokenize, /v1/embeddings (embeddings.py) and /v1/responses (responses.py).

LoRA adapters are listed in /v1/models after the base model, and loaded and unloaded at run time
when that is allowed (lora.py).

`ApiRoutes` is the base of `EmulatorApp` (app.py), which owns the engine and the P/D legs: a request
is read and logged (`_accept`: GET /emulator/requests shows it, with the times the engine modelled
for each of its sequences), then served while a watcher aborts its sequences if the client leaves
(`_running`). Embeddings and Responses requests are plain local sequences (no P/D plan): vLLM
serves them on mixed workers, where the gateway sends them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from typing import Any

import msgspec

from adapters.emulator.asgi import BodyTooLarge, Receive, Scope, Send, header, read_body, send_bytes, send_json
from adapters.emulator.config import EmulatorConfig
from adapters.emulator.embeddings import answer_embeddings, embeddings_body, parse_embeddings
from adapters.emulator.engine import Engine
from adapters.emulator.legs import Accepted, Leg, fan_out
from adapters.emulator.lora import LoraAdapters
from adapters.emulator.openai_format import ApiError, error_body, priority_of, tokenize_response
from adapters.emulator.protocols import LegPlan
from adapters.emulator.responses import ResponsesRenderer, answer_responses, parse_responses
from adapters.emulator.tracing import EmulatorTracing, request_span
from conductor.core.tokenization import ByteTokenizer

_decode = msgspec.json.Decoder().decode
# vLLM's runtime LoRA routes (served only when runtime updates are allowed)
LORA_UPDATE_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class ApiRoutes:
    """What every OpenAI route shares, and the routes that are not completions or chat."""

    config: EmulatorConfig
    engine: Engine
    tokenizer: ByteTokenizer
    loras: LoraAdapters
    requests: deque[dict[str, Any]]
    tracing: EmulatorTracing | None
    created: int

    async def _watch(self, receive: Receive, legs: list[Leg], base_id: str) -> None:
        raise NotImplementedError  # EmulatorApp's: aborts the legs when the client disconnects

    def _first_token(self, leg: Leg) -> None:
        raise NotImplementedError  # EmulatorApp's: records the modelled times, publishes P/D keys

    def _models(self) -> dict[str, Any]:
        model = self.config.model
        card = {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card, *self.loras.cards(self.created)]}

    async def _lora_update(self, path: str, receive: Receive, send: Send) -> None:
        """POST /v1/load_lora_adapter or /v1/unload_lora_adapter: vLLM's plain-text success line,
        or its error."""
        ok, body = await self._read_json(receive, send)
        if not ok:
            return
        try:
            line = self.loras.update(path, body)
        except ApiError as err:
            await send_bytes(send, err.status, error_body(err))
            return
        await send_bytes(send, 200, line.encode(), b"text/plain; charset=utf-8")

    async def _read_json(self, receive: Receive, send: Send) -> tuple[bool, Any]:
        try:
            raw = await read_body(receive, self.config.max_body_bytes)
        except BodyTooLarge as exc:
            await send_bytes(send, 413, error_body(ApiError(413, str(exc))))
            return False, None
        if raw is None:
            return False, None
        try:
            return True, _decode(raw)
        except msgspec.DecodeError as exc:
            await send_bytes(send, 400, error_body(ApiError(400, f"Invalid JSON body: {exc}")))
            return False, None

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        ok, body = await self._read_json(receive, send)
        if not ok:
            return
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            tokens = self.tokenizer.apply_chat_template(body["messages"])
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            tokens = self.tokenizer.encode(body["prompt"])
        else:
            await send_bytes(send, 400, error_body(ApiError(400, "Provide `prompt` (a string) or `messages`.")))
            return
        await send_json(send, 200, tokenize_response(tokens, self.config.max_model_len))

    async def _accept(self, scope: Scope, receive: Receive, send: Send) -> Accepted | None:
        """The request's JSON, logged for GET /emulator/requests; None once answered (a bad body)
        or when the client left."""
        ok, body = await self._read_json(receive, send)
        if not ok:
            return None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        record: dict[str, Any] = {"path": scope["path"], "headers": headers, "body": body, "time": time.time()}
        self.requests.append(record)
        return Accepted(body, headers, header(scope, b"x-request-id") or uuid.uuid4().hex, record)

    async def _running(
        self, receive: Receive, legs: list[Leg], accepted: Accepted, model: str, work: Coroutine[Any, Any, None]
    ) -> None:
        """Serve `work` inside the request's span, aborting its legs if the client goes away first."""
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, legs, accepted.base_id))
        try:
            with request_span(self.tracing, accepted.headers, accepted.base_id, model):
                await work
        finally:
            watcher.cancel()

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        accepted = await self._accept(scope, receive, send)
        if accepted is None:
            return
        config = self.config
        try:
            req = parse_embeddings(
                accepted.body,
                tokenizer=self.tokenizer,
                served_model=config.model,
                max_model_len=config.max_model_len,
                hidden_size=config.embedding_size,
            )
            priority = priority_of(accepted.body, self.engine.by_priority)
        except ApiError as err:
            await send_bytes(send, err.status, error_body(err), headers=accepted.extra)
            return
        response_id = "embd-" + accepted.base_id
        legs = accepted.track(fan_out(len(req.inputs), 1, response_id, LegPlan()))
        for leg in legs:  # one forward pass per input, queued like any prompt
            leg.seq = self.engine.submit(leg.request_id, req.inputs[leg.prompt], 1, priority=priority, pooling=True)
        created = int(time.time())

        def body() -> bytes:
            return embeddings_body(req, response_id, created, self.tokenizer.vocab_size, config.embedding_size)

        await self._running(
            receive, legs, accepted, req.model, answer_embeddings(send, legs, body, accepted.extra, self._first_token)
        )

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        accepted = await self._accept(scope, receive, send)
        if accepted is None:
            return
        config = self.config
        try:
            req = parse_responses(
                accepted.body,
                tokenizer=self.tokenizer,
                served_model=config.model,
                max_model_len=config.max_model_len,
                default_max_tokens=config.default_max_tokens,
            )
            priority = priority_of(accepted.body, self.engine.by_priority)
        except ApiError as err:
            await send_bytes(send, err.status, error_body(err), headers=accepted.extra)
            return
        response_id = "resp_" + accepted.base_id
        (leg,) = accepted.track(fan_out(1, 1, response_id, LegPlan()))
        leg.seq = self.engine.submit(leg.request_id, req.prompt, req.max_tokens, priority=priority)
        renderer = ResponsesRenderer(req, response_id, "msg_" + accepted.base_id, int(time.time()))
        await self._running(
            receive, [leg], accepted, req.model, answer_responses(send, leg, renderer, accepted.extra, self._first_token)
        )
