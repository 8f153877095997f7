"""The wait between two passes of a job's loop. While a reconfiguration is in flight, the next
pass has something to do only when a member's verdict changes (`inflight.verdict`: it switched,
gave its account, gave up, broke), and the members act on one decision: so the wait follows one
member's status (`inflight.watched_member`) over its agent's `WatchStatus` stream and ends when
that member's verdict differs from the one the pass saw, or its agent, having answered, stops
answering. The commit or abort is then seen within moments, not a pass period later, at the cost
of one stream, where a shorter period would list every pod and ask every agent several times a
second.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc

from .agents import AgentClient
from .inflight import Verdict, verdict, watched_member
from .observation import Observation
from .world import InFlight

log = logging.getLogger(__name__)

_QUIET = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True)
class Follow:
    """The member a wait follows: its agent's client, the epoch in flight, and its verdict in
    it as the last pass saw it."""

    client: AgentClient
    epoch: int
    seen: Verdict


def follow(plan: InFlight, seen: Observation, clients: dict[str, AgentClient]) -> Follow | None:
    """Whom the wait after a pass that left `plan` in flight follows: the member
    `inflight.watched_member` names, when the pass has a client of its agent."""
    watched = watched_member(plan, seen)
    if watched is None or watched[0] not in clients:
        return None
    member, verdict_seen = watched
    return Follow(clients[member], plan.epoch, verdict_seen)


def wait(wake: threading.Event, seconds: float, follow: Follow | None) -> None:
    """Until `wake` is set or `seconds` passed; with `follow`, also until the member's verdict
    differs from the one the pass saw (at once if it did by the time the stream starts), or its
    agent breaks the stream after its first answer (one that never answers, or predates the
    stream, changes nothing: the period ends the wait)."""
    if follow is None or wake.is_set():
        wake.wait(seconds)
        return
    client = follow.client
    stream = client.watch(seconds)

    def read() -> None:
        answered = False
        try:
            for status in stream:
                answered = True
                if verdict(status, follow.epoch) != follow.seen:
                    wake.set()
                    return
        except grpc.RpcError as err:
            if answered and err.code() not in _QUIET:
                log.info("watching %s: %s", client.member, err.code().name)
                wake.set()

    reader = threading.Thread(target=read, name=f"watch {client.member}", daemon=True)
    reader.start()
    wake.wait(seconds)
    stream.cancel()
    reader.join()
