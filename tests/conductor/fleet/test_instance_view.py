"""An instance as a policy sees it when other replicas share its queue: the FCFS head has run at
most since the last prefill there ended, whoever's it was (a replica publishes its head as running
since its own dispatch, unaware it waited behind another replica's prefill)."""

from __future__ import annotations

from typing import cast

import pytest

from adapters.pd.base import Target
from conductor.config.settings import InstanceSpec
from conductor.core.types import QueuedPrefill, Role
from conductor.fleet.health import InstanceHealth
from conductor.fleet.instances import InstanceState


def state() -> InstanceState:
    spec = InstanceSpec(url="http://127.0.0.1:9", role=Role.PREFILL, name="p0")
    return InstanceState(spec=spec, target=cast(Target, None), health=InstanceHealth("p0"))


def test_a_remote_head_runs_at_most_since_the_last_end_seen() -> None:
    s = state()
    # another replica's prefill, dispatched 0.6 s ago; one of a third replica's ended 0.3 s ago
    remote = ((QueuedPrefill(1000, 0, 0.6), QueuedPrefill(800, 0, 0.5)), ())
    view = s.view(now=10.0, remote=remote, remote_end=9.7)
    assert view.prefill_queue[0].elapsed_s == pytest.approx(0.3)
    assert view.prefill_queue[1].elapsed_s == pytest.approx(0.5)  # not the head: untouched
    # no end seen since its dispatch: it has run since then
    assert s.view(now=10.0, remote=remote, remote_end=9.0).prefill_queue[0].elapsed_s == pytest.approx(0.6)
    assert s.view(now=10.0, remote=remote).prefill_queue[0].elapsed_s == pytest.approx(0.6)


def test_a_local_end_bounds_a_remote_head_too() -> None:
    s = state()
    s.last_prefill_end = 9.9  # this gateway's own prefill there ended 0.1 s ago
    remote = ((QueuedPrefill(1000, 0, 0.6),), ())
    assert s.view(now=10.0, remote=remote, remote_end=9.5).prefill_queue[0].elapsed_s == pytest.approx(0.1)
