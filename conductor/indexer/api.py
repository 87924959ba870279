"""The indexer's HTTP API: cache look-ups in the shape of Mooncake's RFC 1403
(kvcache-ai/Mooncake issue 1403, as written up in its docs/source/design/conductor/indexer-api-design.md),
plus /health, /ready and /metrics.

    POST /query          {"model", "block_size", "token_ids": [uint32...], "lora_name"?, "tenant_id"?,
                          "instance_id"?, "cache_salt"?}
    POST /query_by_hash  the same with "seq_hashes": [uint64...] (or the older name "block_hash")
    answer (both)        {"<tenant_id>": {"<instance_id>": {"longest_matched": tokens, "GPU": tokens,
                          "CPU": tokens, "DISK": tokens, "DP": {"<rank>": tokens}}}}

Choices where the RFC is silent or loose, and where this indexer differs from it:
- A hash is a block key of the configured `kv.key_mode`: in "xxhash" mode Conductor's own chain
  (key_i = xxh3_64(block i's tokens as little-endian uint32, seed = key_{i-1}), key_{-1} = kv.hash_seed),
  in "vllm" mode vLLM's own block hash (low 64 bits, as its KV events carry it). Both are rolling
  hashes in the RFC's sense (each names its whole prefix), but neither is the RFC's recommended
  XXH3(parent || local) chain. A client computes them as the gateway does (`conductor.core.block_keys`).
  `longest_matched` = block_size x the leading hashes held, for both routes.
- Hashes are JSON integers in [0, 2^64); negative ones down to -2^63 are taken as the two's-complement
  uint64 (clients with only int64). Token ids are integers in [0, 2^32).
- Every tracked instance (prefill/mixed with a KV events feed) is listed, 0 when it holds nothing, so a
  caller also learns which instances the indexer follows; DP lists each configured rank of it. GPU is
  vLLM's "GPU" medium, CPU every other medium vLLM reports (offloaded blocks); DISK stays 0 (no vLLM
  event reports disk). Each medium's figure is its own leading run; longest_matched is the longest
  run of any one medium and rank (a prefix split across media counts its longest single part).
- One tenant, "default": another tenant_id gets {} (nothing registered under it). A non-empty lora_name,
  lora_id or cache_salt gets every instance at 0: such blocks carry extra hash inputs (a LoRA
  adapter's path, which a query does not give; an adapter's blocks from events are indexed in
  "vllm" key mode, under vLLM's hashes, and skipped in "xxhash" mode: the indexer lists no adapters).
- `model` is required (non-empty); it must be one of `models` when the settings name any (else 404),
  otherwise any model is answered from the one index. `block_size` must be the indexer's (else 400).
  An `instance_id` the indexer does not track is a 404. Unknown fields are ignored.
- Extension: `"holders_only": true` lists only the instances that hold a leading run (longest_matched
  > 0). Gateways (adapters/index/remote.py) ask so: at 1,024 tracked instances the full answer is
  ~100 KB of zeros to encode and decode per look-up. Without it, the answer is the RFC's.
- Errors are the project's OpenAI-style JSON (`conductor/server/errors.py`), not the RFC draft's
  {"error": "..."}: 400 malformed, 404 unknown model or instance, 405 wrong method, 413 body over
  max_body_bytes or more token ids / hashes than `QueryLimits` allow.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from conductor.core.errors import BadRequest, ModelNotFound, NotFound, PayloadTooLarge
from conductor.indexer.service import IndexerService
from conductor.server import errors as http_errors

_MASK64 = (1 << 64) - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
DEFAULT_TENANT = "default"
MAX_TOKEN_IDS = 1 << 20
MAX_HASHES = 1 << 16


@dataclass(frozen=True, slots=True)
class QueryLimits:
    """Bounds on one look-up (beyond the body size): a 1M-token prompt at the defaults."""

    max_token_ids: int = MAX_TOKEN_IDS
    max_hashes: int = MAX_HASHES


class QueryBody(msgspec.Struct, frozen=True):
    """Both routes' request body (RFC 1403 field names)."""

    model: str
    block_size: int
    token_ids: list[TokenId] | None = None
    seq_hashes: list[int] | None = None
    block_hash: list[int] | None = None  # the RFC's earlier name for seq_hashes
    lora_name: str | None = None
    lora_id: int | None = None  # deprecated in the RFC; non-zero means a LoRA, as lora_name does
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None
    holders_only: bool = False  # extension: leave out the instances at 0 (module docstring)


