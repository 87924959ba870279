"""Writes the Grafana dashboards in this folder (the JSON files are generated: edit this script, its
gateway rows, or cache_rows.py, the KV cache, prefix and worker rows).

    python grafana/build_dashboards.py           # rewrite grafana/*.json
    python grafana/build_dashboards.py --check   # exit 1 if a JSON file is stale

Every query reads metric names the gateway exports (conductor/ops/metrics.py) or vLLM's own
(`vllm:`); tests/helm/test_dashboards.py checks them against a live gateway's /metrics, checks each
panel's unit against its metrics' names (seconds, bytes, fractions, per-second rates) and that every
panel has a description (building a Panel without one fails). Panels use the
`${DS_PROMETHEUS}` datasource variable, so the files work both when imported by hand and when the
chart's ConfigMap is provisioned by the Grafana sidecar.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling modules
from cache_rows import kv_events_row, kv_index_row, prefix_row, worker_row
from dashboard_model import RATE, Panel, Row, Target, dashboard, mean, of_role, quantile, rate, sel

HERE = Path(__file__).resolve().parent

_HEALTH = (
    {
        "type": "value",
        "options": {"0": {"text": "down", "color": "red", "index": 0}, "1": {"text": "up", "color": "green", "index": 1}},
    },
)


def _traffic_row() -> Row:
    """What became of the requests: answered, refused, failed upstream, decided."""
    ok = rate("conductor_requests_total", 'status=~"2.."')
    return Row(
        "Traffic",
        (
            Panel(
                "Requests by status",
                (Target(f"sum by (status) ({rate('conductor_requests_total')})", "{{status}}"),),
                "reqps",
                stack=True,
                description="Answers per second at the gateway, by HTTP status (499: client went away).",
            ),
            Panel(
                "Success ratio",
                # no 2xx series at all while requests fail is 0%, not "No data"
                (Target(f"(sum({ok}) or vector(0)) / sum({rate('conductor_requests_total')})", "2xx"),),
                "percentunit",
                kind="stat",
                width=4,
                description="Share of answers with a 2xx status over the range's rate window (429s and "
                "client disconnects count as failures here).",
            ),
            Panel(
                "Client disconnects",
                (Target(f"sum({rate('conductor_client_disconnects_total')})", "disconnects"),),
                "reqps",
                kind="stat",
                width=4,
                description="Requests per second whose client went away before the answer ended; every "
                "leg of such a request is cancelled.",
            ),
            Panel(
                "Requests by model",
                (Target(f"sum by (model) ({rate('conductor_model_requests_total')})", "{{model}}"),),
                "reqps",
                stack=True,
                description="Answers per second by the model served (an alias counts as its served name; "
                "a name the gateway does not know, a 404, makes no series).",
            ),
            Panel(
                "Rejections (HTTP 429) by reason",
                (Target(f"sum by (reason) ({rate('conductor_rejections_total')})", "{{reason}}"),),
                "reqps",
                stack=True,
                description="Requests refused before forwarding: predicted TTFT/TBT over the SLO, queue full, ...",
            ),
            Panel(
                "Requests held for streams to end",
                (Target(f"sum({sel('conductor_held_requests')})", "held"),),
                "short",
                description="Requests refused for their TBT only that wait at the gateway for streams to end, "
                "within their TTFT SLO (hold.max_held at most per replica), instead of a 429 at once.",
            ),
            Panel(
                "Hold time",
                tuple(Target(quantile(q, "conductor_hold_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9)),
                "s",
                description="How long held requests waited, admitted or refused at the end "
                "(conductor_hold_seconds by outcome: admitted, refused, cancelled).",
            ),
            Panel(
                "Requests by priority class",
                (Target(f"sum by (class, status) ({rate('conductor_priority_requests_total')})", "{{class}} {{status}}"),),
                "reqps",
                description="Answers per second by priority class (priority.classes) and HTTP status: a "
                "sheddable class's 429s (priority_shed) rise first as the gateway fills. Empty without classes.",
            ),
            Panel(
                "Tenant rejections by tenant and reason",
                (Target(f"sum by (tenant, reason) ({rate('conductor_tenant_rejections_total')})", "{{tenant}} {{reason}}"),),
                "reqps",
                stack=True,
                description="Tenants' (auth.tenants) requests refused per second: tenant_share (over its fair "
                "share while others wait), priority_shed, the policy's SLO reasons, overloaded (503).",
            ),
            Panel(
                "Upstream errors by instance and kind",
                (Target(f"sum by (instance, kind) ({rate('conductor_upstream_errors_total')})", "{{instance}} {{kind}}"),),
                "reqps",
                description="Failed legs to workers per second (connect, timeout, 5xx, ...). A series "
                "appears at an instance's first error; until a gateway has seen one the panel reads 0.",
            ),
            Panel(
                "Decisions by prefill instance",
                (Target(f"sum by (prefill) ({rate('conductor_decisions_total')})", "{{prefill}}"),),
                "reqps",
                stack=True,
                description="Routing decisions per second by the prefill instance chosen: how "
                "the policy spreads load and follows cached prefixes.",
            ),
        ),
    )


def _latency_row() -> Row:
    """Latency at the gateway and what the policy predicted of it."""
    return Row(
        "Latency",
        (
            Panel(
                "TTFT at the gateway",
                tuple(Target(quantile(q, "conductor_ttft_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                "s",
                description="Arrival to first streamed token, quantiles over all gateway replicas.",
            ),
            Panel(
                "TBT at the gateway",
                tuple(Target(quantile(q, "conductor_tbt_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                "s",
                description="Mean time between tokens of each stream.",
            ),
            Panel(
                "Predicted vs observed TTFT",
                (
                    Target(mean("conductor_predicted_ttft_seconds"), "predicted mean"),
                    Target(mean("conductor_ttft_seconds"), "observed mean"),
                    Target(quantile(0.9, "conductor_predicted_ttft_seconds"), "predicted p90"),
                    Target(quantile(0.9, "conductor_ttft_seconds"), "observed p90"),
                ),
                "s",
                description="The policy's TTFT prediction for admitted requests against what streams saw.",
            ),
            Panel(
                "TTFT histogram",
                (Target(f"sum by (le) (increase({sel('conductor_ttft_seconds_bucket')}[{RATE}]))", "{{le}}", heatmap=True),),
                "s",
                kind="heatmap",
                description="Streams by time to first token, per interval: the whole distribution, "
                "where quantiles hide a second mode.",
            ),
            Panel(
                "TBT histogram",
                (Target(f"sum by (le) (increase({sel('conductor_tbt_seconds_bucket')}[{RATE}]))", "{{le}}", heatmap=True),),
                "s",
                kind="heatmap",
                description="Streams by mean time between tokens, per interval.",
            ),
            Panel(
                "Request duration (arrival to last byte)",
                tuple(Target(quantile(q, "conductor_request_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                "s",
                description="Whole requests at the gateway, streamed or not, from arrival to the last byte sent.",
            ),
            Panel(
                "Decision time",
                tuple(Target(quantile(q, "conductor_decision_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.99)),
                "s",
                description="Prompt analysis and the policy's decision, per request.",
            ),
            Panel(
                "Prefill leg p90 by instance",
                (Target(quantile(0.9, "conductor_prefill_leg_seconds", by="instance"), "{{instance}}"),),
                "s",
                description="Queue plus prefill on each prefill instance, as the gateway timed it: nixl "
                "only. Under pdProtocol mooncake (and sglang) both legs go out at once and the decode "
                "answers before the prefill leg ends, so no prefill leg is timed and this panel shows "
                '"No data": read the prefill pods\' "Engine TTFT p90" (their prefill) and "TTFT at '
                'the gateway" instead.',
            ),
        ),
    )


def _predictors_row() -> Row:
    """How well the policy's predictors fit the instances."""
    return Row(
        "Predictors",
        (
            Panel(
                "Prediction error (MAPE) by component",
                (Target(f"avg by (component) ({sel('conductor_prediction_mape')})", "{{component}}"),),
                "percentunit",
                description="Mean absolute percentage error over each predictor's recent window, "
                "averaged over instances and gateway replicas.",
            ),
            Panel(
                "MAPE by component and instance",
                (Target(f"avg by (component, instance) ({sel('conductor_prediction_mape')})", "{{component}} {{instance}}"),),
                "percentunit",
                description="The same error per instance: one instance far above the others has a "
                "profile that no longer fits it (other hardware, other model settings).",
            ),
            Panel(
                "p90 coverage (ideal 0.9)",
                (Target(f"avg by (component) ({sel('conductor_prediction_p90_coverage')})", "{{component}}"),),
                "percentunit",
                width=5,
                description="Share of actuals at or under the predicted p90: well below 0.9 means the "
                "predictor is optimistic and admission lets too much in.",
            ),
            Panel(
                "Samples in error window",
                (Target(f"sum by (component) ({sel('conductor_prediction_samples')})", "{{component}}"),),
                "short",
                kind="stat",
                width=3,
                description="Observations behind the MAPE and coverage figures: few samples, noisy figures.",
            ),
        ),
    )


