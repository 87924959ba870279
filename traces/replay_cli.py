"""`conductor replay TRACE`: replay a trace through the simulator, or live against a gateway.

    conductor replay conversation --simulate --prefill 8 --decode 8 --paper --policy round_robin
    conductor replay conversation --paper --compare random,round_robin,least_loaded --json out.json
    conductor replay recorded.jsonl --live http://127.0.0.1:8000 --speedup 2

TRACE is a path (.jsonl or .jsonl.gz, Mooncake or recorded format) or a bundled name
("conversation", "synthetic", "conversation-head400", "tool-agent"). Simulation and live replay print the same
summary table. Live replay lives in `traces.live` (`run_live(args)`, options from `add_live_args`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from conductor.core.cli_help import DefaultsHelpFormatter
from conductor.core.errors import ConductorError
from traces import live
from traces.formats import load_trace, resolve_trace
from traces.sim.options import add_cluster_args, add_policy_args, apply_policy_args, config_from_args, describe
from traces.sim.results import RunResult, format_table
from traces.sim.runner import PolicySpec, SimJob, parse_specs, run_jobs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conductor replay", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("trace", help="trace file or bundled name (conversation, synthetic, conversation-head400, tool-agent)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--simulate", action="store_true", help="discrete-event simulation (the default)")
    mode.add_argument("--live", metavar="URL", help="replay against a running gateway (traces.live)")
    parser.add_argument("--prefill", type=int, default=8, help="prefill instances (simulation)")
    parser.add_argument("--decode", type=int, default=8, help="decode instances (simulation)")
    parser.add_argument("--policy", default="round_robin", help="registered policy name, options as name:key=value:key=value")
    parser.add_argument(
        "--compare", default=None, metavar="A,B,...", help="run several policies on the same trace and cluster, side by side"
    )
    parser.add_argument("--jobs", type=int, default=None, help="parallel simulations (default: one per core)")
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write results as JSON")
    add_policy_args(parser)
    add_cluster_args(parser)
    live.add_live_args(parser)
    return parser


def write_json(path: str, trace: str, results: Sequence[RunResult]) -> None:
    doc = {"trace": trace, "results": [r.as_dict() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _report(args: argparse.Namespace, results: Sequence[RunResult]) -> None:
    print(format_table(results))
    if args.json_out:
        write_json(args.json_out, args.trace, results)
        print(f"wrote {args.json_out}")


def replay_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.live:
            return live.run_live(args)
        path = resolve_trace(args.trace)
        if not path.exists():
            print(f"error: trace {args.trace} not found", file=sys.stderr)
            return 2
        loaded = load_trace(path, limit=args.limit)
        for err in loaded.errors[:10]:
            print(f"warning: {path}: {err} (skipped)", file=sys.stderr)
        if len(loaded.errors) > 10:
            print(f"warning: {len(loaded.errors) - 10} more malformed lines skipped", file=sys.stderr)
        if not loaded.requests:
            print(f"error: trace {args.trace} has no usable requests", file=sys.stderr)
            return 2
        specs = parse_specs(args.compare) if args.compare else [PolicySpec.parse(args.policy)]
        specs = apply_policy_args(specs, args)
        config = config_from_args(args, args.prefill, args.decode)
        jobs = [SimJob(spec, config, str(path), args.limit) for spec in specs]
        results = run_jobs(jobs, workers=args.jobs)
    except (ConductorError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _report(args, results)
    print(f"setting: {describe(config)}")
    return 0


if __name__ == "__main__":
    sys.exit(replay_main())
