"""A plugin whose class forgot `decide`."""

from __future__ import annotations


class NoDecidePolicy:
    name = "demo_nodecide"

    def observe(self, observation: object) -> None:
        return None
