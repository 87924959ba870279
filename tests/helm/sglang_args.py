"""Parse `sglang.launch_server` argument lists with SGLang's own ServerArgs; run with a Python that
has SGLang importable.

    python tests/helm/sglang_args.py '[["--model-path", "M", ...], ...]'

Prints one JSON object: "results", per argument list what SGLang made of it (disaggregation mode,
bootstrap port, its KVEventsConfig, ...) or the error it raised. No server is started.
tests/helm/test_chart_vllm.py calls it; it is not imported by the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _describe(args: argparse.Namespace) -> dict[str, Any]:
    from sglang.srt.disaggregation.kv_events import KVEventsConfig
    from sglang.srt.server_args import ServerArgs

    server = ServerArgs.from_cli_args(args)  # runs SGLang's own checks of the combination
    events = KVEventsConfig.from_cli(server.kv_events_config) if server.kv_events_config else None
    return {
        "model": server.model_path,
        "served": server.served_model_name,
        "host": server.host,
        "port": server.port,
        "page_size": server.page_size,
        "tp_size": server.tp_size,
        "disaggregation_mode": server.disaggregation_mode,
        "bootstrap_port": server.disaggregation_bootstrap_port,
        "transfer_backend": server.disaggregation_transfer_backend,
        "metrics": server.enable_metrics,
        "kv_events": None
        if events is None
        else {"publisher": events.publisher, "endpoint": events.endpoint, "topic": events.topic},
    }


def main(argv_lists: list[list[str]]) -> dict[str, Any]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    results: list[dict[str, Any]] = []
    for argv in argv_lists:
        try:
            results.append(_describe(parser.parse_args(argv)))
        except (SystemExit, Exception) as exc:  # report every refusal, keep checking the others
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return {"results": results}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
