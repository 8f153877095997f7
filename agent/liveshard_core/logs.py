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


def configure(level: str | int, form: str = "text") -> None:
    """Log to stderr at `level` in `form` (one of FORMATS)."""
    if form not in FORMATS:
        raise ValueError(f"log format {form!r} must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