def _instances_row() -> Row:
    """The gateway's view of each instance: load by role, health, failovers, ejections."""
    return Row(
        "Instances (gateway view)",
        (
            Panel(
                "Queued prefill tokens per instance",
                (
                    Target(
                        f"sum by (instance) ({of_role(sel('conductor_instance_queued_prefill_tokens'), 'prefill|mixed')})",
                        "{{instance}}",
                    ),
                ),
                "short",
                description="Prefill tokens the gateway replicas have in flight on each prefill and mixed "
                "instance (decode instances, which never prefill for the gateway, are left out).",
            ),
            Panel(
                "Running decodes per instance",
                (
                    Target(
                        f"sum by (instance) ({of_role(sel('conductor_instance_running_decodes'), 'decode|mixed')})",
                        "{{instance}}",
                    ),
                ),
                "short",
                description="Decode streams the gateway replicas have in flight on each decode and mixed "
                "instance (prefill instances, which only prefill, are left out).",
            ),
            Panel(
                "Instance health",
                (Target(f"min by (instance, role) ({sel('conductor_instance_healthy')})", "{{role}} {{instance}}"),),
                "short",
                kind="stat",
                mappings=_HEALTH,
                description="Worst health result across gateway replicas: probes answered and not ejected as an outlier.",
            ),
            Panel(
                "Failovers",
                (Target(f"sum by (instance, reason) ({rate('conductor_failovers_total')})", "from {{instance}} ({{reason}})"),),
                "reqps",
                width=8,
                description="Requests decided again on another instance after a leg failed before "
                "any byte reached the client, by the instance that failed and why.",
            ),
            Panel(
                "Lessons between worker processes",
                (Target(f"sum by (event) ({rate('conductor_worker_lessons_total')})", "{{event}}"),),
                "ops",
                width=8,
                description="`--workers N`: predictor samples each worker sent to its siblings "
                "(sent), learned from them (received), lost to a sibling not there or not keeping up (dropped), "
                "or refused as malformed (refused). Zero with one process or a policy without online predictors.",
            ),
            Panel(
                "Outlier ejections",
                (Target(f"sum by (instance) ({rate('conductor_instance_ejections_total')})", "ejected {{instance}}"),),
                "ops",
                width=8,
                description="Instances taken out of rotation per second after consecutive 5xx "
                "answers or transport failures (summed over gateway replicas).",
            ),
            Panel(
                "Late prefill failures",
                (Target(f"sum by (instance) ({rate('conductor_late_prefill_failures_total')})", "{{instance}}"),),
                "reqps",
                width=8,
                description="Concurrent (Mooncake/SGLang) prefill legs that failed or were cut "
                "after their decode had answered the client in full: harmless to the client, a sign of a sick prefill.",
            ),
        ),
    )


def overview() -> dict[str, Any]:
    return dashboard(
        "conductor-overview",
        "Conductor overview",
        "Conductor gateway (admission, routing, latency, prefix reuse) and its vLLM workers.",
        (
            _traffic_row(),
            _latency_row(),
            _predictors_row(),
            _instances_row(),
            kv_index_row(),
            prefix_row(),
            kv_events_row(),
            worker_row(),
        ),
    )


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    out = {}
    for name, board in (("conductor-overview.json", overview()),):
        out[name] = json.dumps(board, indent=2, sort_keys=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file differs")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run python grafana/build_dashboards.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
