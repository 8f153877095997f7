"""The agent API's messages (proto/liveshard/v1/agent.proto) turned into the operator's values: a
switch's result and abort cause as the core's enums (a layout's message: `liveshard.layouts`).

Pure conversions: no channel, no grpc, so the decisions that read agents' statuses can use them.
The rest of the operator branches on `Result` and `Cause`, never on the proto's names.
"""

from __future__ import annotations

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.job import Cause, Result


def result_of(summary: pb.SwitchSummary) -> Result | None:
    """A switch summary's result; None when the agent reported none."""
    if summary.result == pb.SwitchSummary.RESULT_UNSPECIFIED:
        return None
    return Result[pb.SwitchSummary.Result.Name(summary.result)]


def cause_of(summary: pb.SwitchSummary) -> Cause | None:
    """A switch summary's abort cause; None for a commit."""
    if summary.cause == pb.SwitchSummary.CAUSE_UNSPECIFIED:
        return None
    return Cause[pb.SwitchSummary.Cause.Name(summary.cause)]
