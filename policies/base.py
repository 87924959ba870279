"""Helpers shared by the built-in policies."""

from __future__ import annotations

from policies.types import Decision, Observation, Rejection, RequestView, Role

NO_INSTANCE = "no_instance"


class BasePolicy:
    """Policies without fitted state need not observe anything."""

    name = "base"

    def observe(self, observation: Observation) -> None:  # noqa: B027 - deliberately empty
        return None


def no_instance(request: RequestView, policy: str, role: Role) -> Decision:
    """A decision that says no healthy instance of `role` can take the request (HTTP 503)."""
    return Decision(
        request_id=request.request_id,
        policy=policy,
        rejection=Rejection(reason=NO_INSTANCE, message=f"no healthy {role.value} instance", retry_after_s=5.0),
    )
