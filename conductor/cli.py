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
from conductor.core.vllm_hash import HASH_ALGOS

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


def _choices(key: str) -> list[str]:
    """The values a Literal setting ("kv.index") allows, read from the settings model itself."""
    from typing import get_args

    from conductor.config.settings import Settings

    model: Any = Settings
    *groups, name = key.split(".")
    for group in groups:
        model = model.model_fields[group].annotation
    return [str(v) for v in get_args(model.model_fields[name].annotation)]


SERVE_DESCRIPTION = (
    "Run the OpenAI-compatible gateway. With no --policy it schedules with Conductor's own policy "
    "(kvcache_aware) and the KV-cache index on: prompts tokenized by the workers' /tokenize, the index fed "
    "by the workers' KV events where an instance has a kv_events_endpoint, by the gateway's own dispatches "
    "otherwise. `--policy round_robin --no-kv` routes without either."
)
SERVE_EPILOG = (
    "An annotated config: examples/conductor.yaml in the repository; the installed package ships the same "
    "file (conductor/data/conductor.yaml), written out by `conductor serve --print-example-config > "
    "conductor.yaml`. Check a config before starting: `conductor serve --config conductor.yaml --check "
    "[--probe]`."
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="YAML settings file (an annotated example: examples/conductor.yaml, or --print-example-config)",
    )
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
    _add_kv_args(p.add_argument_group("KV-cache awareness (the kv: settings)"))
    checks = p.add_argument_group("checking instead of serving")
    checks.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration (settings, policy and its options, key files, tokenizer, KV settings) "
        "without binding a port or starting anything: exit 0 with a one-line summary, 2 with the error",
    )
    checks.add_argument(
        "--probe",
        action="store_true",
        help="with --check (implied): also reach every worker (health, /v1/models, /tokenize, KV events "
        "endpoint, block size): one line per instance, exit 1 if one failed",
    )
    checks.add_argument("--print-example-config", action="store_true", help="print the annotated example config and exit")


def _add_kv_args(kv: argparse._ArgumentGroup) -> None:
    kv.add_argument(
        "--kv",
        action=argparse.BooleanOptionalAction,
        help="the KV-cache index the default policy places requests by; --no-kv: prompts only estimated "
        f"(kv.enabled) (default: {'on' if _default('kv.enabled') == 'True' else 'off'})",
    )
    kv.add_argument(
        "--tokenizer",
        metavar="PATH_OR_URL",
        help="auto (the workers' /tokenize, the built-in byte tokenizer where they serve none), worker, "
        f"builtin, a local Hugging Face tokenizer dir, or a worker URL to ask (default: {_default('kv.tokenizer')})",
    )
    kv.add_argument(
        "--block-size", type=int, help=f"tokens per KV block: the workers' --block-size (default: {_default('block_size')})"
    )
    kv.add_argument("--kv-index", choices=_choices("kv.index"), help=f"where the index lives (default: {_default('kv.index')})")
    kv.add_argument("--redis-url", help=f"the KV index's Redis, --kv-index redis (default: {_default('kv.redis_url')})")
    kv.add_argument("--indexer-url", help="a `conductor indexer`'s base URL, --kv-index indexer (default: none)")
    kv.add_argument(
        "--key-mode",
        choices=_choices("kv.key_mode"),
        help="block keys: the gateway's own xxhash chain (worker hashes translated from the events) or vLLM's "
        f"hashes (default: {_default('kv.key_mode')})",
    )
    kv.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        help="with --key-mode vllm: the workers' --prefix-caching-hash-algo "
        f"(kv.vllm_hash_algo) (default: {_default('kv.vllm_hash_algo')})",
    )
    kv.add_argument(
        "--hash-seed",
        help="with --key-mode vllm: the PYTHONHASHSEED the workers run with (kv.vllm_hash_seed) (default: none)",
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
        "block_size": args.block_size,
        "kv": _given(
            enabled=args.kv,
            index=args.kv_index,
            redis_url=args.redis_url,
            indexer_url=args.indexer_url,
            key_mode=args.key_mode,
            vllm_hash_algo=args.hash_algo,
            vllm_hash_seed=args.hash_seed,
            **_tokenizer_flag(args.tokenizer),
        ),
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


def _tokenizer_flag(value: str | None) -> dict[str, str | None]:
    """--tokenizer: a worker's URL is "ask that worker's /tokenize"; anything else is kv.tokenizer."""
    if value is not None and value.startswith(("http://", "https://")):
        return {"tokenizer": "worker", "tokenizer_url": value}
    return {"tokenizer": value}


def _given(**flags: Any) -> dict[str, Any] | None:
    """The flags given (a group's fields), None when none was: a flag left out sets nothing."""
    given = {k: v for k, v in flags.items() if v is not None}
    return given or None


def example_config() -> str:
    """The annotated example config the package ships (examples/conductor.yaml in the repository)."""
    from importlib.resources import files

    return files("conductor").joinpath("data", "conductor.yaml").read_text(encoding="utf-8")


def serve(args: argparse.Namespace) -> int:
    from conductor.ops.logs import configure_logging
    from conductor.server import check, serving

    if args.print_example_config:
        sys.stdout.write(example_config())
        return 0
    if args.check or args.probe:
        return check.run_check(lambda: settings_from_args(args), probe=args.probe)
    settings = settings_from_args(args)
    configure_logging(settings.logs.level, settings.logs.format, settings.logs.access_log)
    check.check_instances(settings)
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
            f"conductor {command}: needs the optional package {package!r}: pip install '.[{extra}]' from the checkout",
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
    "explain": (
        "show where a gateway would route a request now, and why",
        _delegate("conductor.explain_cli", "explain_main"),
    ),
    "status": ("a gateway's fleet, decisions and SLO attainment", _delegate("conductor.status_cli", "status_main")),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="conductor", description="KVCache-aware P/D gateway and scheduler", formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"conductor {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show full errors (import errors, tracebacks)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway",
        description=SERVE_DESCRIPTION,
        epilog=SERVE_EPILOG,
        formatter_class=DefaultsHelpFormatter,
    )
    add_serve_args(serve_parser)
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
