"""Writes the Grafana dashboards in this folder (the JSON files are generated: edit this script).

    python grafana/build_dashboards.py           # rewrite grafana/*.json
    python grafana/build_dashboards.py --check   # exit 1 if a JSON file is stale

Every query reads metric names the gateway exports (conductor/metrics.py) or vLLM's own
(`vllm:`); tests/helm/test_chart.py checks them against a live gateway's /metrics. Panels use the
`${DS_PROMETHEUS}` datasource variable, so the files work both when imported by hand and when the
chart's ConfigMap is provisioned by the Grafana sidecar.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE = "$__rate_interval"
# every selector is scoped to the chosen namespace ("All" matches series without the label too)
NS = 'namespace=~"$namespace"'


def sel(metric: str, matchers: str = "") -> str:
    """A series selector scoped to the dashboard's namespace variable."""
    return f"{metric}{{{NS}{', ' + matchers if matchers else ''}}}"


def rate(metric: str, matchers: str = "") -> str:
    return f"rate({sel(metric, matchers)}[{RATE}])"


def quantile(q: float, histogram: str, by: str = "", matchers: str = "") -> str:
    """histogram_quantile over a histogram's buckets, summed across gateway replicas or pods."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(histogram + '_bucket', matchers)}))"


def mean(histogram: str) -> str:
    return f"sum({rate(histogram + '_sum')}) / sum({rate(histogram + '_count')})"


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel. legend: Grafana legend format ({{label}} placeholders)."""

    expr: str
    legend: str = ""
    heatmap: bool = False  # bucket counts laid out as a heatmap rather than a series


@dataclass(frozen=True)
class Panel:
    """A panel: kind is a Grafana panel type (timeseries, stat, heatmap); unit a Grafana unit id."""

    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 8
    height: int = 8
    stack: bool = False
    mappings: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass
