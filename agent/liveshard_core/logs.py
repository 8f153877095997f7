"""How the agent and the operator log: `text` lines for people, or `json`, one object per line for
log collectors (Loki, Elasticsearch, Cloud Logging), carrying the job, epoch and member that
context loggers attach to a record as fields of their own.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CONTEXT = ("job", "epoch", "member")  # record attributes a context logger sets


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time (UTC, ISO 8601), level, logger, message, the job, epoch
    and member where the record has them, and the traceback of an exception."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: getattr(record, k) for k in _CONTEXT if hasattr(record, k)})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure` installs (and replaces when called again)."""


def configure(level: str | int, form: str = "text") -> None:
    """Log to stderr at `level` in `form` (one of FORMATS), in place of what an earlier call
    installed; other handlers (a test's capture) stay."""
    if form not in FORMATS:
        raise ValueError(f"log format {form!r} must be one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(old)
    handler = _Stderr(sys.stderr)
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(TEXT))
    root.addHandler(handler)
    root.setLevel(level)
