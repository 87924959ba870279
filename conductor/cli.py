"""`conductor` command line: serve, emulate, demo, fit, replay, tune-pd."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

from conductor import __version__
from conductor.core.cli_help import DefaultsHelpFormatter
from conductor.core.errors import ConductorError, ConfigError

# optional packages a subcommand may need, and the extra that installs each
OPTIONAL_PACKAGES = {"matplotlib": "plot", "mooncake": "mooncake", "vllm": "vllm", "uvloop": "uvloop", "opentelemetry": "otel"}


def _prefill_arg(values: list[str]) -> dict[str, Any]:
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(values)!r}")
    spec: dict[str, Any] = {"url": values[0]}
    if len(values) == 2 and values[1].lower() != "none":
        try:
            spec["bootstrap_port"] = int(values[1])
        except ValueError:
            raise ConfigError(f"--prefill {values[0]}: bootstrap port must be a number or 'none', got {values[1]!r}") from None
    return spec


def _default(key: str) -> str:
    """A setting's built-in default ("pd.protocol": a group's field), for --help (flags left out
    fall back to the config file, CONDUCTOR_* variables, then this)."""
    from conductor.config.settings import Settings

    value: Any = Settings()
    for name in key.split("."):
        value = getattr(value, name)
    return "none" if value in (None, ()) else str(value)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML settings file")
    p.add_argument("--host", help=f"listen address (default: {_default('host')})")
    p.add_argument("--port", type=int, help=f"listen port (default: {_default('port')})")
    p.add_argument(
        "--admin-port",
        type=int,
        help="serve /metrics, /openapi.json and /docs only on this port "
        "(same host), not on --port (default: none, all on --port)",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill instance, repeatable: --prefill URL [BOOTSTRAP_PORT]",
    )
    p.add_argument("--decode", action="append", metavar="URL", help="decode instance, repeatable")
    p.add_argument("--mixed", action="append", metavar="URL", help="non-disaggregated instance, repeatable")
    p.add_argument(
        "--pd-protocol", choices=["nixl", "mooncake", "sglang"], help=f"P/D handshake (default: {_default('pd.protocol')})"
    )
    p.add_argument(
        "--mooncake-schema",
        help="MooncakeConnector field names: transfer_id | engine_id | bootstrap_server"
        f" (default: {_default('pd.mooncake_schema')})",
    )
    p.add_argument(
        "--policy", help=f"scheduling policy (entry point name in group conductor.policies) (default: {_default('policy')})"
    )
    p.add_argument(
        "--model", action="append", dest="models", help="served model name, repeatable (default: the workers' /v1/models)"
    )
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds (default: none)")
    p.add_argument("--slo-tbt", type=float, help="TBT SLO in seconds (default: none)")
    p.add_argument("--api-key", action="append", dest="api_keys", help="accepted client key, repeatable (default: no auth)")
    p.add_argument("--upstream-api-key", help="key sent to the workers (default: none)")
    p.add_argument("--max-body-bytes", type=int, help=f"largest request body (default: {_default('limits.max_body_bytes')})")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help=f"(default: {_default('logs.level')})")
    p.add_argument(
        "--workers",
        type=int,
        help="gateway processes on --port, scheduling as one; more than one "
        f"needs --admin-port, worker i serving its /metrics on admin port + i (default: {_default('workers')})",
    )


def settings_from_args(args: argparse.Namespace) -> Any:
    from conductor.config.settings import load_settings

    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "admin_port": args.admin_port,
        "policy": args.policy,
        "models": args.models,
        "workers": args.workers,
        # the flags keep their names; each sets its field in the settings' groups
        "pd": _given(protocol=args.pd_protocol, mooncake_schema=args.mooncake_schema),
        "auth": _given(api_keys=args.api_keys, upstream_api_key=args.upstream_api_key),
        "limits": _given(max_body_bytes=args.max_body_bytes),
        "logs": _given(level=args.log_level),
        "slo": _given(ttft_s=args.slo_ttft, tbt_s=args.slo_tbt),
    }
    if args.prefill:
        overrides["prefill"] = [_prefill_arg(v) for v in args.prefill]
        for values, spec in zip(args.prefill, overrides["prefill"], strict=True):
            if len(values) == 2 and values[1].lower() == "none":
                # said explicitly: clears a bootstrap port the config file gives the same URL
                spec["bootstrap_port"] = None
    if args.decode:
        overrides["decode"] = args.decode
    if args.mixed:
        overrides["mixed"] = args.mixed
    return load_settings(args.config, overrides=overrides)


def _given(**flags: Any) -> dict[str, Any] | None:
    """The flags given (a group's fields), None when none was: a flag left out sets nothing."""
    given = {k: v for k, v in flags.items() if v is not None}
    return given or None


def serve(args: argparse.Namespace) -> int:
    from conductor.ops.logs import configure_logging
    from conductor.server import serving

    settings = settings_from_args(args)
    configure_logging(settings.logs.level, settings.logs.format, settings.logs.access_log)
    if not settings.instances() and not settings.discovery.sources():
        raise ConfigError("no instances: give --prefill/--decode or --mixed, discovery: sources (or a --config file)")
    return serving.serve(settings)


def _missing_package(exc: ImportError) -> str | None:
    """The optional package an ImportError is about, or None when it is not one of ours."""
    top = (exc.name or "").split(".")[0]
    return top if isinstance(exc, ModuleNotFoundError) and top in OPTIONAL_PACKAGES else None


def _import_failed(command: str, exc: ImportError, verbose: bool) -> int:
    package = _missing_package(exc)
    if package is not None:
        extra = OPTIONAL_PACKAGES[package]
        print(
            f"conductor {command}: needs the optional package {package!r}: pip install 'conductor-scheduler[{extra}]'",
            file=sys.stderr,
        )
    else:
        print(f"conductor {command}: cannot start, an import failed: {exc}", file=sys.stderr)
    if verbose:
        traceback.print_exception(exc)
    else:
        print("(run `conductor -v ...` to see the import error in full)", file=sys.stderr)
    return 2


def _delegate(module: str, func: str) -> Callable[[str, list[str], bool], int]:
    def run(command: str, argv: list[str], verbose: bool) -> int:
        import importlib

        try:
            target = getattr(importlib.import_module(module), func)
            return int(target(argv))
        except ImportError as exc:  # at import, or an optional package imported on first use
            return _import_failed(command, exc, verbose)
        except ConductorError as exc:
            print(f"conductor {command}: {exc.message}", file=sys.stderr)
            if verbose:
                traceback.print_exception(exc)
            return 2

    return run


SUBCOMMANDS: dict[str, tuple[str, Callable[[str, list[str], bool], int]]] = {
    "emulate": ("run an emulated vLLM worker", _delegate("adapters.emulator.cli", "emulate_main")),
    "demo": ("run an emulated P/D cluster behind the gateway and replay a trace", _delegate("conductor.demo.run", "demo_main")),
    "fit": ("fit predictor parameters from a profile CSV", _delegate("predictors.cli", "fit_main")),
    "replay": ("replay a trace: simulated, or live against a gateway", _delegate("traces.replay_cli", "replay_main")),
    "tune-pd": ("sweep P:D splits of N nodes on a trace", _delegate("traces.tune", "tune_main")),
    "indexer": (
        "ingest every worker's KV events and answer cache look-ups (Mooncake RFC 1403 API)",
        _delegate("conductor.indexer.cli", "indexer_main"),
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="conductor", description="KVCache-aware P/D gateway and scheduler", formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"conductor {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show full errors (import errors, tracebacks)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_args(sub.add_parser("serve", help="run the OpenAI-compatible gateway", formatter_class=DefaultsHelpFormatter))
    for name, (help_text, _) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    verbose = False
    while argv and argv[0] in ("-v", "--verbose"):
        verbose, argv = True, argv[1:]
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]][1](argv[0], argv[1:], verbose)
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        return serve(args)
    except ImportError as exc:
        return _import_failed("serve", exc, verbose)
    except ConfigError as exc:
        print(f"conductor serve: {exc.message}", file=sys.stderr)
        if verbose:
            traceback.print_exception(exc)
        return 2
