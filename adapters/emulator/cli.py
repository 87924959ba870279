"""`conductor emulate ...`: run one emulated vLLM instance (and its bootstrap server) in this process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn

from adapters.emulator.app import EmulatorApp
from adapters.emulator.bootstrap import BootstrapApp
from adapters.emulator.config import EmulatorConfig, _engine_id
from adapters.emulator.effects import TimingEffects
from adapters.emulator.lora import parse_lora_modules
from adapters.emulator.protocols import PdProtocol, Role
from adapters.emulator.readback import SideChannelApp
from conductor.core.cli_help import DefaultsHelpFormatter
from conductor.core.vllm_hash import HASH_ALGOS

log = logging.getLogger("adapters.emulator")


def _add_effect_flags(p: argparse.ArgumentParser) -> None:
    """Timing effects the predictors' formula lacks (adapters/emulator/effects.py); all off by default."""
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="chunked prefill: a step's token budget, a longer prompt is prefilled in chunks between decode steps (default: off)",
    )
    p.add_argument(
        "--mixed-batch-overhead",
        type=float,
        default=0.0,
        help="decodes sharing a step with a prefill chunk cost (1 + this) times their decode-only cost (default 0: off)",
    )
    p.add_argument("--kv-pressure-threshold", type=float, default=0.9, help="KV usage above which steps slow down (preemption)")
    p.add_argument(
        "--kv-pressure-slowdown",
        type=float,
        default=0.0,
        help="extra fraction of a step's time at a full KV cache, growing linearly from the threshold (default 0: off)",
    )


def _add_kv_event_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-events-endpoint", default=None, help="ZMQ PUB endpoint, e.g. tcp://*:5557")
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER endpoint for replays")
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic of the KV events")
    p.add_argument("--kv-events-delay-s", type=float, default=0.0, help="publish each KV event batch this late (lag)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conductor emulate", description="Run an emulated vLLM worker.", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--role", choices=[r.value for r in Role], default="mixed", help="part in the P/D split")
    p.add_argument("--pd-protocol", choices=[x.value for x in PdProtocol], default="nixl", help="KV connector handshake spoken")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=8000, help="listen port")
    p.add_argument("--model", default="emulated", help="served model name")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM --block-size)")
    p.add_argument(
        "--bootstrap-port", type=int, default=None, help="prefill role, mooncake/sglang: serve the bootstrap server on this port"
    )
    _add_kv_event_flags(p)
    p.add_argument("--profile", default=None, help="YAML/JSON timing profile (default: bundled Qwen3-8B/H800)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every modelled duration")
    p.add_argument("--noise", type=float, default=0.0, help="sigma of multiplicative lognormal noise")
    p.add_argument("--seed", type=int, default=None, help="seed of the timing noise")
    p.add_argument("--kv-capacity-tokens", type=int, default=1_000_000, help="prefix cache size in tokens (LRU)")
    p.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256", help="vLLM --prefix-caching-hash-algo")
    p.add_argument("--hash-seed", default=None, help="NONE_HASH seed (default: PYTHONHASHSEED, else vLLM's)")
    p.add_argument("--engine-id", default=None, help="KV connector engine id (default: derived from host and port)")
    p.add_argument("--max-model-len", type=int, default=131_072, help="longest prompt plus output accepted")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running batch limit (default: the profile's)")
    _add_effect_flags(p)
    p.add_argument("--default-max-tokens", type=int, default=16, help="output length when a request sets none")
    p.add_argument("--embedding-size", type=int, default=256, help="components of a /v1/embeddings vector")
    p.add_argument("--side-channel-port", type=int, default=5600, help="NIXL side channel port reported")
    p.add_argument("--remote-wait-s", type=float, default=120.0, help="longest a decode waits for its remote prefill")
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OTLP/HTTP traces endpoint: one span per request, a child of its traceparent (as vLLM)",
    )
    p.add_argument(
        "--bidirectional-kv-xfer",
        action="store_true",
        help="NIXL: a decode's KV can be read back by the next turn's prefill (vLLM 0.32 "
        "kv_connector_extra_config bidirectional_kv_xfer), and a prefill's P/D KV by "
        "another prefill (a prefill-to-prefill pull); both serve the reads on --side-channel-port",
    )
    p.add_argument(
        "--kv-recompute-threshold",
        type=int,
        default=64,
        help="bidirectional prefill: pull from the decode only this many tokens or more",
    )
    p.add_argument(
        "--decoder-kv-blocks-ttl",
        type=float,
        default=480.0,
        help="bidirectional decode: seconds a finished request's KV stays pinned unread",
    )
    p.add_argument(
        "--kv-lease-duration",
        type=float,
        default=30.0,
        help="bidirectional prefill: seconds a P/D request's KV stays pinned for its reader",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="as vLLM's: priority takes the waiting request of the lowest `priority` first",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        help="LoRA adapters served from the start, as vLLM's: name=path or JSON {name, path, base_model_name}",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    p.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        role=Role(args.role),
        pd_protocol=PdProtocol(args.pd_protocol),
        host=args.host,
        port=args.port,
        model=args.model,
        block_size=args.block_size,
        bootstrap_port=args.bootstrap_port,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_delay_s=args.kv_events_delay_s,
        profile_path=args.profile,
        time_scale=args.time_scale,
        noise=args.noise,
        seed=args.seed,
        kv_capacity_tokens=args.kv_capacity_tokens,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
        engine_id=args.engine_id or _engine_id(),
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        embedding_size=args.embedding_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        mixed_batch_overhead=args.mixed_batch_overhead,
        kv_pressure_threshold=args.kv_pressure_threshold,
        kv_pressure_slowdown=args.kv_pressure_slowdown,
        side_channel_port=args.side_channel_port,
        remote_wait_s=args.remote_wait_s,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        bidirectional_kv_xfer=args.bidirectional_kv_xfer,
        kv_recompute_threshold=args.kv_recompute_threshold,
        decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        kv_lease_duration=args.kv_lease_duration,
        scheduling_policy=args.scheduling_policy,
        lora_modules=parse_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )


