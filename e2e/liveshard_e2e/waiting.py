"""Bounded waits: poll a condition until it holds or a deadline passes, then fail with a message
that says what was awaited and what was last seen. With ``LIVESHARD_E2E_TRACE`` set to a file,
each wait appends a line to it (when it ended, the test, how long it took, what it awaited), to
find which wait makes a test slow in a run that shows only the tests' durations."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.25,
    describe: Callable[[], str] | None = None,
) -> T:
    """Calls ``check`` until it returns a truthy value (returned) or ``timeout`` seconds pass
    (:class:`TimeoutError` naming ``what`` and, if given, ``describe()`` of the last state).
    Exceptions from ``check`` count as "not yet" and the last one is reported."""
    began = time.monotonic()
    deadline = began + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                _trace(began, what)
                return value
        except Exception as err:
            last_error = err
        if time.monotonic() >= deadline:
            _trace(began, f"{what} (timed out)")
            detail = ""
            if describe is not None:
                try:
                    detail = f"; last state: {describe()}"
                except Exception as err:
                    detail = f"; describing the state failed: {err}"
            if last_error is not None:
                detail += f"; last error: {last_error!r}"
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


def _trace(began: float, what: str) -> None:
    path = os.environ.get("LIVESHARD_E2E_TRACE")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    with open(path, "a") as out:  # one short write: lines of concurrent workers stay whole
        out.write(f"{time.strftime('%H:%M:%S')} {test} {time.monotonic() - began:.1f} s {what}\n")
