"""The `priority:` section (conductor/config/priority.py) and `auth.tenants` (conductor/config/groups.py):
their YAML and environment forms, every bad one a start-up error that names it, tenants' keys, and
the configuration docs/deploy.md shows ("Tenants and priorities")."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conductor.config.settings import load_settings
from conductor.core.errors import ConfigError
from conductor.gateway import Gateway

CLASSES = {"interactive": {"slo": {"ttft_s": 1.0}}, "batch": {"rank": 2, "sheddable": True}}


def _load(**given: Any) -> Any:
    return load_settings(environ={}, overrides={"mixed": ["http://m:1"], **given})


def test_classes_and_tenants_from_yaml_and_the_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "priority:\n"
        "  classes: {interactive: {slo: {ttft_s: 1.0}}, batch: {rank: 2, sheddable: true, share: 0.25}}\n"
        "  default: interactive\n"
        "  header: X-Class\n"
        "auth: {tenants: {team-a: {api_keys: [sk-a], weight: 2, priority: batch}}}\n"
    )
    s = load_settings(cfg, environ={})
    p = s.priority
    assert p.enabled and p.header == "x-class" and p.names() == ["interactive", "batch"]
    assert p.shares() == {"batch": 0.25} and p.classes["interactive"].slo.ttft_s == 1.0  # type: ignore[union-attr]
    assert s.auth.tenants["team-a"].weight == 2 and s.auth.key_owners() == {"sk-a": "team-a"}
    assert s.auth.client_keys() == {"sk-a"}  # a tenant's key is a client key
    # the environment merges into the file's sections
    env = {
        "CONDUCTOR_PRIORITY__SHEDDABLE_SHARE": "0.75",
        "CONDUCTOR_AUTH__TENANTS": json.dumps({"team-b": {"api_keys": ["sk-b"]}}),
        "CONDUCTOR_AUTH__API_KEYS": "sk-plain",
    }
    s = load_settings(cfg, environ=env)
    assert s.priority.sheddable_share == 0.75 and s.priority.default == "interactive"
    assert s.auth.key_owners() == {"sk-a": "team-a", "sk-b": "team-b"}
    assert s.auth.client_keys() == {"sk-a", "sk-b", "sk-plain"}
    assert "sk-b" not in repr(s)  # keys are secrets, tenants' too


def test_without_the_sections_nothing_is_configured() -> None:
    s = _load()
    assert not s.priority.enabled and s.priority.shares() == {} and s.auth.tenants == {}
    assert s.auth.key_owners() == {}


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"priority": {"classes": CLASSES}}, ["priority.default", "name the class"]),
        ({"priority": {"classes": CLASSES, "default": "gold"}}, ["priority.default", "'gold'", "['interactive', 'batch']"]),
        ({"priority": {"default": "batch"}}, ["priority.default 'batch'", "lists none"]),
        (
            {
                "priority": {"classes": CLASSES, "default": "batch"},
                "auth": {"tenants": {"t": {"api_keys": ["k"], "priority": "x"}}},
            },
            ["auth.tenants.t.priority", "'x'", "interactive"],
        ),
        ({"auth": {"tenants": {"t": {"api_keys": ["k"], "priority": "batch"}}}}, ["auth.tenants.t.priority", "empty"]),
        (
            {"priority": {"classes": {"a": {"rank": 1}, "b": {"rank": 1, "sheddable": True}}, "default": "a"}},
            ["priority.classes.b", "sheddable", "'a'"],
        ),
        (
            {
                "priority": {
                    "classes": {"a": {}, "b": {"rank": 1, "sheddable": True, "share": 0.2}, "c": {"rank": 2, "sheddable": True}},
                    "default": "a",
                }
            },
            ["priority.classes.c", "0.5", "'b'", "shed last"],
        ),
        ({"priority": {"classes": {"two words": {}}, "default": "two words"}}, ["priority.classes.two words", "pattern"]),
        ({"priority": {"header": "x priority"}}, ["priority.header", "plain header"]),
        ({"priority": {"sheddable_share": 0}}, ["priority.sheddable_share", "greater than 0"]),
        ({"priority": {"classes": {"a": {"share": 1.5}}, "default": "a"}}, ["priority.classes.a.share"]),
        ({"priority": {"classes": {"a": {"urgent": True}}, "default": "a"}}, ["priority.classes.a.urgent", "not permitted"]),
        ({"auth": {"tenants": {"t": {"api_keys": ["k"], "weight": 0}}}}, ["auth.tenants.t.weight", "greater than 0"]),
        ({"auth": {"tenants": {"bad name": {"api_keys": ["k"]}}}}, ["auth.tenants.bad name", "pattern"]),
    ],
)
def test_a_bad_setting_is_a_start_up_error_naming_it(given: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _load(**given)
    for word in words:
        assert word in err.value.message, err.value.message


def test_tenants_keys_are_checked_when_the_gateway_starts(tmp_path: Path) -> None:
    shared = tmp_path / "keys"
    shared.write_text("# team keys\nsk-1\n")
    tenants = {"a": {"api_keys": ["sk-1"]}, "b": {"api_keys_file": str(shared)}}
    with pytest.raises(ConfigError, match="a key of 'b' is also a key of 'a'"):
        Gateway(_load(auth={"tenants": tenants}))
    (tmp_path / "empty").write_text("# none yet\n")
    with pytest.raises(ConfigError, match=r"auth.tenants.b: no keys"):
        _load(auth={"tenants": {"b": {"api_keys_file": str(tmp_path / "empty")}}}).auth.client_keys()
    with pytest.raises(ConfigError, match="cannot read secret file"):
        _load(auth={"tenants": {"b": {"api_keys_file": str(tmp_path / "missing")}}}).auth.key_owners()
    # a key in api_keys and a tenant's is the tenant's
    s = _load(auth={"api_keys": ["sk-1"], "tenants": {"a": {"api_keys": ["sk-1"]}}})
    assert Gateway(s).client_keys.check("Bearer sk-1") == "a"


def _yaml_block(doc: str, marker: str) -> str:
    text = (Path(__file__).resolve().parents[3] / doc).read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```yaml\n")[1:]]
    (block,) = [textwrap.dedent(b) for b in blocks if marker in b]
    return block


def test_the_documented_two_tenant_two_class_configuration_is_valid(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(_yaml_block("docs/deploy.md", "tenants:") + "mixed: [http://m:1]\n")
    s = load_settings(cfg, environ={})
    assert s.priority.names() == ["interactive", "batch"] and s.priority.default == "interactive"
    assert s.priority.shares() == {"batch": 0.5}
    tenants = s.auth.tenants
    assert set(tenants) == {"team-a", "team-b"}
    assert (tenants["team-a"].weight, tenants["team-a"].priority) == (2, None)
    assert (tenants["team-b"].weight, tenants["team-b"].priority) == (1, "batch")
    assert s.limits.max_inflight_requests == 512
