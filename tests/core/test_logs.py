"""The log formats the agent and the operator share: a JSON line per record, with its context."""

from __future__ import annotations

import io
import json
import logging

import pytest

from liveshard_core.logs import JsonFormatter, configure


def test_a_record_is_one_json_object_with_its_context() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("liveshard.test.logs")
    logger.addHandler(handler)
    try:
        logger.warning("step %s", 7, extra={"job": "tiny", "epoch": 2, "member": "tiny-x"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert {k: first[k] for k in ("level", "logger", "message", "job", "epoch", "member")} == {
        "level": "WARNING", "logger": "liveshard.test.logs", "message": "step 7", "job": "tiny",
        "epoch": 2, "member": "tiny-x",
    }  # fmt: skip
    assert first["time"].endswith("+00:00") and "exception" not in first
    assert "job" not in second and "RuntimeError: boom" in second["exception"]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="'xml' must be one of text, json"):
        configure("INFO", "xml")
