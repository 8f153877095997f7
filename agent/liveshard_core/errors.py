"""liveshard's error hierarchy: permanent errors and retryable ones, as kopf separates them.

A `PermanentError` means the same request cannot succeed as given (bad input, members that
disagree, a request out of order): fix the input, do not retry. A `RetryableError` may succeed
when tried again after `delay` seconds (a peer failed, a deadline passed). The agent's server maps
each class to one gRPC status code in one table; the operator retries only retryable ones.
"""

from __future__ import annotations


class LiveshardError(Exception):
    """Base of every error liveshard raises on purpose."""


class PermanentError(LiveshardError):
    """The request cannot succeed as given; retrying it unchanged is pointless."""


class RetryableError(LiveshardError):
    """The request may succeed when tried again, no sooner than `delay` seconds from now."""

    def __init__(self, message: str, delay: float = 0.0) -> None:
        super().__init__(message)
        self.delay = delay


class InvalidInput(PermanentError, ValueError):
    """Input that names something impossible: the message names the field, the value and what
    would be valid. A ValueError too, so callers that validate with ValueError keep working."""


class NoSurvivingCopy(InvalidInput):
    """Some state was held only by lost members: no plan can rebuild it from memory, only a
    checkpoint can."""
