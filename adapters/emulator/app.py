"""The emulator's HTTP surface: vLLM's OpenAI server routes plus /emulator/* test hooks.

GET /emulator/requests lists each request's headers and body and, once each prompt's first token is
out, `modelled`: per prompt the times the engine modelled for it (queue_s, prefill_s, ttft_s,
transfer_s for a remote-KV decode leg; see engine.py), which CPU contention does not change.

A plain ASGI app: the token path sends pre-encoded SSE bytes straight to the server, and a watcher
on `receive()` sees `http.disconnect` the moment a client goes away, aborts the sequence in the
engine (freeing its batch slot) and records the request id for GET /emulator/cancelled.

A completions batch (`prompt` a list of strings or token-id lists) is served as vLLM serves it: one
engine sequence per prompt (`{id}-{i}`, its own prefix-cache look-up, KV events and usage), their
tokens relayed as they come, choice `index` = prompt position, usage summed, and, for a NIXL
prefill, the first prompt's kv_transfer_params alone on the answer (protocols.py).

Bidirectional NIXL (readback.py): a decode pins its finished requests' KV and names it in a
non-streamed answer; a prefill handed such a handle pulls it before computing the rest, its
`modelled` entry then carrying the pulled tokens (`external_tokens`) and their `transfer_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections import deque
from typing import Any

import aiohttp
import msgspec

from adapters.emulator.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_bytes,
    send_json,
)
from adapters.emulator.bootstrap import TransferDone, TransferRegistry, wait_for_prefill
from adapters.emulator.config import EmulatorConfig
from adapters.emulator.engine import Engine, RemoteWait
from adapters.emulator.kv_content import RemoteKv
from adapters.emulator.kv_events import publisher_for
from adapters.emulator.legs import Leg, batch_usage, modelled_times, relay, stream_legs
from adapters.emulator.metrics import CONTENT_TYPE, EngineMetrics
from adapters.emulator.openai_format import (
    ApiError,
    Choice,
    Renderer,
    error_body,
    parse_request,
    tokenize_response,
)
from adapters.emulator.prefix_cache import PrefixCache
from adapters.emulator.profile import load_profile
from adapters.emulator.protocols import LegPlan, NixlAnswer, plan_leg
from adapters.emulator.readback import KvPuller, ReadbackStore
from adapters.emulator.tracing import EmulatorTracing, request_span
from conductor.core.tokenization import ByteTokenizer
from conductor.core.types import Role
from conductor.core.vllm_hash import VllmBlockHasher, worker_seed

log = logging.getLogger(__name__)
_decode = msgspec.json.Decoder().decode


class EmulatorApp:
    """One emulated vLLM instance (engine, cache, events, metrics) behind an ASGI callable."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        profile = load_profile(config.profile_path)
        if config.max_num_seqs is not None:
            profile = dataclasses.replace(profile, max_num_seqs=config.max_num_seqs)
        self.profile = profile
        self.tokenizer = ByteTokenizer()
        # a stand-in for a vLLM worker: like vLLM, it reads PYTHONHASHSEED from its own environment
        self.hasher = VllmBlockHasher(config.hash_algo, config.block_size, worker_seed(config.hash_seed, os.environ))
        self.cache = PrefixCache(config.block_size, config.kv_capacity_tokens)
        self.metrics = EngineMetrics(config.model)
        self.publisher = publisher_for(config)
        self.engine = Engine(
            profile,
            self.hasher,
            self.cache,
            self.metrics,
            self.publisher,
            time_scale=config.time_scale,
            noise=config.noise,
            seed=config.seed,
            scheduling_policy=config.scheduling_policy,
        )
        self.registry = TransferRegistry()
        self.nixl = NixlAnswer(config.engine_id, config.advertised_host, config.side_channel_port, config.block_size)
        self.readback = ReadbackStore(self.engine, self.nixl, config.pin_ttl_s) if config.serves_readback else None
        self.puller = (
            KvPuller(self._client, config.block_size, config.kv_recompute_threshold, self.metrics.kv_load_failures.inc)
            if config.pulls_readback
            else None
        )
        # who tells a prefill its pinned KV was read: the puller, or on a decode one of its own
        self.notifier = self.puller or (
            KvPuller(self._client, config.block_size, 0, self.metrics.kv_load_failures.inc) if self.readback is not None else None
        )
        self.requests: deque[dict[str, Any]] = deque(maxlen=config.request_log_size)
        self.cancelled: deque[str] = deque(maxlen=config.cancelled_log_size)
        self.created = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self.tracing = (
            EmulatorTracing(config.otlp_traces_endpoint, f"vllm-emulator-{config.role.value}")
            if config.otlp_traces_endpoint
            else None
        )

    # -- lifespan ------------------------------------------------------------------------------
    async def startup(self) -> None:
        self.engine.start()
        if self.publisher is not None:
            self.publisher.start()
        self._session = aiohttp.ClientSession()

    def _client(self) -> aiohttp.ClientSession:
        assert self._session is not None, "startup() not run"
        return self._session

    async def shutdown(self) -> None:
        await self.engine.stop()
        if self.publisher is not None:
            await self.publisher.close()
        if self._session is not None:
            await self._session.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # flush the batched spans

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            try:
                await self._route(scope, receive, send)
            except Exception:  # never a traceback to the client: a vLLM-shaped 500 instead
                log.exception("unhandled error on %s", scope.get("path"))
                with contextlib.suppress(Exception):
                    await send_bytes(send, 500, error_body(ApiError(500, "Internal server error", "InternalServerError")))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routing -------------------------------------------------------------------------------
    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == "/v1/completions":
            await self._generate(scope, receive, send, chat=False)
        elif method == "POST" and path == "/v1/chat/completions":
            await self._generate(scope, receive, send, chat=True)
        elif method == "GET" and path == "/health":
            await send_bytes(send, 200, b"")
        elif method == "GET" and path == "/metrics":
            await send_bytes(send, 200, self.metrics.render(), CONTENT_TYPE.encode())
        elif method == "GET" and path == "/v1/models":
            await send_json(send, 200, self._models())
        elif method == "POST" and path == "/tokenize":
            await self._tokenize(receive, send)
        elif method == "GET" and path == "/emulator/requests":
            await send_json(send, 200, list(self.requests))
        elif method == "GET" and path == "/emulator/cancelled":
            await send_json(send, 200, {"request_ids": list(self.cancelled)})
        elif method == "GET" and path == "/emulator/state":
            await send_json(send, 200, self._state())
        elif method == "POST" and path in ("/emulator/reset", "/reset_prefix_cache"):
            if path == "/emulator/reset":
                self.requests.clear()
                self.cancelled.clear()
            self.engine.reset_cache()
            await send_json(send, 200, {"status": "ok"})
        else:
            await send_json(send, 404, {"detail": "Not Found"})

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
        return {"object": "list", "data": [card]}

    def _state(self) -> dict[str, Any]:
        return {
            "role": self.config.role.value,
            "engine_id": self.config.engine_id,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "waiting_for_remote_kv": self.engine.waiting_for_remote,
            "cached_blocks": len(self.cache),
            "kv_usage": self.cache.usage(),
            "steps": self.engine.steps,
            "pinned_for_readback": self.engine.pinned,
        }

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

    # -- generation ----------------------------------------------------------------------------
    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        ok, body = await self._read_json(receive, send)
        if not ok:
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        record: dict[str, Any] = {"path": scope["path"], "headers": headers, "body": body, "time": time.time()}
        self.requests.append(record)
        base_id = header(scope, b"x-request-id") or uuid.uuid4().hex
        try:
            req = parse_request(
                chat,
                body,
                tokenizer=self.tokenizer,
                served_model=self.config.model,
                max_model_len=self.config.max_model_len,
                default_max_tokens=self.config.default_max_tokens,
            )
        except ApiError as err:
            await send_bytes(send, err.status, error_body(err), headers=[(b"x-request-id", base_id.encode())])
            return
        plan = plan_leg(self.config.role, self.config.pd_protocol, body)
        response_id = ("chatcmpl-" if chat else "cmpl-") + base_id
        # vLLM's serving_completion: one engine request per prompt, `{request_id}-{i}` in a batch.
        # Every sub-request gets the request's P/D plan, as every vLLM sub-request gets its params.
        legs = [
            Leg(
                i,
                f"{response_id}-{i}" if req.batched else response_id,
                plan if i == 0 else dataclasses.replace(plan, publish_key=None),
            )
            for i in range(len(req.prompts))
        ]
        modelled: list[dict[str, Any] | None] = [None] * len(legs)  # filled at each leg's first token
        record["modelled"] = modelled
        for leg in legs:
            leg.modelled = modelled
        pull = self.puller.pull(plan.readback) if self.puller is not None and plan.readback is not None else None
        priority = body.get("priority", 0)
        if type(priority) is not int:
            await send_bytes(
                send, 400, error_body(ApiError(400, "priority must be an integer")), headers=[(b"x-request-id", base_id.encode())]
            )
            return
        for leg, prompt, max_tokens in zip(legs, req.prompts, req.max_tokens, strict=True):
            leg.seq = self.engine.submit(
                leg.request_id,
                prompt,
                1 if plan.force_one_token else max_tokens,
                self._remote_wait(plan),
                pull=pull,
                pin_on_finish=self._pins(plan),
                priority=priority,
            )
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, legs, base_id))
        renderer = Renderer(chat, response_id, int(time.time()), req.model, len(legs))
        extra = [(b"x-request-id", base_id.encode())]
        try:
            with request_span(self.tracing, headers, base_id, req.model):
                if req.stream:
                    await stream_legs(send, legs, req, renderer, extra, self._first_token)
                else:
                    await self._complete(send, legs, renderer, plan, extra)
        finally:
            watcher.cancel()

    def _pins(self, plan: LegPlan) -> bool:
        """Whether a leg's KV stays pinned after it finishes, for a reader on the side channel: every
        leg of a bidirectional decode, the NIXL prefill legs of a bidirectional prefill."""
        if self.readback is None:
            return False
        return self.config.role is Role.DECODE or plan.nixl_prefill

    def _remote_wait(self, plan: LegPlan) -> RemoteWait | None:
        if plan.remote_ready:
            ready = RemoteKv(plan.remote_seed, plan.remote_block_ids)
            # a bidirectional decode frees the prefill's pin once it has the KV, as NIXL's notification does
            release = plan.source if self.readback is not None else None

            async def nixl_ready() -> RemoteKv:
                if release is not None and self.notifier is not None:
                    self.notifier.release(release)
                return ready

            return nixl_ready
        url = plan.wait_url
        if url is None:
            return None
        session = self._session
        assert session is not None, "startup() not run"
        deadline = self.config.remote_wait_s
        return lambda: wait_for_prefill(session, url, deadline)

    async def _watch(self, receive: Receive, legs: list[Leg], base_id: str) -> None:
        """Abort every sequence of the request when the client disconnects before they finished."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        live = [leg for leg in legs if not leg.sequence.finished and not leg.sequence.aborted]
        for leg in live:
            self.engine.abort(leg.sequence)
            self._publish(leg, aborted=True)
        if live:
            self.cancelled.append(base_id)

    def _first_token(self, leg: Leg) -> None:
        """The prompt is computed: publish the transfer key, record the modelled times."""
        self._publish(leg)
        if leg.modelled is not None:
            leg.modelled[leg.index] = modelled_times(leg.sequence)

    def _publish(self, leg: Leg, *, aborted: bool = False) -> None:
        key = leg.plan.publish_key
        if key is not None:
            seq = leg.sequence
            self.registry.publish(
                TransferDone(
                    key,
                    "aborted" if aborted else "done",
                    seq.prompt_tokens,
                    seq.cached_tokens,
                    self.config.engine_id,
                    seq.kv_seed,
                )
            )

    async def _complete(
        self, send: Send, legs: list[Leg], renderer: Renderer, plan: LegPlan, extra: list[tuple[bytes, bytes]]
    ) -> None:
        async with contextlib.aclosing(relay(legs, self._first_token)) as tokens:
            async for _ in tokens:
                pass
        seqs = [leg.sequence for leg in legs]
        if any(seq.aborted for seq in seqs):
            return
        # vLLM puts final_res_batch[0].kv_transfer_params on the response: the first prompt's only.
        first = seqs[0]
        kv_params: dict[str, Any] | None = None
        if plan.nixl_prefill:
            cached = first.cached_tokens + first.external_tokens if self.puller is not None else None
            kv_params = self.nixl.params(first.request_id, first.prompt, first.kv_taint, cached)
        elif self.readback is not None:
            kv_params = self.readback.params(first)
        choices = [Choice(seq.kv_seed, seq.generated) for seq in seqs]
        await send_bytes(send, 200, renderer.full(choices, batch_usage(seqs), kv_params), headers=extra)