_decode_query = msgspec.json.Decoder(QueryBody).decode
_encode = msgspec.json.Encoder().encode


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_query(raw: bytes) -> QueryBody:
    try:
        body = _decode_query(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid query: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not body.model:
        raise BadRequest("model must not be empty", param="model")
    return body


class QueryHandler:
    """Validates a parsed query against the indexer and answers it."""

    def __init__(self, service: IndexerService, limits: QueryLimits) -> None:
        self.service = service
        self.limits = limits

    def _check(self, body: QueryBody) -> None:
        if self.service.models and body.model not in self.service.models:
            raise ModelNotFound(f"model {body.model!r} is not served here; served: {sorted(self.service.models)}", param="model")
        if body.block_size != self.service.block_size:
            raise BadRequest(f"block_size {body.block_size} is not the indexer's {self.service.block_size}", param="block_size")
        if body.instance_id is not None and body.instance_id not in self.service.instances:
            raise NotFound(f"instance {body.instance_id!r} is not tracked by this indexer", param="instance_id")

    def _unindexed(self, body: QueryBody) -> bool:
        """Blocks of a LoRA or a cache salt are keyed on more than tokens: a query's own keys never find them."""
        return bool(body.lora_name) or bool(body.lora_id) or bool(body.cache_salt)

    async def answer(self, body: QueryBody, keys: list[int]) -> dict[str, Any]:
        tenant = body.tenant_id or DEFAULT_TENANT
        if tenant != DEFAULT_TENANT:
            return {}
        per_instance = await self.service.match(
            [] if self._unindexed(body) else keys, holders_only=body.holders_only and body.instance_id is None
        )
        if body.instance_id is not None:
            per_instance = {body.instance_id: per_instance[body.instance_id]}
        if body.holders_only:
            per_instance = {iid: entry for iid, entry in per_instance.items() if entry["longest_matched"]}
        return {tenant: per_instance}

    async def by_tokens(self, raw: bytes) -> dict[str, Any]:
        body = parse_query(raw)
        if body.token_ids is None:
            raise BadRequest("token_ids is required", param="token_ids")
        if len(body.token_ids) > self.limits.max_token_ids:
            raise PayloadTooLarge(
                f"{len(body.token_ids)} token ids exceed the limit of {self.limits.max_token_ids}", param="token_ids"
            )
        self._check(body)
        keys = [] if self._unindexed(body) else self.service.scheme.keys(body.token_ids)
        return await self.answer(body, keys)

    async def by_hash(self, raw: bytes) -> dict[str, Any]:
        body = parse_query(raw)
        if body.seq_hashes is not None and body.block_hash is not None:
            raise BadRequest("give seq_hashes or block_hash, not both", param="seq_hashes")
        hashes = body.seq_hashes if body.seq_hashes is not None else body.block_hash
        if hashes is None:
            raise BadRequest("seq_hashes is required", param="seq_hashes")
        if len(hashes) > self.limits.max_hashes:
            raise PayloadTooLarge(f"{len(hashes)} hashes exceed the limit of {self.limits.max_hashes}", param="seq_hashes")
        for i, h in enumerate(hashes):
            if not -(1 << 63) <= h <= _MASK64:  # msgspec cannot bound beyond int64 itself
                raise BadRequest(f"seq_hashes[{i}] = {h} is not a 64-bit hash", param="seq_hashes")
        self._check(body)
        return await self.answer(body, [h & _MASK64 for h in hashes])


def _ops_routes(app: FastAPI, service: IndexerService, *, with_metrics: bool) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready", responses={503: {"description": "a KV events feed is not connected"}})
    async def ready() -> JSONResponse:
        feeds = await service.ready()
        ok = all(f.reason is None for f in feeds)
        detail = [
            {
                "feed": f.feed.name,
                "instance": f.feed.instance,
                "rank": f.feed.rank,
                "endpoint": f.endpoint,
                "batches": f.batches,
                "last_seq": f.last_seq,
                "ok": f.reason is None,
                "reason": f.reason,
            }
            for f in feeds
        ]
        return JSONResponse({"ready": ok, "feeds": detail}, status_code=200 if ok else 503)

    if with_metrics:

        @app.get("/metrics", response_class=Response)
        async def metrics() -> Response:
            await service.refresh_gauges()
            return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)


def create_indexer_app(service: IndexerService, limits: QueryLimits | None = None, *, with_metrics: bool = True) -> FastAPI:
    """The indexer's app; its lifespan starts and stops `service`. `with_metrics=False` when an admin
    port serves /metrics instead (`create_indexer_admin_app`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="Conductor indexer", version="0.1.0", lifespan=lifespan, redoc_url=None)
    http_errors.install(app)
    handler = QueryHandler(service, limits or QueryLimits())
    body_limit = service.settings.limits.max_body_bytes
    m = service.metrics

    async def lookup(route: str, request: Request) -> Response:
        started = time.perf_counter()
        try:
            raw = await read_body(request, body_limit)
            answer = await (handler.by_tokens(raw) if route == "query" else handler.by_hash(raw))
        except Exception:
            m.lookups.labels(route, "error").inc()
            raise
        payload = _encode(answer)
        m.lookups.labels(route, "ok").inc()
        m.lookup_seconds.labels(route).observe(time.perf_counter() - started)
        return Response(payload, media_type="application/json")

    @app.post("/query", responses={400: {}, 404: {}, 413: {}})
    async def query(request: Request) -> Response:
        return await lookup("query", request)

    @app.post("/query_by_hash", responses={400: {}, 404: {}, 413: {}})
    async def query_by_hash(request: Request) -> Response:
        return await lookup("query_by_hash", request)

    _ops_routes(app, service, with_metrics=with_metrics)
    return app


def create_indexer_admin_app(service: IndexerService) -> FastAPI:
    """The admin port's app: /metrics, /health, /ready (the public app starts the service)."""
    app = FastAPI(title="Conductor indexer (admin)", version="0.1.0", redoc_url=None)
    http_errors.install(app)
    _ops_routes(app, service, with_metrics=True)
    return app
