"""`policy: judged` from a gateway's YAML (policies/judged.py): the options reach the baseline and
kvcache_aware's judge, the gateway tells it the priority classes, and a bad option stops
`conductor serve` with the key named, no traceback; the live bench's "conductor rr+adm" column is
this policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.bench_live_vs_peers import parse_args
from benchmarks.live_routers import ROUTERS, start_router
from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from policies.judged import JudgedPolicy
from policies.simple import LeastLoadedPolicy

CONFIG = """
policy: judged
policy_options:
  place: {place}
  place_options: {{listed_candidates: 2}}
  admission: early
  window: 128
  {extra}
models: [tiny]
slo: {{ttft_s: 2.0, tbt_s: 0.1}}
priority:
  classes:
    interactive: {{rank: 0}}
    batch: {{rank: 1, sheddable: true}}
  default: interactive
prefill: [{{url: "http://127.0.0.1:9", bootstrap_port: 7}}]
decode: ["http://127.0.0.1:10"]
"""


def _config(tmp_path: Path, place: str = "least_loaded", extra: str = "") -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(CONFIG.format(place=place, extra=extra))
    return path


def test_the_gateway_builds_the_judged_policy_from_yaml(tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path), environ={})
    policy = Gateway(settings).policy
    assert isinstance(policy, JudgedPolicy) and policy.name == "judged(least_loaded)"
    assert isinstance(policy.inner, LeastLoadedPolicy) and policy.inner.listed_candidates == 2
    judge = policy.judge
    assert judge.admission == "early" and judge.options.learning.window == 128
    assert judge.classes.less_urgent("batch") and judge.classes.urgent_slo.ttft_s == 2.0  # told at start-up


def test_a_bad_option_stops_serve_naming_the_key(tmp_path: Path) -> None:
    for place, extra, named in (
        ("round_robin", "ttft_slack: 0.5", "judged option 'ttft_slack' steers kvcache_aware's own placement"),
        ("round_robin", "windoww: 3", "judged has no option 'windoww' (did you mean 'window'?)"),
        ("kvcache_aware", "", "judged option 'place' names kvcache_aware, which has predictors and admission"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "conductor", "serve", "--config", str(_config(tmp_path, place, extra))],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, run.stderr
        assert named in run.stderr and "Traceback" not in run.stderr


class _Recorded:
    """Stands in for the live bench's process group (live_routers.start_router's): keeps the command it would start."""

    def __init__(self) -> None:
        self.argv: list[str] = []

    def start(self, name: str, argv: list[str], **_: object) -> None:
        self.argv = argv


def test_the_live_bench_rr_adm_column_starts_round_robin_under_the_judge(tmp_path: Path) -> None:
    spec = next(s for s in ROUTERS if s.name == "conductor rr+adm")
    group = _Recorded()
    workers = {"mixed": [{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:10"}]}
    start_router(group, spec, workers, parse_args(["--time-scale", "2"]), tmp_path)  # type: ignore[arg-type]
    config = Path(group.argv[group.argv.index("--config") + 1])
    policy = Gateway(load_settings(config, environ={})).policy
    assert isinstance(policy, JudgedPolicy) and policy.name == "judged(round_robin)"
    assert policy.judge.admission == "predicted" and policy.judge.options.learning.predictor_params  # scaled like the workers


def test_the_documented_configuration_loads() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "kvcache_aware.md").read_text()
    section = doc[doc.index("## A baseline under kvcache_aware's admission") :]
    block = section[section.index("```yaml") + len("```yaml") : section.index("```\n", section.index("```yaml") + 7)]
    documented = yaml.safe_load(block)
    settings = load_settings(environ={}, overrides={**documented, "mixed": ["http://127.0.0.1:9"], "models": ["tiny"]})
    policy = Gateway(settings).policy
    assert isinstance(policy, JudgedPolicy) and policy.name == "judged(round_robin)"
