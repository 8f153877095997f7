"""How a reconfiguration ends: its `Result`, and for an abort its `Cause`.

The names are the proto's (`liveshard.v1.SwitchSummary.Result` and `.Cause`, mapped by name at
the API's two ends; a test keeps them equal). Whether retrying the same reconfiguration can
succeed is a property of the cause (`Cause.permanent`), so no caller keeps its own list.
"""

from __future__ import annotations

from enum import Enum


class Result(Enum):
    COMMITTED = "committed"
    ABORTED = "aborted"


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

    @property
    def permanent(self) -> bool:
        """Whether the same recovery would abort again: the state it needs is gone from memory,
        and only a checkpoint can restore the job."""
        return self in (Cause.NO_COMMON_STATE, Cause.NO_SURVIVING_COPY)
