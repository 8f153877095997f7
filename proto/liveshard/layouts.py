"""The core's `Layout` as the agent API's `Layout` message, for the operator's requests and the
agent's statuses alike (the agent reads a message back with its checks: `server/requests.py`)."""

from __future__ import annotations

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.layout.layout import Layout


def to_message(layout: Layout) -> pb.Layout:
    return pb.Layout(
        dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep, zero=layout.zero,
        pp_layers=list(layout.pp_layers), members=list(layout.members), mirror=layout.mirror,
    )  # fmt: skip
