"""Bounded waits: poll a condition until it holds or a deadline passes, then fail with a message
that says what was awaited and what was last seen."""

from __future__ import annotations

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
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except Exception as err:
            last_error = err
        if time.monotonic() >= deadline:
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
