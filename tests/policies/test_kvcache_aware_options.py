"""kvcache_aware's options: the flat keys users write, checked into one typed dataclass at start-up.

A key the policy does not have and a value of the wrong type or range are ConfigErrors naming the
key, whether the policy is built directly or through the registry (as the gateway loads it); every
option in docs/kvcache_aware.md round-trips into the dataclass, with the default and the range the
document states; what users could write before (whole numbers for fractions, null, the pull link
names, YAML from a command-line spec) is still accepted."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from conductor.core.errors import ConfigError, PluginError
from policies.admission import AdmissionMode
from policies.kvcache_aware import OPTION_KEYS, KvCacheAwareOptions, KvCacheAwarePolicy, PlacementOptions
from policies.registry import load_policy
from predictors import OnlineConfig, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, snapshot

DOC = Path(__file__).resolve().parents[2] / "docs" / "kvcache_aware.md"
ROW = re.compile(r"^\| `(\w+)` \| `(\w+)\.(\w+)` \| `([^`]*)` \| (.+) \|$")

# a valid value other than the default, for every option: a new option must be given one here
OTHER_VALUES: dict[str, object] = {
    "allow_pull": "peer",
    "inflight_prefixes": False,
    "max_inflight_keys": 1000,
    "ttft_slack": 0.5,
    "listed_candidates": None,
    "admission": "early",
    "ttft_quantile": None,
    "tbt_quantile": 0.8,
    "ttft_bound_shift_s": 0.5,
    "probe_after": None,
    "forecast_joins": True,
    "mixed_tbt_quantile": 0.9,
    "mixed_ttft_slack": None,
    "mixed_protect_streams": False,
    "mixed_pace_floor": True,
    "local_prefill_tokens": 2048,
    "local_prefill_duty": 0.25,
    "local_prefill_gain": 1.0,
    "predictor_params": "params.json",
    "online": False,
    "window": 64,
    "refit_every": 8,
    "mixed_refit_every": 4,
    "mixed_recent": 0,
    "refit_queue_fraction": 0.0,
    "max_pending": 10,
    "track_errors": False,
    "session_affinity": False,
    "session_decode_slack": 0.0,
    "max_sessions": 10,
}


def documented() -> dict[str, tuple[str, str, object, str]]:
    """key -> (group, field, default, allowed), from the table in docs/kvcache_aware.md."""
    rows = (ROW.match(line) for line in DOC.read_text().splitlines())
    return {m[1]: (m[2], m[3], yaml.safe_load(m[4]), m[5]) for m in rows if m}


def test_an_unknown_key_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"no option 'ttft_slak' \(did you mean 'ttft_slack'\?\)") as caught:
        KvCacheAwarePolicy(ttft_slak=0.5)
    assert caught.value.param == "ttft_slak" and "listed_candidates" in str(caught.value)  # the real ones are listed
    with pytest.raises(ConfigError, match="no option 'fit_predictors'"):
        KvCacheAwareOptions.from_mapping({"fit_predictors": True})  # the simulator's own: it takes it out first
    # as the gateway loads it: the registry's PluginError is a ConfigError, and names the key as plainly
    with pytest.raises(PluginError, match=r"failed to construct: kvcache_aware has no option 'windows'"):
        load_policy("kvcache_aware", {"windows": 64})


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("window", "512"),  # a string where a count goes (an unquoted number is an int in YAML)
        ("window", 0),
        ("window", True),
        ("refit_every", 2.5),
        ("probe_after", -1),
        ("listed_candidates", 0),
        ("ttft_slack", "0.5"),
        ("ttft_slack", 1.5),
        ("ttft_slack", 0),
        ("mixed_ttft_slack", math.nan),
        ("ttft_quantile", 1.2),
        ("tbt_quantile", True),
        ("ttft_bound_shift_s", -0.1),
        ("ttft_bound_shift_s", math.inf),
        ("local_prefill_duty", 1.0),
        ("local_prefill_gain", 0.0),
        ("local_prefill_tokens", -1),
        ("online", "yes"),  # YAML's yes is already true: a quoted one is a mistake
        ("inflight_prefixes", 1),
        ("admission", "sometimes"),
        ("admission", None),
        ("allow_pull", "rdma"),
        ("allow_pull", 1),
        ("predictor_params", 3),
        ("session_decode_slack", -0.1),
        ("max_sessions", 0),
        ("session_affinity", "on"),
    ],
)
def test_a_wrongly_typed_value_is_a_config_error_naming_the_key(key: str, bad: object) -> None:
    allowed = documented()[key][3]
    with pytest.raises(ConfigError, match=f"option '{key}' must be") as caught:
        KvCacheAwarePolicy(**{key: bad})
    assert caught.value.param == key and allowed in str(caught.value) and repr(bad) in str(caught.value)
    with pytest.raises(PluginError, match=f"option '{key}' must be"):
        load_policy("kvcache_aware", {key: bad})


def test_every_documented_option_round_trips_into_the_dataclass() -> None:
    doc = documented()
    assert set(doc) == set(OPTION_KEYS) == set(OTHER_VALUES)
    defaults = KvCacheAwareOptions()
    assert defaults.flat() == {key: default for key, (_, _, default, _) in doc.items()}
    for key, (group, name, _, allowed) in doc.items():
        assert OPTION_KEYS[key] == (group, name)
        check = next(f for f in fields(KvCacheAwareOptions.GROUPS[group]) if f.name == name).metadata["check"]  # type: ignore[arg-type]
        assert check.allowed == allowed, key
        value = OTHER_VALUES[key]
        options = KvCacheAwareOptions.from_mapping({key: value})
        assert getattr(getattr(options, group), name) == value
        assert options.flat() == {**defaults.flat(), key: value}  # that key changed, every other at its default
        assert KvCacheAwareOptions.from_mapping(options.flat()) == options
    everything = KvCacheAwareOptions.from_mapping(OTHER_VALUES)
    assert everything.flat() == OTHER_VALUES


def test_the_policy_runs_on_what_the_options_say() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(enabled=False))
    flat = KvCacheAwarePolicy(predictors=pred, admission="early", allow_pull="store", probe_after=3, local_prefill_tokens=512)
    typed = KvCacheAwarePolicy(flat.options, predictors=pred)
    assert typed.options == flat.options and typed.admission is AdmissionMode.EARLY
    assert flat.pull_links == frozenset({"store"}) and flat.local is not None and flat.local.max_tokens == 512
    cluster = snapshot(prefill("p0", queued=3), prefill("p1"), decode("d0"))
    assert typed.decide(request(), cluster) == flat.decide(request(), cluster)
    with pytest.raises(ConfigError, match="not both"):
        KvCacheAwarePolicy(flat.options, window=64)
    with pytest.raises(ConfigError, match="'predictors' takes a built Predictors"):
        KvCacheAwarePolicy(predictors="bundled")  # type: ignore[arg-type]


def test_a_group_built_directly_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="option 'ttft_slack' must be"):
        PlacementOptions(ttft_slack=2.0)
    assert PlacementOptions(ttft_slack=1).ttft_slack == 1.0  # a whole number is a number


def test_what_users_wrote_before_is_still_accepted(tmp_path: Path) -> None:
    options = KvCacheAwareOptions.from_mapping(
        {"ttft_slack": 1, "mixed_ttft_slack": 1, "refit_queue_fraction": 0, "probe_after": 100.0, "admission": AdmissionMode.NONE}
    )
    assert (options.placement.ttft_slack, options.mixed.ttft_slack, options.learning.refit_queue_fraction) == (1.0, 1.0, 0.0)
    assert options.admission.probe_after == 100 and isinstance(options.admission.probe_after, int)
    for allow in (True, False, "both", "peer", "store", "none"):
        assert KvCacheAwareOptions.from_mapping({"allow_pull": allow}).prefixes.allow_pull == allow
    # a YAML `policy_options:` and a command-line spec's values, read as the gateway and `replay` read them
    from_yaml = yaml.safe_load("{ttft_slack: null, inflight_prefixes: false, admission: none, window: 64, allow_pull: peer}")
    policy = load_policy("kvcache_aware", from_yaml)
    assert isinstance(policy, KvCacheAwarePolicy) and policy.inflight is None and policy.options.placement.ttft_slack is None
    path = tmp_path / "params.json"
    fit_profiles([bundled_profile()]).save(path)
    assert isinstance(KvCacheAwarePolicy(predictor_params=path).predictors, Predictors)  # a path object, as a string
    with pytest.raises(ConfigError, match=r"option 'predictor_params': cannot load predictor params .*missing\.json"):
        KvCacheAwarePolicy(predictor_params=str(tmp_path / "missing.json"))
