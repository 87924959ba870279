"""`conductor serve --check --probe`: reach every configured worker and say, one line per instance,
what answered and what did not, before a gateway is started in front of them.

Per instance: GET /health; GET /v1/models (the model names, vLLM's max_model_len, and whether the
configured `models` are among them); for a prefill or mixed worker with the KV index on, POST
/tokenize of a short text (served or not, and for a tokenizer the gateway computes itself, whether
its token ids are the worker's); its KV events endpoint (the address parses, and the side the
gateway takes works: a worker-bound endpoint accepts a TCP connection, a gateway-bound one is free to
bind; no ZMQ socket is opened, so no event is consumed); a prefill's bootstrap port accepts a
connection; and the block size, where the worker reports it (vLLM's `vllm:cache_config_info` metric).
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from adapters.kv_event_sources import offset_endpoint, subscriber_address
from conductor.config.derived import kv_settings
from conductor.config.kv import KVAwarenessSettings
from conductor.config.settings import InstanceSpec, Settings
from conductor.core.tokenization import ByteTokenizer, Tokenizer
from conductor.core.types import Role

PROBE_TIMEOUT_S = 5.0  # each HTTP question and each TCP connection
PROBE_TEXT = "Conductor checks that this worker tokenizes."
NOT_SERVED = frozenset({404, 405, 501})
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)


@dataclass(frozen=True)
class Finding:
    """One thing checked on one instance."""

    what: str  # "health", "models", "tokenize", "kv events", "bootstrap", "block size"
    ok: bool
    detail: str

    def text(self) -> str:
        return f"{self.what} {self.detail}" if self.ok else f"{self.what} FAILED: {self.detail}"


@dataclass
class InstanceReport:
    name: str
    role: str
    url: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def line(self) -> str:
        status = "ok" if self.ok else "FAILED"
        return f"{self.name} ({self.role} {self.url}): {status}: " + "; ".join(f.text() for f in self.findings)


def endpoint_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// endpoint, None for ipc:// and inproc://; ValueError when it does not parse."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV events endpoint {endpoint!r} must be tcp://HOST:PORT, ipc:// or inproc://")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV events endpoint {endpoint!r} must be tcp://HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


async def probe_instances(settings: Settings, local_tokenizer: Tokenizer | None) -> list[InstanceReport]:
    """Every configured instance probed at once; the reports in the instances' order.
    `local_tokenizer`: the tokenizer the gateway computes with itself (builtin, a directory), if any."""
    key = settings.auth.upstream_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kv = kv_settings(settings) if settings.kv.enabled else None
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, headers=headers) as client:
        probes = [_probe(spec, settings, kv, local_tokenizer, client) for spec in settings.instances()]
        return list(await asyncio.gather(*probes))


async def _probe(
    spec: InstanceSpec, settings: Settings, kv: KVAwarenessSettings | None, local: Tokenizer | None, client: httpx.AsyncClient
) -> InstanceReport:
    report = InstanceReport(spec.name or spec.url, spec.role.value, spec.url)
    health = await _health(client, spec.url)
    report.findings.append(health)
    if health.ok:  # the rest asks the same server: nothing to learn from a dead one
        # its own `models` when the settings list them: every one; else one of the gateway's at least
        # (several models behind one gateway: each worker serves some of them)
        expected = spec.models if spec.models is not None else settings.models
        report.findings.append(await _models(client, spec.url, expected, every=spec.models is not None))
        if kv is not None and spec.role is not Role.DECODE and _asks_tokenize(kv, spec.url, local):
            report.findings.append(await _tokenize(client, spec.url, kv, local))
        block = await _block_size(client, spec.url, settings.block_size)
        if block is not None:
            report.findings.append(block)
    ep = kv.kv_events.get(report.name) if kv is not None else None
    if ep is not None:
        host = urlsplit(spec.url).hostname or "127.0.0.1"
        ranks = [offset_endpoint(ep.endpoint, r) for r in range(ep.data_parallel_size)]
        replays = [offset_endpoint(ep.replay_endpoint, r) for r in range(ep.data_parallel_size)] if ep.replay_endpoint else []
        report.findings.append(await _events(ranks, replays, host))
    if spec.role is Role.PREFILL and spec.bootstrap_port is not None and settings.pd.protocol in ("mooncake", "sglang"):
        host = urlsplit(spec.url).hostname or "127.0.0.1"
        problem = await _connect_problem(host, spec.bootstrap_port)
        report.findings.append(
            Finding("bootstrap", problem is None, problem or f"{host}:{spec.bootstrap_port} accepts connections")
        )
    return report


def _asks_tokenize(kv: KVAwarenessSettings, url: str, local: Tokenizer | None) -> bool:
    if local is not None:  # the gateway tokenizes itself: compare its ids with this worker's
        return True
    return kv.tokenizer_url is None or kv.tokenizer_url.rstrip("/") == url


async def _health(client: httpx.AsyncClient, url: str) -> Finding:
    try:
        resp = await client.get(f"{url}/health")
    except httpx.HTTPError as exc:
        return Finding("health", False, f"unreachable ({type(exc).__name__})")
    return Finding("health", resp.status_code == 200, "200" if resp.status_code == 200 else f"answered {resp.status_code}")


async def _models(client: httpx.AsyncClient, url: str, configured: Sequence[str], *, every: bool = True) -> Finding:
    try:
        resp = await client.get(f"{url}/v1/models")
        cards = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return Finding("models", False, f"/v1/models failed ({type(exc).__name__})")
    if not isinstance(cards, list):
        return Finding("models", False, f"/v1/models answered {resp.status_code} without a model list")
    served = {str(c.get("id")): c.get("max_model_len") for c in cards if isinstance(c, dict)}
    shown = ", ".join(f"{name} (max_model_len {length})" if length else name for name, length in served.items())
    missing = [m for m in configured if m not in served]
    if not every and len(missing) < len(configured):
        missing = []
    if not served or missing:
        return Finding("models", False, f"serves {shown or 'none'}; not {', '.join(missing)}" if missing else "serves none")
    return Finding("models", True, shown)


async def _tokenize(client: httpx.AsyncClient, url: str, kv: KVAwarenessSettings, local: Tokenizer | None) -> Finding:
    try:
        resp = await client.post(f"{url}/tokenize", json={"prompt": PROBE_TEXT})
    except httpx.HTTPError as exc:
        return Finding("tokenize", False, f"/tokenize failed ({type(exc).__name__})")
    if resp.status_code in NOT_SERVED:
        if kv.tokenizer == "auto":  # a warning, not a failure: the gateway falls back and says so
            return Finding("tokenize", True, "not served: kv.tokenizer auto would use the built-in byte tokenizer")
        if local is not None:
            return Finding("tokenize", True, "not served: the local tokenizer's ids cannot be compared")
        return Finding("tokenize", False, f"answered {resp.status_code}: kv.tokenizer worker needs /tokenize")
    try:
        tokens = [int(t) for t in resp.json()["tokens"]] if resp.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        tokens = None
    if tokens is None:
        return Finding("tokenize", False, f"answered {resp.status_code} without token ids")
    if local is not None and local.encode(PROBE_TEXT) != tokens:
        name = "the built-in byte tokenizer" if isinstance(local, ByteTokenizer) else f"kv.tokenizer {kv.tokenizer}"
        return Finding("tokenize", False, f"{name} gives other token ids than the worker: no cache hit would be predicted")
    return Finding("tokenize", True, f"{len(tokens)} tokens for a short text")


async def _block_size(client: httpx.AsyncClient, url: str, block_size: int) -> Finding | None:
    """The worker's block size from vLLM's cache_config_info metric; None when it reports none."""
    try:
        resp = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    found = _BLOCK_SIZE.search(resp.text) if resp.status_code == 200 else None
    if found is None:
        return None
    theirs = int(found.group(1))
    if theirs != block_size:
        return Finding("block size", False, f"the worker's is {theirs}, block_size here is {block_size}")
    return Finding("block size", True, str(theirs))


async def _events(endpoints: Sequence[str], replays: Sequence[str], worker_host: str) -> Finding:
    said: list[str] = []
    for endpoint in endpoints:
        address, bind = subscriber_address(endpoint, worker_host)
        problem = await (_bind_problem(address) if bind else _address_problem(address))
        if problem is not None:
            return Finding("kv events", False, problem)
        said.append(f"{address} {'free to bind' if bind else 'accepts connections'}")
    for replay in replays:  # the replay ROUTER always binds on the worker
        address, _ = subscriber_address(replay, worker_host)
        problem = await _address_problem(address)
        if problem is not None:
            return Finding("kv events", False, f"replay: {problem}")
        said.append(f"replay {address} accepts connections")
    return Finding("kv events", True, ", ".join(said))


async def _address_problem(address: str) -> str | None:
    try:
        where = endpoint_address(address)
    except ValueError as exc:
        return str(exc)
    return None if where is None else await _connect_problem(*where)


async def _connect_problem(host: str, port: int) -> str | None:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        return f"nothing accepts connections at {host}:{port} ({type(exc).__name__})"
    writer.close()
    await asyncio.gather(writer.wait_closed(), return_exceptions=True)
    return None


async def _bind_problem(address: str) -> str | None:
    try:
        where = endpoint_address(address)
    except ValueError as exc:
        return str(exc)
    if where is None:
        return None
    host, port = where
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return f"the gateway binds {address}, and cannot: {exc.strerror}"
    return None
