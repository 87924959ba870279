"""`conductor` command line: serve, emulate, demo, fit, replay, tune-pd."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from conductor import __version__
from conductor.errors import ConfigError


def _prefill_arg(values: list[str]) -> dict[str, Any]:
    if not 1 <= len(values) <= 2:
        raise argparse.ArgumentTypeError("--prefill takes URL [BOOTSTRAP_PORT]")
    spec: dict[str, Any] = {"url": values[0]}
    if len(values) == 2 and values[1].lower() != "none":
        try:
            spec["bootstrap_port"] = int(values[1])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bootstrap port must be a number or 'none': {values[1]!r}") from exc
    return spec


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML settings file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prefill", nargs="+", action="append", metavar=("URL", "BOOTSTRAP_PORT"),
                   help="prefill instance, repeatable: --prefill URL [BOOTSTRAP_PORT]")
    p.add_argument("--decode", action="append", metavar="URL", help="decode instance, repeatable")
    p.add_argument("--mixed", action="append", metavar="URL", help="non-disaggregated instance, repeatable")
    p.add_argument("--pd-protocol", choices=["nixl", "mooncake", "sglang"])
    p.add_argument("--mooncake-schema", help="MooncakeConnector field names: transfer_id | engine_id | bootstrap_server")
    p.add_argument("--policy", help="scheduling policy (entry point name in group conductor.policies)")
    p.add_argument("--model", action="append", dest="models", help="served model name, repeatable")
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds")
    p.add_argument("--slo-tbt", type=float, help="TBT SLO in seconds")
    p.add_argument("--api-key", action="append", dest="api_keys", help="accepted client key, repeatable")
    p.add_argument("--upstream-api-key", help="key sent to the workers")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def settings_from_args(args: argparse.Namespace) -> Any:
    from conductor.settings import load_settings

    overrides: dict[str, Any] = {
        "host": args.host, "port": args.port, "pd_protocol": args.pd_protocol,
        "mooncake_schema": args.mooncake_schema, "policy": args.policy,
        "models": args.models, "api_keys": args.api_keys, "upstream_api_key": args.upstream_api_key,
        "max_body_bytes": args.max_body_bytes, "log_level": args.log_level,
    }
    if args.prefill:
        overrides["prefill"] = [_prefill_arg(v) for v in args.prefill]
    if args.decode:
        overrides["decode"] = args.decode
    if args.mixed:
        overrides["mixed"] = args.mixed
    if args.slo_ttft is not None or args.slo_tbt is not None:
        overrides["slo"] = {k: v for k, v in (("ttft_s", args.slo_ttft), ("tbt_s", args.slo_tbt)) if v is not None}
    return load_settings(args.config, overrides=overrides)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from conductor.app import create_app
    from conductor.gateway import Gateway

    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.instances():
        raise ConfigError("no instances: give --prefill/--decode or --mixed (or a --config file)")
    gateway = Gateway(settings)  # loads the policy: a broken plugin stops start-up here
    config = uvicorn.Config(
        create_app(gateway), host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=False, loop="auto", http="auto", lifespan="on",
    )
    uvicorn.Server(config).run()
    return 0


def _delegate(module: str, func: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        try:
            target = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as exc:
            print(f"this command is not available in this build: {exc}", file=sys.stderr)
            return 2
        return int(target(argv))

    return run


SUBCOMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "emulate": ("run an emulated vLLM worker", _delegate("adapters.emulator.cli", "emulate_main")),
    "demo": ("run an emulated P/D cluster behind the gateway and replay a trace", _delegate("conductor.demo", "demo_main")),
    "fit": ("fit predictor parameters from a profile CSV", _delegate("predictors.cli", "fit_main")),
    "replay": ("replay a trace: simulated, or live against a gateway", _delegate("traces.replay_cli", "replay_main")),
    "tune-pd": ("sweep P:D splits of N nodes on a trace", _delegate("traces.tune", "tune_main")),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="conductor", description="KVCache-aware P/D gateway and scheduler")
    parser.add_argument("--version", action="version", version=f"conductor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_args(sub.add_parser("serve", help="run the OpenAI-compatible gateway"))
    for name, (help_text, _) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]][1](argv[1:])
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        return serve(args)
    except ConfigError as exc:
        print(f"conductor: {exc}", file=sys.stderr)
        return 2
