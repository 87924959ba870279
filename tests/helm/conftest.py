"""Fixtures of the chart tests: a helm binary, required (tests/support/ci.py: skip here, fail in CI)."""

from __future__ import annotations

import pytest

from tests.helm.chart import HELM
from tests.support.ci import require


@pytest.fixture
def helm_required() -> None:
    """`needs_helm` (tests/helm/chart.py) puts this on every test that renders the chart."""
    require(HELM is not None, "no helm binary: run `bash .ci/helm.sh` (installs .ci/bin/helm)")
