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
import time
from typing import Any

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


def configure_logging(level: str, log_format: str, access_log: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # the access log is its own switch: at INFO when on, silent when off, whatever the level
    ACCESS_LOG.setLevel(logging.INFO if access_log else logging.CRITICAL + 1)


def log_access(**fields: Any) -> None:
    """One access-log line (only when the access log is on: the check costs one comparison)."""
    if ACCESS_LOG.isEnabledFor(logging.INFO):
        ACCESS_LOG.info(
            "%s %s %s %.1fms",
            fields.get("method", "POST"),
            fields.get("path"),
            fields.get("status"),
            fields.get("duration_ms", 0.0),
            extra=fields,
        )
