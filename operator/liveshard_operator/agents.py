"""The operator's side of the agent API (proto/liveshard/v1/agent.proto): one client per agent.

The channel is mutual TLS when the job's agents serve it (`ClientTls`: the operator's client
certificate, and the job's CA and server name to verify the agent by), plaintext for an agent
started without TLS. Every call carries the job's token and a deadline; a failed call raises
`AgentError` with the gRPC status code, retryable when the agent may answer later (unavailable,
deadline exceeded).
What the agents' messages mean to the operator (a switch's result, its cause) is read in
`messages`, which needs no channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from liveshard.codes import MAY_ANSWER_LATER
from liveshard.layouts import to_message
from liveshard.v1 import agent_pb2 as pb
from liveshard.v1 import agent_pb2_grpc as pb_grpc
from liveshard_core.errors import LiveshardError
from liveshard_core.job import MEMBER_KEY

from .actions import Prepare

FAN_OUT = 32  # agent calls of one pass in flight at once
# The operator knows every world's layout: an agent's answer leaves its own out.
_STATUS = pb.GetStatusRequest(omit_layout=True)
T = TypeVar("T")


def fan_out(call: Callable[[Any], T], actions: list[Any], per_call: int = 1) -> list[T]:
    """`call` on every action at once, at most FAN_OUT members' calls at a time (`per_call`:
    the most members one action's call is for, in a pod of several): a reconfiguration's agent
    calls cost the slowest agent's time, not the sum over members."""
    if len(actions) <= 1:
        return [call(a) for a in actions]
    with ThreadPoolExecutor(max_workers=min(max(FAN_OUT // per_call, 1), len(actions))) as pool:
        return list(pool.map(call, actions))


class AgentError(LiveshardError):
    def __init__(self, member: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"agent {member}: {code.name}: {details}")
        self.member, self.code, self.details = member, code, details

    @property
    def retryable(self) -> bool:
        return self.code in MAY_ANSWER_LATER


@dataclass(frozen=True)
class ClientTls:
    """What the operator presents to a job's agents and checks them by (PEM)."""

    ca: bytes  # the job's CA: the agent's certificate must chain to it
    cert: bytes  # the operator's client certificate
    key: bytes = field(repr=False)
    server_name: str  # the name the agent's certificate carries (pod IPs it cannot)


class AgentClient:
    """The agent of one member, at its pod's `host:port`; over mutual TLS with `tls`."""

    def __init__(
        self,
        member: str,
        host: str,
        port: int,
        token: str,
        timeout: float = 10.0,
        tls: ClientTls | None = None,
    ) -> None:
        self.member, self.timeout, self.tls = member, timeout, tls
        target = f"{host}:{port}"
        if tls is None:
            self.channel = grpc.insecure_channel(target)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
            )
            options = [("grpc.ssl_target_name_override", tls.server_name)]
            self.channel = grpc.secure_channel(target, credentials, options)
        self.stub = pb_grpc.AgentStub(self.channel)  # type: ignore[no-untyped-call]  # generated
        self.auth = ("authorization", f"Bearer {token}")
        # The member's name routes the call to it inside a pod of several members.
        self.metadata = (self.auth, (MEMBER_KEY, member))

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: object, members: Sequence[str] = ()) -> object:
        """Call `method` on this client's member, or on `members` (of its pod) at once."""
        metadata: tuple[tuple[str, str], ...] = self.metadata
        if members:
            metadata = (self.auth, *((MEMBER_KEY, m) for m in members))
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as err:
            named = ", ".join(members) or self.member
            raise AgentError(named, err.code(), err.details() or "") from None

    def status(self) -> pb.AgentStatus:
        return self._call("GetStatus", _STATUS)  # type: ignore[return-value]

    def pod_status(self) -> pb.PodStatus:
        """The status of every member of this member's pod, in one call."""
        return self._call("GetPodStatus", _STATUS)  # type: ignore[return-value]

    def watch(self, seconds: float) -> Any:
        """The member's status now, then on every change, for `seconds`: a stream of
        `AgentStatus` (iterate it; `cancel` ends it; a failure raises `grpc.RpcError`)."""
        return self.stub.WatchStatus(
            pb.WatchStatusRequest(), timeout=seconds, metadata=self.metadata
        )

    def host_store(self, epoch: int) -> tuple[str, int]:
        reply = self._call("HostStore", pb.HostStoreRequest(epoch=epoch))
        address = reply.address  # type: ignore[attr-defined]
        return address.host, address.port

    def prepare(self, request: pb.PrepareRequest, members: Sequence[str] = ()) -> None:
        """Send a Prepare (`prepare_request`): the same request goes to every member. Given
        `members` (this client's and others of its pod of several), it goes to all of them in
        one call, which the pod's proxy passes on to each."""
        self._call("Prepare", request, members)

    def switch(self, epoch: int, at_step: int, members: Sequence[str] = ()) -> None:
        """Let a prepared epoch switch at `at_step` (a member undecided in it: commit it); given
        `members`, them all in one call (as `prepare`)."""
        self._call("Switch", pb.SwitchRequest(epoch=epoch, at_step=at_step), members)

    def abort(self, epoch: int, wait: bool = True, members: Sequence[str] = ()) -> None:
        """Abort `epoch` on the member (given `members`, on them all in one call, as `prepare`):
        OK once it dropped it (`wait`: at its next step boundary) or once the drop is queued;
        ABORTED when the epoch is in effect there."""
        self._call("Abort", pb.AbortRequest(epoch=epoch, queue_only=not wait), members)

    def checkpoint(
        self, number: int, path: str, at_step: int, export_to: str = "", members: Sequence[str] = ()
    ) -> None:
        """Ask for a checkpoint; given `members`, of them all in one call (as `prepare`)."""
        request = pb.CheckpointRequest(
            number=number, path=path, at_step=at_step, export_to=export_to
        )
        self._call("Checkpoint", request, members)

    def release(self, saved: int = 0, discard: bool = False, members: Sequence[str] = ()) -> None:
        """Release the member (`saved`, `discard`: see ReleaseRequest); given `members`, them all
        in one call (as `prepare`)."""
        self._call("Release", pb.ReleaseRequest(saved=saved, discard=discard), members)

    def rotate_certificate(self, cert: bytes, key: bytes, ca: bytes = b"") -> None:
        self._call("RotateCertificate", pb.RotateCertificateRequest(cert=cert, key=key, ca=ca))


def prepare_request(prepare: Prepare) -> pb.PrepareRequest:
    """The PrepareRequest of `prepare` (its member is not in it: the call's metadata names it)."""
    request = pb.PrepareRequest(
        epoch=prepare.epoch, store=pb.StoreAddress(host=prepare.store[0], port=prepare.store[1]),
        to=to_message(prepare.to), lost=prepare.lost, budget_bytes=prepare.budget,
        restore_from=prepare.restore_from, pods=dict(prepare.pods),
        deadlines=pb.Deadlines(
            op_seconds=prepare.deadlines.op, switch_seconds=prepare.deadlines.switch,
            prepare_seconds=prepare.deadlines.prepare,
        ),
    )  # fmt: skip
    if prepare.old is not None:
        getattr(request, "from").CopyFrom(to_message(prepare.old))
    return request
