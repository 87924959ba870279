"""`conductor status`: a running gateway's status in the terminal, as its /status page shows it.

    conductor status --url http://gateway:9001 --admin-key "$KEY"
    conductor status --watch          # redrawn every --interval seconds until Ctrl-C
    conductor status --json           # the gateway's JSON as it came

It reads `GET /admin/status` (conductor/server/status_route.py) on the gateway's admin port when it
has one, else on its public port: the instances (role, health, ejection, panic, queued prefill
tokens, running decodes, in flight, KV hash agreement and alarms), the counts of the last minutes
(decisions, rejections by reason, SLO attainment) and the last decisions with their candidates.
Exit status 0 with an answer, 1 when the gateway refused (its error on stderr), 2 when it could not
be asked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from conductor.core.cli_help import DefaultsHelpFormatter

DEFAULT_URL = "http://127.0.0.1:8000"
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a redraw in --watch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conductor status",
        description="Show a running gateway's instances, recent decisions and SLO attainment.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--url",
        default=os.environ.get("CONDUCTOR_URL", DEFAULT_URL),
        help="the gateway's admin URL: its admin port, else its public port (env CONDUCTOR_URL)",
    )
    p.add_argument("--admin-key", help="an admin API key (default: env CONDUCTOR_ADMIN_KEY)")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON answer as it is")
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws with --watch")
    p.add_argument("--decisions", type=int, default=10, help="how many of the latest decisions to print")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    return p


def _fig(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in (head, *rows)]


def _kv(kv: dict[str, Any] | None) -> str:
    if kv is None:
        return "-"
    alarms = "".join(f" ALARM {d}: {cause}" for d, cause in kv["alarms"].items())
    return f"{_pct(kv['agreement'])}/{_pct(kv['coverage'])} ({kv['samples']}){alarms}"


_INSTANCE_HEAD = (
    "INSTANCE",
    "ROLE",
    "STATE",
    "PROBE",
    "EJECTED",
    "PANIC",
    "QUEUED_TOKENS",
    "DECODES",
    "INFLIGHT",
    "KV_AGREE/COVER",
)
_DECISION_HEAD = ("#", "REQUEST", "PROMPT", "PREFILL", "DECODE", "TTFT_S", "TBT_S", "OUTCOME")


def _instance_table(instances: list[dict[str, Any]]) -> list[str]:
    rows = [
        (
            i["name"],
            i["role"],
            i["state"],
            "ok" if i["probe_ok"] else "failing",
            "EJECTED" if i["ejected"] else "no",
            "PANIC" if i["panic"] else "no",
            f"{i['queued_prefill_tokens']} ({i['queued_prefills']})",
            str(i["running_decodes"]),
            str(i["inflight"]),
            _kv(i["kv"]),
        )
        for i in instances
    ]
    return _table(_INSTANCE_HEAD, rows)


def _decision_table(decisions: list[dict[str, Any]]) -> list[str]:
    rows = [
        (
            str(d["seq"]),
            str(d["request_id"]),
            _fig(d["prompt_tokens"]),
            str(d["prefill"] or "-"),
            str(d["decode"] or "-"),
            _fig(d["predicted_ttft_s"]),
            _fig(d["predicted_tbt_s"]),
            f"rejected: {d['rejection']['reason']}" if d.get("rejection") else f"routed ({len(d['candidates'])} candidates)",
        )
        for d in decisions
    ]
    return _table(_DECISION_HEAD, rows)


def render(status: dict[str, Any], decisions: int = 10) -> str:
    """The status as terminal tables: the fleet, the window's counts, the latest decisions."""
    inflight, window, kv = status["inflight"], status["window"], status.get("kv")
    lines = [
        f"policy {status['policy']}  in flight {inflight['count']}/{inflight['limit']}  "
        f"panic: {', '.join(status['panic_roles']) or 'none'}"
        + ("" if kv is None else f"  KV agreement {_pct(kv['agreement'])}, coverage {_pct(kv['coverage'])}")
        + (" ALARM" if kv and kv["alarmed"] else ""),
        "",
        *_instance_table(status["instances"]),
    ]
    outcomes = window["outcomes"]
    rejected = ", ".join(f"{r}: {n}" for r, n in window["rejections"].items()) or "none"
    lines += [
        "",
        f"last {window['window_s'] / 60:.0f} min: {window['decisions']} decisions, rejected {rejected}; "
        f"TTFT SLO met {_pct(window['ttft_attainment'])} of {outcomes['ttft_met'] + outcomes['ttft_missed']}, "
        f"TBT SLO met {_pct(window['tbt_attainment'])} of {outcomes['tbt_met'] + outcomes['tbt_missed']}, "
        f"failed {outcomes['failed']}",
        "",
        *_decision_table(status["decisions"][: max(0, decisions)]),
    ]
    return "\n".join(lines)


def fetch(url: str, key: str | None, timeout: float) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url.rstrip("/") + "/admin/status", headers=headers, timeout=timeout)
    try:
        body = r.json()
    except ValueError:
        body = {"error": {"message": r.text[:200] or r.reason_phrase}}
    return r.status_code, body


def _show_once(args: argparse.Namespace, key: str | None) -> int:
    try:
        code, body = fetch(args.url, key, args.timeout)
    except httpx.HTTPError as exc:
        print(f"conductor status: could not reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if code != 200:
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        print(f"conductor status: the gateway answered {code}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2) if args.json else render(body, args.decisions), flush=True)
    return 0


def status_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    key = args.admin_key or os.environ.get("CONDUCTOR_ADMIN_KEY")
    if not args.watch:
        return _show_once(args, key)
    try:
        while True:
            print(CLEAR, end="")
            code = _show_once(args, key)
            if code == 1:  # a refusal does not get better by asking again
                return code
            time.sleep(max(0.1, args.interval))  # the redraw period the operator asked for, not a wait on a state
    except KeyboardInterrupt:
        return 0
