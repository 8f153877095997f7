"""The wait between a job's passes while a reconfiguration is in flight (`sentinel`): it follows
one member's status over gRPC and ends as soon as that member's verdict changes (it switched, gave
its account, gave up, broke), or its agent breaks the stream; a step or a prepare's end, which no
pass acts on, leaves it to the period. The agent here is a gRPC server that streams the statuses
the test gives it; the real agents' `WatchStatus` is tested in tests/agent/server/test_api.py and
test_pod.py, the operator's loop waiting this way in every end-to-end test on the local cluster."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from liveshard_operator import sentinel
from liveshard_operator.agents import AgentClient
from liveshard_operator.inflight import verdict, watched_member
from liveshard_operator.world import InFlight

from liveshard.v1 import agent_pb2 as pb
from liveshard_agent.server import listen
from liveshard_e2e.procs import free_port
from tests.operator.values import NOW, job, pending, pod, seen, switched, training, world

TOKEN = "sentinel-token"
PERIOD = 20.0  # long enough that a wait ended by it is told apart from one ended by a verdict
BREAK = object()  # given to the stream: the agent ends it with UNAVAILABLE


class Streaming(grpc.GenericRpcHandler):
    """An agent whose `WatchStatus` streams what `given` receives (`BREAK`: the agent fails the
    stream); it knows no other call."""

    def __init__(self) -> None:
        self.given: queue.Queue[Any] = queue.Queue()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not details.method.endswith("/WatchStatus"):
            return None

        def watch(_: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            while context.is_active():
                try:
                    status = self.given.get(timeout=0.1)
                except queue.Empty:
                    continue
                if status is BREAK:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the agent went away")
                yield bytes(status.SerializeToString())

        return grpc.unary_stream_rpc_method_handler(watch)


@pytest.fixture
def agent() -> Iterator[tuple[Streaming, AgentClient]]:
    port = free_port()
    handler = Streaming()
    server = listen.serve(handler, TOKEN, f"127.0.0.1:{port}", None, 8, "sentinel")
    client = AgentClient("p2", "127.0.0.1", port, TOKEN)
    try:
        yield handler, client
    finally:
        client.close()
        server.stop(None)


def waited(
    agent: tuple[Streaming, AgentClient], seconds: float, seen: pb.AgentStatus, *statuses: Any
) -> bool:
    """Whether the wait of `seconds` following the agent's member in epoch 2, its status `seen`
    by the pass, ended by a verdict (the wake set): `seen` and then `statuses` are given to its
    stream a moment into the wait (once the last wait's stream, if any, has ended)."""
    handler, client = agent
    wake = threading.Event()

    def give() -> None:
        time.sleep(0.3)
        for status in (seen, *statuses):
            handler.given.put(status)

    giver = threading.Thread(target=give)
    giver.start()
    began = time.monotonic()
    sentinel.wait(wake, seconds, sentinel.Follow(client, 2, verdict(seen, 2)))
    giver.join()
    assert time.monotonic() - began < seconds or not wake.is_set()
    return wake.is_set()


def test_the_wait_ends_when_the_member_switches_and_when_it_gives_its_account(
    agent: tuple[Streaming, AgentClient],
) -> None:
    joining = pb.AgentStatus(phase=pb.AgentStatus.JOINING, ready=True, epoch=1,
                             pending=pending(2))  # fmt: skip
    assert waited(agent, PERIOD, joining, training(2, step=12))
    assert waited(agent, PERIOD, training(2, step=12), switched(2, step=12))


def test_the_wait_ends_when_the_member_gives_up_or_its_world_breaks(
    agent: tuple[Streaming, AgentClient],
) -> None:
    preparing = training(1, pending=pending(2, pb.Pending.PREPARING))
    assert waited(agent, PERIOD, preparing, training(1, pending=pending(2, pb.Pending.FAILED)))
    assert waited(agent, PERIOD, preparing, training(1, pending=pending(2, pb.Pending.UNDECIDED)))
    assert waited(agent, PERIOD, preparing, pb.AgentStatus(phase=pb.AgentStatus.BROKEN, epoch=1))


def test_steps_and_a_prepares_end_leave_the_wait_to_its_period(
    agent: tuple[Streaming, AgentClient],
) -> None:
    steps = [training(1, step=s, pending=pending(2, pb.Pending.PREPARED)) for s in range(3)]
    began = time.monotonic()
    assert not waited(agent, 1.5, training(1, pending=pending(2, pb.Pending.PREPARING)), *steps)
    assert time.monotonic() - began >= 1.5


def test_an_agent_that_breaks_its_stream_ends_the_wait_one_that_never_answers_does_not(
    agent: tuple[Streaming, AgentClient],
) -> None:
    assert waited(agent, PERIOD, training(1), BREAK)
    nobody = AgentClient("p3", "127.0.0.1", free_port(), TOKEN)
    wake = threading.Event()
    sentinel.wait(wake, 1.0, sentinel.Follow(nobody, 2, verdict(training(1), 2)))
    nobody.close()
    assert not wake.is_set()


def test_a_member_whose_verdict_changed_since_the_pass_ends_the_wait_at_once(
    agent: tuple[Streaming, AgentClient],
) -> None:
    """The pass saw it prepared; by the time the stream starts, it switched."""
    handler, client = agent
    handler.given.put(switched(2, step=12))
    wake = threading.Event()
    seen = verdict(training(1, pending=pending(2)), 2)
    sentinel.wait(wake, PERIOD, sentinel.Follow(client, 2, seen))
    assert wake.is_set()


def test_the_member_followed_is_the_first_of_the_new_world_that_has_not_settled() -> None:
    p0, p1, p2 = "p0", "p1", "p2"
    three = job(3)
    new, old = world(three, [p0, p1, p2], 2), world(three, [p0, p1], 1)
    grow = InFlight(epoch=2, reason="grow", new=new, store=("h", 1), started=NOW, old=old)
    prepared = training(1, pending=pending(2))
    everyone = [pod(m, prepared, role="member") for m in (p0, p1, p2)]
    assert watched_member(grow, seen(*everyone)) == (p0, (False, False, False, False))
    settled = pod(p0, switched(2), role="member")
    account_missing = pod(p1, training(2), role="member")
    followed = watched_member(grow, seen(settled, account_missing, everyone[2]))
    assert followed == (p1, (True, False, False, False))
    gone = pod(p1, None, gone=True)
    assert watched_member(grow, seen(settled, gone, everyone[2])) == (p2, verdict(prepared, 2))
    assert watched_member(grow, seen(settled, pod(p1, switched(2)), pod(p2, switched(2)))) is None
