"""The one error hierarchy. Every failure a client can see is a ConductorError subclass; the
gateway turns them into OpenAI-style bodies in exactly one place (`conductor.server.errors`)."""

from __future__ import annotations


class ConductorError(Exception):
    """Base of every error Conductor raises on purpose."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class ConfigError(ConductorError):
    """Bad configuration; raised at start-up, never per request."""

    type = "config_error"


class PluginError(ConfigError):
    """A configured plugin could not be loaded or does not satisfy its protocol."""


class BadRequest(ConductorError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ConductorError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ConductorError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(ConductorError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Rejected(ConductorError):
    """Admission control (HTTP 429): the request is predicted to miss its SLO, or its priority class is
    shed, or its tenant is over its fair share; `reason` says which, as the body's `code` and the
    `x-conductor-reject-reason` header."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, reason: str, retry_after_s: float, retryable: bool = True) -> None:
        super().__init__(message, code=reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        # False when sending the same request again cannot be admitted (it alone misses the SLO)
        self.retryable = retryable

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after_s))), "x-conductor-reject-reason": self.reason}


class NoHealthyInstance(ConductorError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_instance"


class Overloaded(ConductorError):
    """The gateway already holds as many requests as it is configured to (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    code = "overloaded"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1", "x-conductor-reject-reason": "overloaded"}


class ShuttingDown(ConductorError):
    """The gateway is shutting down and its drain grace (`timeouts.drain_grace_s`) ran out with the
    request still in flight (HTTP 503, or an SSE error event once the answer has begun). Sending
    it again is the cure: another replica, or this one restarted, takes it."""

    status = 503
    type = "service_unavailable"
    code = "gateway_shutdown"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class UpstreamError(ConductorError):
    """A worker failed: refused the connection, reset it, or answered with an error status."""

    status = 502
    type = "upstream_error"
    code = "bad_gateway"

    def __init__(
        self,
        message: str,
        *,
        upstream_status: int | None = None,
        instance: str | None = None,
        body: bytes | None = None,
        maybe_processed: bool = True,
    ) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status
        self.instance = instance
        self.body = body  # the worker's own error body, relayed when it is the client's fault (4xx)
        # False only when no byte of the request can have reached the worker (refused connection,
        # no free pooled connection): then, and only then, the request may go to another instance.
        self.maybe_processed = maybe_processed

    @property
    def client_fault(self) -> bool:
        """A worker's 4xx means the request itself is bad: the client gets that status and body."""
        return self.upstream_status is not None and 400 <= self.upstream_status < 500


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "upstream_timeout"
    code = "gateway_timeout"
