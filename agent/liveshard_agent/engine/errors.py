"""The engine's errors and the causes a switch can fail with.

Every failed switch carries a `Cause`, so the runtime, the server and the operator branch on
structure; the message next to it is for people.
"""

from __future__ import annotations

from liveshard_core.errors import PermanentError, RetryableError
from liveshard_core.job import Cause

__all__ = [
    "Cause",
    "DecisionUnknown",
    "EpochReused",
    "ForgedValue",
    "PhaseError",
    "PlanMismatch",
    "PrepareTimeout",
    "TransferError",
]


class TransferError(RetryableError):
    """A transfer operation failed or missed the deadline; `cause` says which."""

    def __init__(self, message: str, cause: Cause) -> None:
        super().__init__(message)
        self.cause = cause


class PlanMismatch(PermanentError):
    """Members computed different plans: they disagree about the model, layouts or members."""

    cause = Cause.PLAN_MISMATCH


class EpochReused(PermanentError):
    """An epoch number was used a second time on the same store; each names one transaction."""


class PhaseError(PermanentError):
    """A reconfiguration was asked to do something its phase does not allow."""


class PrepareTimeout(RetryableError):
    """Prepare did not finish within its deadline."""

    cause = Cause.DEADLINE_PASSED


class ForgedValue(RetryableError):
    """A value in the job's store does not carry the job's seal (`sealed`): a process without
    the job's credential wrote or changed it. It is refused and never acted on; the change it
    belongs to is given up, and another epoch (other keys) may succeed."""

    cause = Cause.VOTE_INCOMPLETE

    def __init__(self, key: str, why: str) -> None:
        super().__init__(
            f"the value at {key!r} in the job's store {why}: no member of this job wrote it "
            "as it is, and it is refused"
        )
        self.key = key


class DecisionUnknown(RetryableError):
    """A switch's decision could not be recorded or read here: the store that holds it failed
    (its host died), or the value there does not carry the job's seal. Whether the epoch
    committed is known only to the members that read it."""

    cause = Cause.VOTE_INCOMPLETE
