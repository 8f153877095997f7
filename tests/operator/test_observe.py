"""The operator's reads of a pass over real gRPC (`observe`): an agent of an earlier version,
which does not know `GetPodStatus`, is still seen, one member at a time. The supervisor's side is
tested in tests/agent/server/test_pod.py, the whole on the local cluster in tests/e2e."""

from __future__ import annotations

from typing import Any

import grpc
from liveshard_operator.agents import AgentClient, ClientTls
from liveshard_operator.observe import observe

from liveshard.v1 import agent_pb2 as pb
from liveshard_agent.server import listen
from liveshard_core.job import MEMBER_KEY
from liveshard_e2e.procs import free_port
from tests.helpers import OnePod, pod_body

TOKEN = "observe-token"


class EarlierPod(grpc.GenericRpcHandler):
    """A pod whose supervisor knows `GetStatus` only: each member's status by the name a call
    carries."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not details.method.endswith("/GetStatus"):
            return None  # UNIMPLEMENTED

        def status(_: bytes, context: grpc.ServicerContext) -> bytes:
            member = dict(context.invocation_metadata() or ())[MEMBER_KEY]
            answer = pb.AgentStatus(member=str(member), phase=pb.AgentStatus.STANDBY, ready=True)
            return bytes(answer.SerializeToString())

        return grpc.unary_unary_rpc_method_handler(status)


def test_an_agent_without_the_pods_call_is_asked_member_by_member() -> None:
    port = free_port()
    server = listen.serve(EarlierPod(), TOKEN, f"127.0.0.1:{port}", None, 8, "earlier")
    body = pod_body("p", 3, "127.0.0.1")
    clients: dict[str, AgentClient] = {}

    def no_tls() -> ClientTls:
        raise AssertionError("a plaintext pod needs no certificates")

    try:
        seen = observe(OnePod(body), "ns", "job", TOKEN, port, clients, no_tls)  # type: ignore[arg-type]
        assert sorted(seen.pods) == ["p-0", "p-1", "p-2"]
        for name, found in seen.pods.items():
            assert found.agent is not None and found.agent.member == name and found.pod == "p"
    finally:
        for client in clients.values():
            client.close()
        server.stop(None)
