"""`conductor explain`: ask a running gateway where a request would go now, and why.

    conductor explain request.json --url http://gateway:9000 --admin-key "$KEY"
    echo '{"model": "m", "prompt": "hi"}' | conductor explain --json

The body (an OpenAI completions or chat request, from a file or stdin) is posted as it is to the
gateway's `POST /admin/explain` (conductor/server/explain_route.py): on its admin port when it has
one, else on its public port. The gateway checks it as its OpenAI routes do, decides without
forwarding anything or changing any state, and answers the decision; this prints it as a table
(`--json`: the gateway's JSON as it came). Exit status 0 with an answer, 1 when the gateway
refused the request (its error message on stderr), 2 when it could not be asked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from conductor.core.cli_help import DefaultsHelpFormatter

DEFAULT_URL = "http://127.0.0.1:8000"
# the candidate table: (heading, where the figure is), figures from the policy's detail by name
_COLUMNS: tuple[tuple[str, str], ...] = (
    ("queue_s", "queue_s"),
    ("transfer_s", "transfer_s"),
    ("prefill_s", "prefill_s"),
    ("handoff_s", "handoff_s"),
    ("ttft_s", "predicted_ttft_s"),
    ("tbt_s", "predicted_tbt_s"),
    ("batch", "batch"),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conductor explain",
        description="Show the decision a gateway would make for a request now, and why (nothing is sent to a worker).",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("body", nargs="?", default="-", help="JSON request body file; - for stdin")
    p.add_argument(
        "--url",
        default=os.environ.get("CONDUCTOR_URL", DEFAULT_URL),
        help="the gateway's admin URL: its admin port, else its public port (env CONDUCTOR_URL)",
    )
    p.add_argument("--admin-key", help="an admin API key (default: env CONDUCTOR_ADMIN_KEY)")
    p.add_argument("--kind", choices=["completions", "chat"], help="the request's route (default: chat when it has messages)")
    p.add_argument("--slo-ttft-ms", type=float, help="a per-request TTFT SLO, as the x-slo-ttft-ms header")
    p.add_argument("--slo-tbt-ms", type=float, help="a per-request TBT SLO, as the x-slo-tbt-ms header")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON answer as it is")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer")
    return p


def explain_main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    raw = sys.stdin.buffer.read() if args.body == "-" else _read_file(args.body)
    if raw is None:
        return 2
    headers = {"content-type": "application/json"}
    key = args.admin_key or os.environ.get("CONDUCTOR_ADMIN_KEY")
    if key:
        headers["authorization"] = f"Bearer {key}"
    for header, value in (("x-slo-ttft-ms", args.slo_ttft_ms), ("x-slo-tbt-ms", args.slo_tbt_ms)):
        if value is not None:
            headers[header] = f"{value:g}"
    params = {"kind": args.kind} if args.kind else None
    url = args.url.rstrip("/") + "/admin/explain"
    try:
        r = httpx.post(url, content=raw, headers=headers, params=params, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"conductor explain: cannot ask {url}: {exc}", file=sys.stderr)
        return 2
    if r.status_code != 200:
        print(f"conductor explain: the gateway answered HTTP {r.status_code}: {_error_message(r)}", file=sys.stderr)
        return 1
    answer = r.json()
    print(json.dumps(answer, indent=2) if args.json else render(answer))
    return 0


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        print(f"conductor explain: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return None


def _error_message(r: httpx.Response) -> str:
    try:
        error = r.json().get("error")
    except ValueError:
        return r.text[:500]
    return str(error.get("message")) if isinstance(error, dict) else r.text[:500]


def _fig(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}{unit}"
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def render(answer: dict[str, Any]) -> str:
    """The explanation (conductor/routing/explain.py, Explanation.to_json) as readable lines."""
    v, slo = answer["verdict"], answer["slo"]
    lines = [
        f"request: {answer['kind']}, model {answer['model']}, {answer['prompt_tokens']} prompt tokens"
        f" ({'tokenized' if answer['exact'] else 'estimated'}), max_tokens {answer['max_tokens']},"
        f" {'streamed' if answer['stream'] else 'not streamed'}",
        f"SLO: TTFT {_fig(slo['ttft_s'], ' s')}, TBT {_fig(slo['tbt_s'], ' s')}",
        f"policy: {answer['policy']}",
    ]
    if v["admitted"]:
        lines.append(f"verdict: admitted (HTTP {v['status']})")
    else:
        retry = "" if v["retryable"] else ", retrying cannot help"
        lines.append(f"verdict: REJECTED, HTTP {v['status']} {v['reason']}{retry}: {v['message']}")
    where = f"prefill {answer['prefill']}" + (f" -> decode {answer['decode']}" if answer["decode"] else "")
    if answer["prefill"] is None:
        where = "nowhere"
    elif answer["prefill"] == answer["decode"]:
        where = f"decode {answer['decode']}, which prefills it itself"
    pull = f"{answer['pull_tokens']} tokens from {answer['pull_from']}" if answer["pull_from"] else "none"
    lines += [
        f"placement: {where}; pull: {pull}",
        f"predicted: TTFT {_fig(answer['predicted_ttft_s'], ' s')}, TBT {_fig(answer['predicted_tbt_s'], ' s')}",
        f"in flight at the gateway: {answer['inflight']['count']} of {answer['inflight']['limit']}",
        "",
        *_table(answer["candidates"]),
    ]
    if answer["unlisted_candidates"]:
        lines.append(f"(+{answer['unlisted_candidates']} instances weighed and not listed)")
    return "\n".join(lines)


def _table(candidates: list[dict[str, Any]]) -> list[str]:
    head = ["instance", "role", "chosen", "cached", "pullable", *(h for h, _ in _COLUMNS)]
    rows = [head]
    for c in candidates:
        figures = {**c["detail"], "predicted_ttft_s": c["predicted_ttft_s"], "predicted_tbt_s": c["predicted_tbt_s"]}
        rows.append(
            [
                c["instance"],
                c["role"],
                "*" if c["chosen"] else "",
                str(c["indexed_cached_tokens"]),
                str(c["pullable_tokens"]),
                *(_fig(figures.get(key)) for _, key in _COLUMNS),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
