"""What one reconcile pass sees, as values: the job as read (its spec parsed), its pods, whether
each is leaving or gone, and what each pod's agent said.

A pod the scheduler could not place carries the scheduler's verdict (`unschedulable`); a pod's
`since` is when it was scheduled (else created): how long it has had to become ready. A pod whose
container ended with an error or crash-loops carries the kubelet's account of it (`failure`: the
container, its reason, exit code and the last lines of its termination message); a pod the kubelet
ended from outside (evicted, its node shut down: the pod's own `reason`) did not fail.

A pod is *leaving* when it is being deleted, has a `DisruptionTarget` condition, or sits on a
node that is cordoned or tainted `NoExecute`: its state must move out now. A pod is *gone* when
it has ended (a worker never restarts in place: its state is lost with its process).

Pure: the reads themselves (the API server, the agents) are `observe`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from liveshard.v1 import agent_pb2 as pb
from liveshard_core.vps.spec import ModelSpec

from .render import ROLE_LABEL
from .spec import JobSpec

_TRAINING = (pb.AgentStatus.TRAINING, pb.AgentStatus.DONE)


def trains_in(agent: pb.AgentStatus | None, epoch: int) -> bool:
    """Whether the agent trains (or has trained its last step) in `epoch` or a later one."""
    return agent is not None and agent.epoch >= epoch and agent.phase in _TRAINING


@dataclass(frozen=True)
class Job:
    """The ElasticTrainingJob as read at the start of the pass, with its spec parsed."""

    body: dict[str, Any]  # the object as the API server returned it
    spec: JobSpec
    model: ModelSpec  # the model as the agents build it (`spec.model_spec()`)

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def generation(self) -> int:
        return int(self.body["metadata"].get("generation", 0))

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.body.get("status") or {})


@dataclass(frozen=True)
class Pod:
    """A member's pod as seen, with what the member's agent said: a pod of several members (
    `render.pod_members`) is seen once per member, each named as its member."""

    name: str
    ip: str | None
    role: str
    leaving: bool
    gone: bool
    created: str
    agent: pb.AgentStatus | None  # None: not answering (yet)
    error: str = ""
    since: float = 0.0  # when it was scheduled, else created (seconds since the epoch)
    unschedulable: str = ""  # the scheduler's "reason: message" when it could not place it
    failure: str = ""  # how a container of it failed, as the kubelet says ("": none did)
    node: str = ""  # the node it is scheduled on ("": not yet)
    pod: str = ""  # the pod's name, when it is not `name` (a pod of several members)
    ended: float = 0.0  # when its last container ended, for a gone pod (seconds since the epoch)
    deleting: bool = False  # its deletion was asked already (it has a deletionTimestamp)

    @property
    def pod_name(self) -> str:
        return self.pod or self.name

    @property
    def ready(self) -> bool:
        return self.agent is not None and self.agent.ready and not self.leaving and not self.gone

    @property
    def standing_by(self) -> bool:
        return self.ready and self.agent is not None and self.agent.phase == pb.AgentStatus.STANDBY


@dataclass(frozen=True)
class Observation:
    pods: dict[str, Pod]

    def pod_name(self, member: str) -> str:
        """The name of `member`'s pod (the member's own when it was not seen)."""
        pod = self.pods.get(member)
        return member if pod is None else pod.pod_name

    def pod_of(self) -> dict[str, str]:
        """Each member's pod, for the members of pods of several (empty when each pod is one)."""
        return {name: pod.pod for name, pod in self.pods.items() if pod.pod}

    def nodes(self) -> dict[str, str]:
        """Each scheduled pod's node."""
        return {name: pod.node for name, pod in self.pods.items() if pod.node}

    def live(self) -> list[Pod]:
        """Pods that are neither gone nor leaving, oldest first."""
        return sorted(
            (p for p in self.pods.values() if not p.gone and not p.leaving),
            key=lambda p: (p.created, p.name),
        )


