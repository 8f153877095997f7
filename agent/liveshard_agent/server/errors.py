"""The one table from liveshard's errors to gRPC status codes, and the server's own refusals.

- `InvalidInput` (a field that names something impossible) -> INVALID_ARGUMENT;
- `Overtaken` (an abort of an epoch already in effect: its commit came first) -> ABORTED;
- any other `PermanentError` (a request the agent cannot take in its state: `Refused`, a plan
  mismatch, a reused epoch, a call out of order) -> FAILED_PRECONDITION;
- `RetryableError` (`NotNow`, a failed transfer, a prepare past its deadline) -> UNAVAILABLE;
- anything else -> INTERNAL, with the exception's type and message (a bug, never a crash).

The operator retries only UNAVAILABLE (and its own DEADLINE_EXCEEDED). This module must not
decide what is valid; it only says how a decision is reported.
"""

from __future__ import annotations

import grpc

from liveshard_core.errors import InvalidInput, PermanentError, RetryableError


class Refused(PermanentError):
    """A well-formed request the agent cannot take in its state (FAILED_PRECONDITION)."""


class Overtaken(Refused):
    """An abort of an epoch that is already in effect here: its commit came first (ABORTED)."""


class NotNow(RetryableError):
    """A request the agent cannot take yet, but may soon (UNAVAILABLE)."""


_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (Overtaken, grpc.StatusCode.ABORTED),
    (PermanentError, grpc.StatusCode.FAILED_PRECONDITION),
    (RetryableError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call that raised `error` ends with."""
    for kind, code in _TABLE:
        if isinstance(error, kind):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