def _uvicorn_config(app: Any, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http="httptools",
        loop="uvloop",
        access_log=False,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=30,
    )


class _QuietServer(uvicorn.Server):
    """The bootstrap server leaves signal handling to the main server (one process, one shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: EmulatorConfig, log_level: str = "warning") -> None:
    app = EmulatorApp(config)
    main = uvicorn.Server(_uvicorn_config(app, config.host, config.port, log_level))
    side: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []  # servers beside the main one

    def beside(side_app: Any, port: int) -> None:
        server = _QuietServer(_uvicorn_config(side_app, config.host, port, log_level))
        side.append((server, asyncio.get_running_loop().create_task(server.serve())))

    if config.bootstrap_port is not None and config.role is Role.PREFILL:
        worker_addr = f"{config.advertised_host}:{config.side_channel_port}"
        beside(BootstrapApp(app.registry, config.engine_id, worker_addr, config.block_size), config.bootstrap_port)
    if app.readback is not None:  # the side channel port a bidirectional engine advertises
        beside(SideChannelApp(app.readback, config.engine_id), config.side_channel_port)
    log.warning(
        "emulator %s/%s on %s:%d (bootstrap %s, kv events %s, readback side channel %s)",
        config.role.value,
        config.pd_protocol.value,
        config.host,
        config.port,
        config.bootstrap_port,
        app.publisher.bound_endpoint if app.publisher else None,
        config.side_channel_port if app.readback is not None else None,
    )
    try:
        await main.serve()
    finally:
        for server, task in side:
            server.should_exit = True
            await task


def emulate_main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # the effects' bounds, checked before anything starts
        a = args
        TimingEffects(a.max_num_batched_tokens, a.mixed_batch_overhead, a.kv_pressure_threshold, a.kv_pressure_slowdown)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    try:
        import uvloop
    except ImportError:  # plain asyncio works, a little slower
        asyncio.run(serve(config, args.log_level))
    else:
        uvloop.run(serve(config, args.log_level))
    return 0


if __name__ == "__main__":
    raise SystemExit(emulate_main())
