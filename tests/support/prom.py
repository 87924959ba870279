"""Reading a Prometheus text exposition (a gateway's or a worker's GET /metrics) in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample called `name` (a counter's with its _total) whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def scrape(url: str, name: str, **labels: str) -> float:
    """metric_sum over GET `url`/metrics."""
    return metric_sum(httpx.get(url + "/metrics", timeout=30).text, name, **labels)