def node_leaving(node: dict[str, Any]) -> bool:
    spec = node.get("spec") or {}
    taints = spec.get("taints") or []
    return bool(spec.get("unschedulable")) or any(t.get("effect") == "NoExecute" for t in taints)


def gone(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


def leaving(pod: dict[str, Any], leaving_nodes: set[str]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return True
    conditions = (pod.get("status") or {}).get("conditions") or []
    if any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conditions):
        return True
    return (pod.get("spec") or {}).get("nodeName") in leaving_nodes


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp() if stamp else 0.0


def _ended_at(pod: dict[str, Any]) -> float:
    """When the last of `pod`'s containers ended (0: none says)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    stamps = [((s.get("state") or {}).get("terminated") or {}).get("finishedAt") for s in statuses]
    return max((_seconds(t) for t in stamps if t), default=0.0)


def _scheduling(pod: dict[str, Any]) -> tuple[float, str]:
    """(since, unschedulable) of a pod: see the module's docstring."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    scheduled: dict[str, Any] = next((c for c in conditions if c.get("type") == "PodScheduled"), {})
    created = _seconds(pod["metadata"].get("creationTimestamp", ""))
    if scheduled.get("status") == "True":
        return _seconds(scheduled.get("lastTransitionTime", "")) or created, ""
    if scheduled.get("status") == "False":
        verdict = f"{scheduled.get('reason', 'Unschedulable')}: {scheduled.get('message', '')}"
        return created, verdict.strip().rstrip(":")
    return created, ""


_TAIL_LINES = 3  # of a termination message (the agent's last log lines on an error)
_TAIL_CHARS = 500


def _tail(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    tail = " | ".join(lines[-_TAIL_LINES:])
    return tail if len(tail) <= _TAIL_CHARS else "..." + tail[-_TAIL_CHARS:]


def _ended(name: str, terminated: dict[str, Any], prefix: str = "") -> str:
    how = f"{terminated.get('reason') or 'Error'}, exit code {terminated.get('exitCode')}"
    tail = _tail(str(terminated.get("message") or ""))
    return f"container {name}: {prefix}{how}" + (f": {tail}" if tail else "")


def failure(pod: dict[str, Any]) -> str:
    """How a container of `pod` failed, from its status ("": none did; see the module's
    docstring): an init or a regular container that ended with a non-zero exit code, or one
    the kubelet restarts in a crash loop."""
    status = pod.get("status") or {}
    if status.get("reason"):
        return ""
    for entry in [*(status.get("initContainerStatuses") or []),
                  *(status.get("containerStatuses") or [])]:  # fmt: skip
        name, state = str(entry.get("name", "")), entry.get("state") or {}
        terminated = state.get("terminated") or {}
        if terminated and int(terminated.get("exitCode") or 0) != 0:
            return _ended(name, terminated)
        waiting = state.get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            last = (entry.get("lastState") or {}).get("terminated") or {}
            if last:
                return _ended(name, last, "crash-looping, last ")
            return f"container {name}: CrashLoopBackOff: {waiting.get('message', '')}".rstrip(": ")
    return ""


def pod_of(
    pod: dict[str, Any], leaving_nodes: set[str], agent: pb.AgentStatus | None, error: str = ""
) -> Pod:
    """A pod as the API server returned it, with what its agent said (or why it said nothing)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    since, unschedulable = _scheduling(pod)
    return Pod(
        name=meta["name"], ip=status.get("podIP"),
        role=(meta.get("labels") or {}).get(ROLE_LABEL, ""),
        leaving=leaving(pod, leaving_nodes), gone=gone(pod),
        created=meta.get("creationTimestamp", ""), agent=agent, error=error, since=since,
        unschedulable=unschedulable, failure=failure(pod),
        node=(pod.get("spec") or {}).get("nodeName") or "",
        ended=_ended_at(pod) if gone(pod) else 0.0,
        deleting=bool(meta.get("deletionTimestamp")),
    )  # fmt: skip
