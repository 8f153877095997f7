"""The harness's bounded waits (no cluster needed): the value awaited, a timeout naming what was
awaited and what was last seen, and the trace a run asks for with LIVESHARD_E2E_TRACE."""

from __future__ import annotations

from pathlib import Path

import pytest

from liveshard_e2e.waiting import wait_until


def test_a_wait_returns_the_value_fails_naming_what_and_traces_each_wait_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "waits.log"
    monkeypatch.setenv("LIVESHARD_E2E_TRACE", str(trace))
    answers = iter([None, 0, "ready"])
    assert wait_until(lambda: next(answers), 5, "the thing", interval=0.01) == "ready"
    with pytest.raises(TimeoutError, match="waiting for never; last state: still not"):
        wait_until(lambda: None, 0.05, "never", interval=0.01, describe=lambda: "still not")
    first, second = trace.read_text().splitlines()
    assert "test_waiting.py::test_a_wait_returns" in first and first.endswith(" s the thing")
    assert second.endswith(" s never (timed out)")
    monkeypatch.delenv("LIVESHARD_E2E_TRACE")
    wait_until(lambda: True, 1, "untraced")
    assert len(trace.read_text().splitlines()) == 2
