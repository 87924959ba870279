"""Logging set-up for `conductor serve`: plain lines or one JSON object per line, and the access
log (logger `conductor.access`, one line per request: status, times, instances, ids; never the
prompt).

JSON lines carry the standard fields (time, level, logger, message) plus whatever a call passed in
`extra=` (the access log passes its fields that way), so a log pipeline needs no parsing rules.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

import msgspec

from conductor.core.decision_log import decision_log_record
from conductor.core.types import Decision
from conductor.ops.log_writer import BatchingHandler, flush_before_sigterm

ACCESS_LOG = logging.getLogger("conductor.access")

# LogRecord attributes that are not a call's `extra=` fields
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class DecisionLine:
    """A decision's log line (conductor/core/decision_log.py), built and encoded when the line is
    formatted, on the log writer's thread (conductor/ops/log_writer.py), not in the request: the
    Decision is frozen, so the line is the same whenever it is written. Encoded by msgspec."""

    __slots__ = ("decision", "model", "priority", "prompt_tokens", "tenant")

    def __init__(
        self, decision: Decision, prompt_tokens: int | None, model: str | None, priority: str | None, tenant: str | None
    ) -> None:
        self.decision = decision
        self.prompt_tokens = prompt_tokens
        self.model = model
        self.priority = priority
        self.tenant = tenant

    def __str__(self) -> str:
        record = decision_log_record(self.decision, self.prompt_tokens, self.model, priority=self.priority, tenant=self.tenant)
        return msgspec.json.encode(record).decode()


def log_decision(
    logger: logging.Logger,
    decision: Decision,
    prompt_tokens: int | None,
    model: str | None,
    *,
    priority: str | None = None,
    tenant: str | None = None,
) -> None:
    """The decision's line on `logger` at INFO, where enabled. The record is made directly (no
    caller's file and line looked up: the logger's name says where it comes from), so a request
    spends about a microsecond here and the writer thread the rest."""
    if logger.isEnabledFor(logging.INFO):
        line = DecisionLine(decision, prompt_tokens, model, priority, tenant)
        logger.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, "%s", (line,), None))


def configure_logging(level: str, log_format: str, access_log: bool) -> None:
    # lines are formatted and written in batches by a writer thread: a request only appends its
    # records (the decision log at INFO is one per request by default)
    handler = BatchingHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # the access log is its own switch: at INFO when on, silent when off, whatever the level
    ACCESS_LOG.setLevel(logging.INFO if access_log else logging.CRITICAL + 1)
    # no format here shows a record's thread or multiprocessing name (the JSON lines leave out every
    # standard attribute): not looked up for each record
    logging.logThreads = False
    logging.logMultiprocessing = False
    if threading.current_thread() is threading.main_thread():
        flush_before_sigterm()


def access_log_on() -> bool:
    """Whether access-log lines are written: asked before a line's fields are gathered."""
    return ACCESS_LOG.isEnabledFor(logging.INFO)


def log_access(**fields: Any) -> None:
    """One access-log line, written when the access log is on (callers ask `access_log_on` first,
    so a request gathers no fields for a log that is off)."""
    ACCESS_LOG.info(
        "%s %s %s %.1fms",
        fields.get("method", "POST"),
        fields.get("path"),
        fields.get("status"),
        fields.get("duration_ms", 0.0),
        extra=fields,
    )
