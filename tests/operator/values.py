"""What a reconcile pass sees, built by hand for tests: the job, its pods, their agents' statuses
(the proto messages the agents send) and the worlds the record names. No cluster, no agent."""

from __future__ import annotations

import copy
from typing import Any

from liveshard_operator import policy
from liveshard_operator.observation import Job, Observation, Pod
from liveshard_operator.spec import JobSpec
from liveshard_operator.world import World

from liveshard.v1 import agent_pb2 as pb

NOW = 1_000_000.0  # the pass's time, in seconds since the epoch

BODY: dict[str, Any] = {
    "apiVersion": "liveshard.io/v1alpha1",
    "kind": "ElasticTrainingJob",
    "metadata": {"name": "tiny", "namespace": "ns", "uid": "u-1", "generation": 3},
    "spec": {
        "replicas": 4, "minReplicas": 1, "maxReplicas": 8,
        "parallelism": {"zero": 1},
        # Shards held once: the decisions are tested on ZeRO's own layouts (mirrored ones in
        # test_decide's snapshot cases).
        "faultTolerance": {"snapshots": False},
        "model": {"preset": "tiny"},
        # dp must divide 24 / 2 = 12: 5 members can use only 4.
        "training": {"globalBatch": 24, "microBatch": 2, "seqLen": 64, "steps": 100},
        "reconfiguration": {"memoryBudget": "64Mi", "opTimeoutSeconds": 10},
        "template": {"spec": {"containers": [{"name": "agent"}]}},
    },
}  # fmt: skip


def job(replicas: int = 4, **spec: Any) -> Job:
    body = copy.deepcopy(BODY)
    body["spec"].update(replicas=replicas, **spec)
    parsed = JobSpec.parse(body["spec"])
    return Job(body, parsed, parsed.model_spec())


def standby(**fields: Any) -> pb.AgentStatus:
    return pb.AgentStatus(phase=pb.AgentStatus.STANDBY, ready=True, epoch=-1, **fields)


def starting() -> pb.AgentStatus:
    return pb.AgentStatus(phase=pb.AgentStatus.STARTING, ready=False, epoch=-1)


def failed(message: str) -> pb.AgentStatus:
    """An agent that cannot go on (it refused its job's configuration, its loop failed)."""
    return pb.AgentStatus(phase=pb.AgentStatus.FAILED, ready=True, epoch=-1, message=message)


def training(epoch: int, step: int = 10, **fields: Any) -> pb.AgentStatus:
    return pb.AgentStatus(phase=pb.AgentStatus.TRAINING, ready=True, epoch=epoch, step=step,
                          loss=2.5, **fields)  # fmt: skip


def broken(epoch: int, step: int = 10, **fields: Any) -> pb.AgentStatus:
    return pb.AgentStatus(phase=pb.AgentStatus.BROKEN, ready=True, epoch=epoch, step=step,
                          **fields)  # fmt: skip


def done(epoch: int) -> pb.AgentStatus:
    return pb.AgentStatus(phase=pb.AgentStatus.DONE, ready=True, epoch=epoch, step=100)


def pending(epoch: int, state: int = pb.Pending.PREPARED, reason: str = "") -> pb.Pending:
    return pb.Pending(epoch=epoch, state=state, reason=reason)  # type: ignore[arg-type]


def switch(
    epoch: int,
    result: int,
    cause: int = pb.SwitchSummary.CAUSE_UNSPECIFIED,
    reason: str = "",
    **fields: Any,
) -> pb.SwitchSummary:
    return pb.SwitchSummary(epoch=epoch, result=result, cause=cause, reason=reason,  # type: ignore[arg-type]
                            **fields)  # fmt: skip


def switched(epoch: int, **fields: Any) -> pb.AgentStatus:
    """A member training in `epoch`, its account of the switch into it given."""
    return training(epoch, last_switch=switch(epoch, pb.SwitchSummary.COMMITTED), **fields)


def checkpoint(number: int, step: int, path: str) -> pb.CheckpointSummary:
    return pb.CheckpointSummary(number=number, step=step, path=path)


def pod(
    name: str,
    agent: pb.AgentStatus | None,
    *,
    role: str = "",
    leaving: bool = False,
    gone: bool = False,
    created: str = "",
    error: str = "",
    since: float = NOW - 1,
    unschedulable: str = "",
    failure: str = "",
    node: str = "",
) -> Pod:
    """A pod; pods are created in name order unless `created` says otherwise, and scheduled a
    second before the pass unless `since` or `unschedulable` says otherwise; `failure`: how a
    container of it failed, as the kubelet says."""
    return Pod(
        name=name, ip=None if gone else f"10.0.0.{name[-1]}", role=role, leaving=leaving,
        gone=gone, created=created or f"2024-01-01T00:00:0{name[-1]}Z", agent=agent,
        error=error or ("" if agent is not None else f"agent {name}: UNAVAILABLE"),
        since=since, unschedulable=unschedulable, failure=failure, node=node,
    )  # fmt: skip


def seen(*pods: Pod) -> Observation:
    return Observation({p.name: p for p in pods})


def world(the_job: Job, members: list[str], epoch: int) -> World:
    """The world the policy chooses for `members` (all of them used), in `epoch`."""
    choice = policy.choose(the_job.model, the_job.spec, len(members))
    assert choice.used == len(members), (members, choice.why)
    return World.of(epoch, choice.degrees.layout(the_job.model, members))
