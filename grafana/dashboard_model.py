"""The dashboard model behind grafana/build_dashboards.py: PromQL helpers, panels, rows, and their
Grafana JSON on the 24-column grid (every panel needs a description; units are checked by
tests/helm/test_dashboards.py against the metric names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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


def of_role(expr: str, roles: str) -> str:
    """`expr`'s per-instance series kept for the instances whose role matches `roles` (a regex).

    The gateway exports its per-instance gauges for every instance, whatever its role; the role
    is a label of conductor_instance_healthy only. Grouped by (namespace, instance, role) that is
    one series of value 1 per instance, however many gateway replicas report it, so the join is
    many-to-one and the product keeps `expr`'s values."""
    healthy = sel("conductor_instance_healthy", f'role=~"{roles}"')
    return f"{expr} * on (namespace, instance) group_left (role) group by (namespace, instance, role) ({healthy})"


# rate() / increase() of a counter: what such a panel plots is a count of events
_COUNTER_RATE = re.compile(r"\b(?:rate|increase)\([a-zA-Z_:][a-zA-Z0-9_:]*_total\{")


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel. legend: Grafana legend format ({{label}} placeholders)."""

    expr: str
    legend: str = ""
    heatmap: bool = False  # bucket counts laid out as a heatmap rather than a series


@dataclass(frozen=True)
class Panel:
    """A panel: kind is a Grafana panel type (timeseries, stat, heatmap); unit a Grafana unit id, the one
    its metrics' names call for (fractions 0..1 are `percentunit`, never `percent`; rates of tokens
    `suffix: tok/s`)."""

    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 8
    height: int = 8
    stack: bool = False
    mappings: tuple[dict[str, Any], ...] = ()

    @property
    def counts_events(self) -> bool:
        """Every query a rate of counters (no ratio, no histogram): no series means nothing counted.

        A labelled counter (by reason, by instance and kind) has no series until its first event,
        so such a panel reads 0 when empty (Grafana's "no value"), never "No data", which looks
        broken; a ratio or a quantile of nothing stays "No data": it has no value."""
        return all(_COUNTER_RATE.search(t.expr) and " / " not in t.expr and not t.heatmap for t in self.targets)

    def __post_init__(self) -> None:
        # the description is the panel's help text in Grafana (the "i" by its title): an operator
        # looking at a number at 3 a.m. must be able to tell what it counts without this script
        if not self.description.strip():
            raise ValueError(f"panel {self.title!r} has no description")


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
        self.out.append(
            {
                "type": "row",
                "title": title,
                "id": self.new_id(),
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
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
        target: dict[str, Any] = {
            "refId": chr(ord("A") + n),
            "datasource": DATASOURCE,
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "range": True,
        }
        if t.heatmap:
            target["format"] = "heatmap"
        targets.append(target)
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.counts_events:
        defaults["noValue"] = "0"
    if p.mappings:
        defaults["mappings"] = list(p.mappings)
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if not p.stack else 40,
            "showPoints": "never",
            "spanNulls": True,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
    options: dict[str, Any]
    if p.kind == "timeseries":
        options = {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "heatmap":
        options = {
            "calculate": False,
            "yAxis": {"unit": p.unit},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "tooltip": {"mode": "single", "yHistogram": True},
        }
    else:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "value_and_name",
        }
    return {
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "id": panel_id,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def _templating() -> dict[str, Any]:
    namespace_query = "label_values(conductor_instance_healthy, namespace)"  # present from the first scrape
    return {
        "list": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            {
                "name": "namespace",
                "label": "Namespace",
                "type": "query",
                "datasource": DATASOURCE,
                "query": {"query": namespace_query, "refId": "namespace"},
                "definition": namespace_query,
                "includeAll": True,
                "allValue": ".*",
                "multi": False,
                "refresh": 2,
                "sort": 1,
                "current": {},
                "hide": 0,
                "options": [],
                "regex": "",
            },
        ]
    }


def dashboard(uid: str, title: str, description: str, rows: tuple[Row, ...]) -> dict[str, Any]:
    """A whole dashboard: rows of panels laid out on the 24-column grid."""
    layout = _Layout()
    for row in rows:
        layout.row(row.title)
        for p in row.panels:
            layout.place(_panel_json(p, layout.new_id()), p.width, p.height)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["conductor", "llm", "vllm"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": _templating(),
        "panels": layout.out,
        "links": [],
    }
