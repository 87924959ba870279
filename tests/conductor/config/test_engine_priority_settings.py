"""The engine's own priority in the settings (conductor/config/priority.py `engine_priority`, the
instances' `scheduling_policy`) and what the classifier makes of a request's `priority` field
(conductor/routing/priority.py `Classifier.engine_priority`); the HTTP path is
tests/conductor/routing/test_engine_priority.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adapters.pd.base import Outgoing, Target, leg_body
from conductor.config.settings import load_settings
from conductor.core.errors import ConfigError
from conductor.routing.priority import Classifier

CLASSES = {"interactive": {}, "standard": {"rank": 1}, "batch": {"rank": 3, "sheddable": True}}


def _load(**given: Any) -> Any:
    return load_settings(environ={}, overrides={"mixed": ["http://m:1"], **given})


def _classifier(**priority: Any) -> Classifier:
    return Classifier(_load(priority=priority).priority, {})


def test_a_classs_engine_priority_is_its_rank_unless_set(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "priority:\n"
        "  classes:\n"
        "    interactive: {rank: 0, engine_priority: -5}\n"
        "    standard: {rank: 1}\n"
        "    batch: {rank: 3, sheddable: true, engine_priority: null}\n"
        "  default: standard\n"
        "mixed:\n"
        "  - {url: 'http://a:1', scheduling_policy: priority}\n"
        "  - {url: 'http://b:1'}\n"
    )
    s = load_settings(cfg, environ={})
    assert s.priority.engine_priorities() == {"interactive": -5, "standard": 1, "batch": None}
    assert not s.priority.trust_client_engine_priority
    assert [spec.scheduling_policy for spec in s.instances()] == ["priority", "fcfs"]


def test_pools_discovery_and_the_environment_say_which_workers_schedule_by_priority() -> None:
    s = load_settings(
        environ={"CONDUCTOR_PRIORITY__TRUST_CLIENT_ENGINE_PRIORITY": "true"},
        overrides={
            "pools": {"tiny": {"prefill": [{"url": "http://p:1", "scheduling_policy": "priority"}], "decode": ["http://d:1"]}},
            "discovery": {"decode": {"name": "decode.svc", "port": 8000, "scheduling_policy": "priority"}},
        },
    )
    assert {spec.name: spec.scheduling_policy for spec in s.instances()} == {
        "tiny-prefill-0": "priority",
        "tiny-decode-0": "fcfs",
    }
    assert s.discovery.decode is not None and s.discovery.decode.scheduling_policy == "priority"
    assert s.priority.trust_client_engine_priority


@pytest.mark.parametrize(
    ("given", "words"),
    [
        (
            # batch, less urgent than standard, would be served ahead of it
            {"priority": {"classes": {**CLASSES, "batch": {**CLASSES["batch"], "engine_priority": 0}}, "default": "standard"}},
            ["priority.classes.batch.engine_priority", "below the more urgent 'standard'", "1"],
        ),
        (
            {"priority": {"classes": {"interactive": {"engine_priority": 9}, "standard": {"rank": 1}}, "default": "standard"}},
            ["priority.classes.standard.engine_priority", "'interactive'"],
        ),
        ({"priority": {"classes": {"a": {"engine_priority": True}}, "default": "a"}}, ["priority.classes.a.engine_priority"]),
        ({"priority": {"classes": {"a": {"engine_priority": "high"}}, "default": "a"}}, ["priority.classes.a.engine_priority"]),
        ({"mixed": [{"url": "http://a:1", "scheduling_policy": "lifo"}]}, ["mixed.0.scheduling_policy", "'fcfs' or 'priority'"]),
        (
            {"discovery": {"mixed": {"name": "m.svc", "port": 1, "scheduling_policy": "Priority"}}},
            ["discovery.mixed.scheduling_policy"],
        ),
    ],
)
def test_a_bad_engine_priority_setting_is_a_start_up_error_naming_it(given: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _load(**given)
    for word in words:
        assert word in err.value.message, err.value.message


def test_the_classs_engine_priority_replaces_whatever_the_client_sent() -> None:
    c = _classifier(classes=CLASSES, default="standard")
    for given in (-100, "-5", -5.0, None, [1]):
        body = {"model": "m", "priority": given}
        out, engine = c.engine_priority("interactive", body)
        assert out == {"model": "m"} and engine == 0
        assert body == {"model": "m", "priority": given}  # the caller's body is not changed
    plain = {"model": "m"}
    out, engine = c.engine_priority("batch", plain)
    assert out is plain and engine == 3  # nothing to take out: no copy


def test_a_clients_integer_counts_only_where_trusted_and_its_class_sets_none() -> None:
    classes = {**CLASSES, "batch": {"rank": 3, "sheddable": True, "engine_priority": None}}
    trusting = _classifier(classes=classes, default="standard", trust_client_engine_priority=True)
    assert trusting.engine_priority("batch", {"priority": 7}) == ({}, 7)
    assert trusting.engine_priority("standard", {"priority": -7}) == ({}, 1)  # the class's wins
    assert trusting.engine_priority("batch", {"priority": "7"}) == ({}, None)  # vLLM's is an integer
    assert trusting.engine_priority("batch", {"priority": True}) == ({}, None)
    assert _classifier(classes=classes, default="standard").engine_priority("batch", {"priority": 7}) == ({}, None)
    # no classes: no class priority; the client's integer where trusted, else none
    assert _classifier().engine_priority(None, {"priority": -2}) == ({}, None)
    assert _classifier(trust_client_engine_priority=True).engine_priority(None, {"priority": -2}) == ({}, -2)


def test_a_leg_carries_the_engine_priority_to_a_priority_worker_only() -> None:
    out = Outgoing(path="/v1/completions", body={"model": "m"}, headers={}, request_id="r", stream=False, engine_priority=2)
    upstream: Any = None
    fcfs, by_priority = Target("a", upstream, "h"), Target("b", upstream, "h", priority_scheduling=True)
    assert leg_body(fcfs, out, out.body) is out.body
    assert leg_body(by_priority, out, out.body) == {"model": "m", "priority": 2}
    assert out.body == {"model": "m"}
    none = Outgoing(path="/v1/completions", body={"model": "m"}, headers={}, request_id="r", stream=False)
    assert leg_body(by_priority, none, none.body) is none.body
