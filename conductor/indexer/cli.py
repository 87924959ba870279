"""`conductor indexer`: run the KV indexer (conductor/indexer/service.py) from the gateway's config file.

    conductor indexer --config conductor.yaml --host 0.0.0.0 --port 8100

The same settings as `conductor serve` (instances with their kv_events_endpoint, the `kv:` block,
block_size, host/port/admin_port, models, max_body_bytes); flags win over the file, as for serve.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from conductor.core.cli_help import DefaultsHelpFormatter
from conductor.core.errors import ConfigError
from conductor.indexer.api import MAX_HASHES, MAX_TOKEN_IDS, QueryLimits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conductor indexer",
        formatter_class=DefaultsHelpFormatter,
        description="Ingest every worker's KV events and answer cache look-ups over HTTP "
        "(Mooncake RFC 1403: POST /query, POST /query_by_hash)",
    )
    p.add_argument("--config", help="YAML settings file (the gateway's: instances, kv_events endpoints, kv:)")
    p.add_argument("--host", help="listen address (default: the settings' host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: the settings' port, 8000)")
    p.add_argument("--admin-port", type=int, help="serve /metrics only on this port (default: on --port)")
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill instance, repeatable (its kv_events_endpoint comes from --config)",
    )
    p.add_argument("--decode", action="append", metavar="URL", help="decode instance, repeatable (not indexed)")
    p.add_argument("--mixed", action="append", metavar="URL", help="non-disaggregated instance, repeatable")
    p.add_argument("--max-query-tokens", type=int, default=MAX_TOKEN_IDS, help="most token ids one /query may carry (more: 413)")
    p.add_argument(
        "--max-query-hashes", type=int, default=MAX_HASHES, help="most hashes one /query_by_hash may carry (more: 413)"
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="(default: info)")
    return p


def indexer_main(argv: list[str]) -> int:
    import uvicorn

    from conductor.cli import _prefill_arg
    from conductor.config.settings import load_settings
    from conductor.indexer.api import create_indexer_admin_app, create_indexer_app
    from conductor.indexer.service import IndexerService
    from conductor.ops.logs import configure_logging
    from conductor.server.app import serve_all

    args = _parser().parse_args(argv)
    if args.max_query_tokens <= 0 or args.max_query_hashes <= 0:
        raise ConfigError("--max-query-tokens and --max-query-hashes must be positive")
    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "admin_port": args.admin_port,
        "logs": None if args.log_level is None else {"level": args.log_level},
        "decode": args.decode,
        "mixed": args.mixed,
    }
    if args.prefill:
        overrides["prefill"] = [_prefill_arg(v) for v in args.prefill]
    settings = load_settings(args.config, overrides=overrides)
    configure_logging(settings.logs.level, settings.logs.format, settings.logs.access_log)
    service = IndexerService(settings)
    limits = QueryLimits(args.max_query_tokens, args.max_query_hashes)
    app = create_indexer_app(service, limits, with_metrics=settings.admin_port is None)
    common: dict[str, Any] = {
        "host": settings.host,
        "log_level": settings.logs.level,
        "access_log": False,
        "proxy_headers": False,
        "log_config": None,
    }
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                app,
                port=settings.port,
                lifespan="on",
                timeout_graceful_shutdown=max(1, round(settings.timeouts.drain_grace_s)),
                **common,
            )
        )
    ]
    if settings.admin_port is not None:
        # started first so that /ready and /metrics still answer while the public port drains
        servers.insert(
            0,
            uvicorn.Server(uvicorn.Config(create_indexer_admin_app(service), port=settings.admin_port, lifespan="off", **common)),
        )
    with asyncio.Runner(loop_factory=servers[-1].config.get_loop_factory()) as runner:
        runner.run(serve_all(servers))
    return 0
