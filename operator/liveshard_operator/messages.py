"""The agent API's messages (proto/liveshard/v1/agent.proto) turned into the operator's values and
back: a switch's result and abort cause as the core's enums, a layout as its message.

Pure conversions: no channel, no grpc, so the decisions that read agents' statuses can use them.
The rest of the operator branches on `Result` and `Cause`, never on the proto's names.
"""

from __future__ import annotations

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.job import Cause, Result
from liveshard_core.layout.layout import Layout


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


def to_proto(layout: Layout) -> pb.Layout:
    return pb.Layout(
        dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep, zero=layout.zero,
        pp_layers=list(layout.pp_layers), members=list(layout.members), mirror=layout.mirror,
    )  # fmt: skip