class _Layout:
    """Places panels left to right, wrapping at Grafana's 24 columns; hands out panel ids."""

    x: int = 0
    y: int = 0
    row_height: int = 0
    next_id: int = 1
    out: list[dict[str, Any]] = field(default_factory=list)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self.newline()
        self.out.append({"type": "row", "title": title, "id": self.new_id(), "collapsed": False,
                         "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x, self.row_height = 0, 0

    def place(self, panel: dict[str, Any], width: int, height: int) -> None:
        if self.x + width > 24:
            self.newline()
        panel["gridPos"] = {"h": height, "w": width, "x": self.x, "y": self.y}
        self.x += width
        self.row_height = max(self.row_height, height)
        self.out.append(panel)


def _panel_json(p: Panel, panel_id: int) -> dict[str, Any]:
    targets = []
    for n, t in enumerate(p.targets):
        target: dict[str, Any] = {"refId": chr(ord("A") + n), "datasource": DATASOURCE, "expr": t.expr,
                                  "legendFormat": t.legend or "__auto", "range": True}
        if t.heatmap:
            target["format"] = "heatmap"
        targets.append(target)
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.mappings:
        defaults["mappings"] = list(p.mappings)
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not p.stack else 40,
                              "showPoints": "never", "spanNulls": True,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
    options: dict[str, Any]
    if p.kind == "timeseries":
        options = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.kind == "heatmap":
        options = {"calculate": False, "yAxis": {"unit": p.unit}, "cellGap": 1,
                   "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                   "tooltip": {"mode": "single", "yHistogram": True}}
    else:
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "background", "graphMode": "none", "textMode": "value_and_name"}
    return {"type": p.kind, "title": p.title, "description": p.description, "id": panel_id,
            "datasource": DATASOURCE, "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options}


def _templating() -> dict[str, Any]:
    namespace_query = "label_values(conductor_instance_healthy, namespace)"  # present from the first scrape
    return {"list": [
        {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DATASOURCE,
         "query": {"query": namespace_query, "refId": "namespace"}, "definition": namespace_query,
         "includeAll": True, "allValue": ".*", "multi": False, "refresh": 2, "sort": 1,
         "current": {}, "hide": 0, "options": [], "regex": ""},
    ]}


def dashboard(uid: str, title: str, description: str, rows: tuple[Row, ...]) -> dict[str, Any]:
    """A whole dashboard: rows of panels laid out on the 24-column grid."""
    layout = _Layout()
    for row in rows:
        layout.row(row.title)
        for p in row.panels:
            layout.place(_panel_json(p, layout.new_id()), p.width, p.height)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["conductor", "llm", "vllm"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "timezone": "browser",
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": _templating(), "panels": layout.out, "links": [],
    }


_HEALTH = ({"type": "value", "options": {"0": {"text": "down", "color": "red", "index": 0},
                                         "1": {"text": "up", "color": "green", "index": 1}}},)


def _gateway_rows() -> tuple[Row, ...]:
    ok = rate("conductor_requests_total", 'status=~"2.."')
    cached = rate("conductor_prompt_tokens_total", 'source="cached"')
    return (
        Row("Traffic", (
            Panel("Requests by status", (Target(f"sum by (status) ({rate('conductor_requests_total')})",
                                                "{{status}}"),), "reqps", stack=True,
                  description="Answers per second at the gateway, by HTTP status (499: client went away)."),
            Panel("Success ratio", (Target(f"sum({ok}) / sum({rate('conductor_requests_total')})", "2xx"),),
                  "percentunit", kind="stat", width=4),
            Panel("Client disconnects", (Target(f"sum({rate('conductor_client_disconnects_total')})",
                                                "disconnects"),), "reqps", kind="stat", width=4),
            Panel("Rejections (HTTP 429) by reason",
                  (Target(f"sum by (reason) ({rate('conductor_rejections_total')})", "{{reason}}"),), "reqps",
                  stack=True, description="Requests refused before forwarding: predicted TTFT/TBT over "
                  "the SLO, queue full, ..."),
            Panel("Upstream errors by instance and kind",
                  (Target(f"sum by (instance, kind) ({rate('conductor_upstream_errors_total')})",
                          "{{instance}} {{kind}}"),), "reqps"),
            Panel("Decisions by prefill instance",
                  (Target(f"sum by (prefill) ({rate('conductor_decisions_total')})", "{{prefill}}"),), "reqps",
                  stack=True),
        )),
        Row("Latency", (
            Panel("TTFT at the gateway", tuple(
                Target(quantile(q, "conductor_ttft_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                "s", description="Arrival to first streamed token, quantiles over all gateway replicas."),
            Panel("TBT at the gateway", tuple(
                Target(quantile(q, "conductor_tbt_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                "s", description="Mean time between tokens of each stream."),
            Panel("Predicted vs observed TTFT", (
                Target(mean("conductor_predicted_ttft_seconds"), "predicted mean"),
                Target(mean("conductor_ttft_seconds"), "observed mean"),
                Target(quantile(0.9, "conductor_predicted_ttft_seconds"), "predicted p90"),
                Target(quantile(0.9, "conductor_ttft_seconds"), "observed p90"),
            ), "s", description="The policy's TTFT prediction for admitted requests against what streams saw."),
            Panel("TTFT histogram", (Target(f"sum by (le) (increase({sel('conductor_ttft_seconds_bucket')}"
                                            f"[{RATE}]))", "{{le}}", heatmap=True),), "s", kind="heatmap"),
            Panel("TBT histogram", (Target(f"sum by (le) (increase({sel('conductor_tbt_seconds_bucket')}"
                                           f"[{RATE}]))", "{{le}}", heatmap=True),), "s", kind="heatmap"),
            Panel("Request duration (arrival to last byte)", tuple(
                Target(quantile(q, "conductor_request_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)),
                "s"),
            Panel("Decision time", tuple(
                Target(quantile(q, "conductor_decision_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.99)),
                "s", description="Prompt analysis and the policy's decision, per request."),
            Panel("Prefill leg p90 by instance",
                  (Target(quantile(0.9, "conductor_prefill_leg_seconds", by="instance"), "{{instance}}"),), "s",
                  description="Queue plus prefill on each prefill instance, as the gateway timed it."),
        )),
        Row("Predictors", (
            Panel("Prediction error (MAPE) by component",
                  (Target(f"avg by (component) ({sel('conductor_prediction_mape')})", "{{component}}"),), "percent",
                  description="Mean absolute percentage error over each predictor's recent window, "
                  "averaged over instances and gateway replicas."),
            Panel("MAPE by component and instance",
                  (Target(f"avg by (component, instance) ({sel('conductor_prediction_mape')})",
                          "{{component}} {{instance}}"),), "percent"),
            Panel("p90 coverage (ideal 0.9)",
                  (Target(f"avg by (component) ({sel('conductor_prediction_p90_coverage')})", "{{component}}"),),
                  "percentunit", width=5,
                  description="Share of actuals at or under the predicted p90: well below 0.9 means the "
                  "predictor is optimistic and admission lets too much in."),
            Panel("Samples in error window",
                  (Target(f"sum by (component) ({sel('conductor_prediction_samples')})", "{{component}}"),),
                  "short", kind="stat", width=3),
        )),
        Row("Instances (gateway view)", (
            Panel("Queued prefill tokens per instance",
                  (Target(f"sum by (instance) ({sel('conductor_instance_queued_prefill_tokens')})",
                          "{{instance}}"),), "short", description="Prefill tokens in flight, all replicas."),
            Panel("Running decodes per instance",
                  (Target(f"sum by (instance) ({sel('conductor_instance_running_decodes')})", "{{instance}}"),),
                  "short", description="Decode streams in flight, all replicas."),
            Panel("Instance health", (Target(f"min by (instance, role) ({sel('conductor_instance_healthy')})",
                                             "{{role}} {{instance}}"),), "short", kind="stat",
                  mappings=_HEALTH, description="Worst health result across gateway replicas: probes answered "
                  "and not ejected as an outlier."),
            Panel("Failovers and ejections", (
                Target(f"sum by (instance, reason) ({rate('conductor_failovers_total')})",
                       "failover from {{instance}} ({{reason}})"),
                Target(f"sum by (instance) ({rate('conductor_instance_ejections_total')})", "ejected {{instance}}"),
            ), "reqps", width=8, description="Requests decided again on another instance after a leg failed before "
                "any byte reached the client; and outlier ejections (consecutive 5xx or transport failures)."),
            Panel("Late prefill failures", (
                Target(f"sum by (instance) ({rate('conductor_late_prefill_failures_total')})", "{{instance}}"),),
                "reqps", width=8, description="Concurrent (Mooncake/SGLang) prefill legs that failed or were cut "
                "after their decode had answered the client in full: harmless to the client, a sign of a sick prefill."),
        )),
        Row("KV cache index", (
            Panel("Index hash agreement", (Target(f"min({sel('conductor_kv_hash_agreement')})", "worst replica"),
                                           Target(f"avg({sel('conductor_kv_hash_agreement')})", "mean")),
                  "percentunit", width=8,
                  description="Worker-reported / index-predicted cached tokens over each replica's recent "
                  "window. Near 1: the gateway's block keys match the engines'. Far below: wrong block "
                  "size, hash algorithm or PYTHONHASHSEED, and routing is blind to the cache."),
            Panel("Cached prompt tokens: predicted vs reported", (
                Target(f"sum({rate('conductor_kv_predicted_cached_tokens_total')})", "predicted by the index"),
                Target(f"sum({rate('conductor_kv_reported_cached_tokens_total')})", "reported by workers"),
            ), "short", width=16),
            Panel("KV index memory (estimated)", (
                Target(f"sum by (structure) ({sel('conductor_kv_memory_bytes')})", "{{structure}}"),),
                "bytes", width=8, description="Bytes the index and the per-instance hash maps hold, from measured "
                "per-entry costs; bounded by kv.index_memory_bytes and kv.hash_map_memory_bytes_per_instance."),
            Panel("KV index entries vs cap", (
                Target(f"sum by (structure) ({sel('conductor_kv_memory_entries')})", "{{structure}} entries"),
                Target(f"sum by (structure) ({sel('conductor_kv_memory_cap_entries')})", "{{structure}} cap"),
            ), "short", width=8),
            Panel("KV index evictions", (
                Target(f"sum by (structure) ({rate('conductor_kv_memory_evictions_total')})", "{{structure}}"),),
                "ops", width=8, description="Entries evicted to stay within the memory budget."),
        )),
        Row("Prefix cache", (
            Panel("Prefix hit rate (gateway)", (Target(
                f"sum({cached}) / "
                f"sum({rate('conductor_prompt_tokens_total')})", "cached / all prompt tokens"),),
                "percentunit", description="Share of routed prompt tokens the workers reported cached."),
            Panel("Prompt tokens: cached vs computed",
                  (Target(f"sum by (source) ({rate('conductor_prompt_tokens_total')})", "{{source}}"),),
                  "short", stack=True),
            Panel("Prompt tokens by source (workers)",
                  (Target(f"sum by (source) ({rate('vllm:prompt_tokens_by_source_total')})", "{{source}}"),),
                  "short", stack=True,
                  description="vLLM: computed here, local prefix-cache hit, or pulled over the KV connector."),
        )),
    )


def _worker_row() -> Row:
    return Row("Workers (vLLM)", (
        Panel("Running requests", (Target(f"sum by (pod) ({sel('vllm:num_requests_running')})", "{{pod}}"),)),
        Panel("Waiting requests", (Target(f"sum by (pod) ({sel('vllm:num_requests_waiting')})", "{{pod}}"),)),
        Panel("KV cache usage", (Target(f"max by (pod) ({sel('vllm:kv_cache_usage_perc')})", "{{pod}}"),),
              "percentunit"),
        Panel("Prefix cache hit rate", (Target(
            f"sum by (pod) ({rate('vllm:prefix_cache_hits_total')}) / "
            f"sum by (pod) ({rate('vllm:prefix_cache_queries_total')})", "{{pod}}"),), "percentunit"),
        Panel("Engine TTFT p90", (Target(quantile(0.9, "vllm:time_to_first_token_seconds", by="pod"),
                                         "{{pod}}"),), "s",
              description="Time to first token inside each engine (a prefill pod's includes only its leg)."),
        Panel("Inter-token latency p90", (Target(quantile(0.9, "vllm:inter_token_latency_seconds", by="pod"),
                                                 "{{pod}}"),), "s"),
        Panel("Queue time p90", (Target(quantile(0.9, "vllm:request_queue_time_seconds", by="pod"),
                                        "{{pod}}"),), "s"),
        Panel("Generation tokens", (Target(f"sum by (pod) ({rate('vllm:generation_tokens_total')})", "{{pod}}"),),
              "short", stack=True),
    ))


def overview() -> dict[str, Any]:
    return dashboard(
        "conductor-overview", "Conductor overview",
        "Conductor gateway (admission, routing, latency, prefix reuse) and its vLLM workers.",
        (*_gateway_rows(), _worker_row()),
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
