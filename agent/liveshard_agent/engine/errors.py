"""The engine's errors and the causes a switch can fail with.

Every failed switch carries a `Cause`, so the runtime, the server and the operator branch on
structure; the message next to it is for people.
"""

from __future__ import annotations

from enum import Enum

from liveshard_core.errors import PermanentError, RetryableError


class Cause(Enum):
    """Why a switch aborted."""

    PEER_FAILED = "peer_failed"  # a transfer with a member failed (it died or closed)
    DEADLINE_PASSED = "deadline_passed"  # the switch deadline passed waiting for a member
    VOTE_NO = "vote_no"  # a member voted no (a failure of its own, or a hook's)
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the state after the transfer differs
    VOTE_INCOMPLETE = "vote_incomplete"  # the vote itself failed or timed out
    PLAN_MISMATCH = "plan_mismatch"  # members computed different plans (found in prepare)
    NO_COMMON_STATE = "no_common_state"  # a broken world's survivors stopped in different states
    NO_SURVIVING_COPY = "no_surviving_copy"  # some state was held only by lost members


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
